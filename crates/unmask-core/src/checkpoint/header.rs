//! The header of a safetensors file: an 8-byte length, then JSON that places every tensor
//! in the data section. Parsed from the file's first bytes alone, so a stream can be
//! checked before its body arrives.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorInfo;

use super::CheckpointError;

/// The header of one safetensors file: where each of its tensors lies.
pub struct FileHeader {
    pub path: PathBuf,
    /// Offset of the data section in the file (8 + the header's length).
    pub data_start: usize,
    pub(super) tensors: HashMap<String, TensorInfo>,
    /// The header's `__metadata__`.
    pub(super) metadata: HashMap<String, String>,
}

/// Largest header accepted from a stream (the safetensors crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

impl FileHeader {
    /// Bytes at the start of a file taken by its header, from the file's first 8 bytes.
    pub fn header_len(path: &Path, first8: &[u8]) -> Result<usize, CheckpointError> {
        let corrupt = |message: String| CheckpointError::Corrupt {
            path: path.to_path_buf(),
            message,
        };
        let word: [u8; 8] = first8
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| corrupt(format!("{} bytes, fewer than 8", first8.len())))?;
        let n = u64::from_le_bytes(word);
        if n > MAX_HEADER_BYTES {
            return Err(corrupt(format!("a header of {n} bytes")));
        }
        Ok(8 + n as usize)
    }

    /// Parses a header from the first `header_len` bytes of a file whose length is
    /// `file_len` when known (a stream without a length is checked when it ends).
    pub fn parse(path: &Path, head: &[u8], file_len: Option<u64>) -> Result<Self, CheckpointError> {
        let corrupt = |message: String| CheckpointError::Corrupt {
            path: path.to_path_buf(),
            message,
        };
        let len = Self::header_len(path, head)?;
        let json = head.get(8..len).ok_or_else(|| {
            corrupt(format!(
                "the header needs {len} bytes, found {}",
                head.len()
            ))
        })?;
        // Deserializing validates that the tensors tile the data section in order.
        let meta: safetensors::tensor::Metadata =
            serde_json::from_slice(json).map_err(|e| corrupt(e.to_string()))?;
        // Offsets are any usize the JSON holds: a header claiming a data section that ends
        // past usize::MAX would make every span computed from it (data_start + offset)
        // overflow. Checked here, once, so spans can be added without checks.
        let file_end = len.checked_add(meta.data_len()).ok_or_else(|| {
            corrupt(format!(
                "the header describes {} bytes of data, more than any file can hold",
                meta.data_len()
            ))
        })?;
        if let Some(file_len) = file_len
            && file_len != file_end as u64
        {
            return Err(corrupt(format!(
                "the header describes {} bytes of data, the file holds {} (truncated?)",
                meta.data_len(),
                file_len.saturating_sub(len as u64)
            )));
        }
        Ok(Self::from_metadata(path, len, &meta))
    }

    fn from_metadata(path: &Path, data_start: usize, meta: &safetensors::tensor::Metadata) -> Self {
        Self {
            path: path.to_path_buf(),
            data_start,
            tensors: meta
                .tensors()
                .into_iter()
                .map(|(k, v)| (k, v.clone()))
                .collect(),
            metadata: meta.metadata().clone().unwrap_or_default(),
        }
    }

    /// Bytes of the data section.
    pub fn data_len(&self) -> u64 {
        self.tensors
            .values()
            .map(|t| t.data_offsets.1 as u64)
            .max()
            .unwrap_or(0)
    }

    /// Every tensor as (name, byte range within the data section), in file order.
    pub fn tensors_in_order(&self) -> Vec<(&str, Range<usize>)> {
        let mut out: Vec<(&str, Range<usize>)> = self
            .tensors
            .iter()
            .map(|(k, v)| (k.as_str(), v.data_offsets.0..v.data_offsets.1))
            .collect();
        out.sort_by_key(|(_, r)| (r.start, r.end));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;

    /// A safetensors file: the 8-byte length, the JSON header, then `data`.
    fn safetensors_file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    /// Offsets chained up to usize::MAX: the data section's end, 8 + header + data, does not
    /// fit in usize. Made `parse` and `SafeTensors::read_metadata` overflow (a panic with
    /// overflow checks, a wrapped length check without) instead of returning an error.
    #[test]
    fn a_data_section_past_usize_max_is_corrupt_not_an_overflow() {
        let chunk: usize = 1 << (usize::BITS - 4);
        let mut entries = Vec::new();
        let mut start = 0usize;
        for i in 0..16 {
            let len = if i == 15 { chunk - 1 } else { chunk };
            entries.push(format!(
                r#""t{i}":{{"dtype":"U8","shape":[{len}],"data_offsets":[{start},{}]}}"#,
                start + len
            ));
            start += len;
        }
        let file = safetensors_file(&format!("{{{}}}", entries.join(",")), &[]);
        let path = Path::new("huge.safetensors");
        for file_len in [None, Some(file.len() as u64)] {
            let err = FileHeader::parse(path, &file, file_len)
                .err()
                .expect("corrupt");
            assert!(
                err.to_string().contains("more than any file can hold"),
                "{err}"
            );
        }
        let err = Checkpoint::from_bytes(vec![("huge.safetensors".into(), file)], None)
            .err()
            .expect("corrupt");
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    }
}
