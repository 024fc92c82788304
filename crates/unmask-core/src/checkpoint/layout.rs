//! The headers of a checkpoint's files, without their data: every tensor located by name
//! and checked (dtype, shape, quantized layout) before a byte of it is read.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorInfo};

use super::{
    CheckpointError, FileHeader, META_BLOCK, META_ROW_ALIGN, QWEIGHT_SUFFIX, SCALES_SUFFIX,
    ShardIndex, StoredDType,
};
use crate::quant::{self, QuantFormat};

/// Where a tensor's bytes lie: file index and byte range within that file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub file: usize,
    pub bytes: Range<usize>,
}

/// A float tensor located and checked in a layout.
pub struct TensorEntry<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub dtype: StoredDType,
    pub shape: &'a [usize],
    pub span: Span,
}

/// A quantized matrix located and checked in a layout: its codes and scales tensors.
pub struct QuantEntry<'a> {
    pub path: &'a Path,
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub code_name: String,
    pub scale_name: String,
    pub codes: Span,
    pub scales: Span,
}

impl QuantEntry<'_> {
    pub fn stored_bytes(&self) -> usize {
        self.codes.bytes.len() + self.scales.bytes.len()
    }
}

/// The headers of every file of a checkpoint and a tensor name → file index: enough to
/// check the checkpoint against a config and plan its upload without its data.
pub struct CheckpointLayout {
    dir: PathBuf,
    pub files: Vec<FileHeader>,
    by_name: HashMap<String, usize>,
}

impl CheckpointLayout {
    /// The layout of a sharded checkpoint: `files` are the headers of `index.shards`, in
    /// that order. Every tensor the index names must be in the shard it names.
    pub fn sharded(
        dir: &Path,
        index: &ShardIndex,
        files: Vec<FileHeader>,
    ) -> Result<Self, CheckpointError> {
        let index_err = |message: String| CheckpointError::Index {
            path: index.path.clone(),
            message,
        };
        if files.len() != index.shards.len() {
            return Err(index_err(format!(
                "names {} shards ({}), {} headers were given",
                index.shards.len(),
                index.shards.join(", "),
                files.len()
            )));
        }
        let mut by_name = HashMap::new();
        for (name, file) in &index.wanted {
            // `shards` is public, so a caller may have changed it since `parse` listed every
            // shard a tensor names.
            let idx = index
                .shards
                .iter()
                .position(|s| s == file)
                .ok_or_else(|| index_err(format!("{name} is in shard {file}, not listed")))?;
            if !files[idx].tensors.contains_key(name) {
                return Err(CheckpointError::MissingTensor {
                    name: name.clone(),
                    looked_in: format!(
                        "{} (named by {})",
                        files[idx].path.display(),
                        index.path.display()
                    ),
                });
            }
            by_name.insert(name.clone(), idx);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            by_name,
        })
    }

    /// The layout of a checkpoint of one file.
    pub fn single(dir: &Path, file: FileHeader) -> Self {
        let by_name = file.tensors.keys().map(|n| (n.clone(), 0)).collect();
        Self {
            dir: dir.to_path_buf(),
            files: vec![file],
            by_name,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// The file holding tensor `name`, if any.
    pub fn file_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// A `__metadata__` value of the checkpoint's files (the first file that has the key).
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.files
            .iter()
            .find_map(|f| f.metadata.get(key).map(String::as_str))
    }

    /// Total bytes of tensor data over all files. Saturates: the headers of a stream whose
    /// length is unknown may claim more than u64 holds over several files.
    pub fn data_bytes(&self) -> u64 {
        self.files
            .iter()
            .map(FileHeader::data_len)
            .fold(0, u64::saturating_add)
    }

    fn span(&self, file: usize, info: &TensorInfo) -> Span {
        let start = self.files[file].data_start;
        Span {
            file,
            bytes: start + info.data_offsets.0..start + info.data_offsets.1,
        }
    }

    /// The `[rows, cols]` matrix `name` (e.g. `...q_proj.weight`) when the checkpoint stores
    /// it quantized, as `unmask quantize` writes it: `<prefix>.qweight` (I8 codes for q8,
    /// U8 nibble pairs for q4, `crate::quant` layout) and `<prefix>.scales` (F16),
    /// where `<prefix>` is `name` without `.weight`. None when it is stored as floats.
    pub fn quantized_entry(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<QuantEntry<'_>>, CheckpointError> {
        let prefix = name.strip_suffix(".weight").unwrap_or(name);
        let code_name = format!("{prefix}{QWEIGHT_SUFFIX}");
        let Some(&idx) = self.by_name.get(&code_name) else {
            return Ok(None);
        };
        let file = &self.files[idx];
        let fail = |message: String| CheckpointError::Quantized {
            name: code_name.clone(),
            path: file.path.clone(),
            message,
        };
        for (key, want) in [
            (META_BLOCK, quant::BLOCK),
            (META_ROW_ALIGN, quant::ROW_ALIGN),
        ] {
            let found = self.metadata(key);
            if found != Some(want.to_string().as_str()) {
                return Err(fail(format!(
                    "quantized tensors need __metadata__ {key} = \"{want}\", found {found:?}"
                )));
            }
        }
        let codes = &file.tensors[&code_name];
        let format = match codes.dtype {
            Dtype::I8 => QuantFormat::Q8,
            Dtype::U8 => QuantFormat::Q4,
            other => {
                return Err(fail(format!(
                    "expected dtype I8 (q8 codes) or U8 (q4 codes), found {other:?}"
                )));
            }
        };
        let code_shape = vec![rows, format.row_code_bytes(cols)];
        if codes.shape != code_shape {
            return Err(fail(format!(
                "{} codes of a [{rows}, {cols}] matrix: expected shape {code_shape:?}, found {:?}",
                format.name(),
                codes.shape
            )));
        }
        let scale_name = format!("{prefix}{SCALES_SUFFIX}");
        let &sidx =
            self.by_name
                .get(&scale_name)
                .ok_or_else(|| CheckpointError::MissingTensor {
                    name: scale_name.clone(),
                    looked_in: format!("{} (the scales of {code_name})", file.path.display()),
                })?;
        let sfile = &self.files[sidx];
        let scales = &sfile.tensors[&scale_name];
        let scale_shape = vec![rows, quant::row_blocks(cols)];
        if scales.dtype != Dtype::F16 || scales.shape != scale_shape {
            return Err(CheckpointError::Quantized {
                name: scale_name,
                path: sfile.path.clone(),
                message: format!(
                    "scales of a [{rows}, {cols}] matrix: expected F16 {scale_shape:?}, found {:?} {:?}",
                    scales.dtype, scales.shape
                ),
            });
        }
        Ok(Some(QuantEntry {
            path: &file.path,
            format,
            rows,
            cols,
            codes: self.span(idx, codes),
            scales: self.span(sidx, scales),
            code_name,
            scale_name,
        }))
    }

    /// The float tensor `name`, checked against the expected shape.
    pub fn tensor_entry(
        &self,
        name: &str,
        expected_shape: &[usize],
    ) -> Result<TensorEntry<'_>, CheckpointError> {
        let (key, &idx) =
            self.by_name
                .get_key_value(name)
                .ok_or_else(|| CheckpointError::MissingTensor {
                    name: name.to_string(),
                    looked_in: self
                        .files
                        .iter()
                        .map(|f| f.path.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
        let file = &self.files[idx];
        let info = &file.tensors[name];
        let dtype = match info.dtype {
            Dtype::BF16 => StoredDType::BF16,
            Dtype::F16 => StoredDType::F16,
            Dtype::F32 => StoredDType::F32,
            other => {
                return Err(CheckpointError::DType {
                    name: name.to_string(),
                    path: file.path.clone(),
                    found: format!("{other:?}"),
                });
            }
        };
        if info.shape != expected_shape {
            return Err(CheckpointError::Shape {
                name: name.to_string(),
                path: file.path.clone(),
                expected: expected_shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        Ok(TensorEntry {
            name: key,
            path: &file.path,
            dtype,
            shape: &info.shape,
            span: self.span(idx, info),
        })
    }
}

/// Refuses a path that is not a regular file, before anything opens it: opening a FIFO
/// blocks until a writer comes (forever, for a stray `mkfifo model.safetensors`), and a
/// directory, socket or device is never a checkpoint file. `metadata` follows symlinks, so
/// the Hugging Face cache's snapshot files, links to blobs elsewhere, are judged by the blob.
/// The file could still be swapped between this check and the open; that needs someone
#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::tests::fixture_dir;

    #[test]
    fn sharded_with_the_wrong_number_of_headers_is_an_index_error() {
        let index_text =
            std::fs::read_to_string(fixture_dir().join("model.safetensors.index.json")).unwrap();
        let index = ShardIndex::parse(Path::new("index.json"), &index_text).unwrap();
        let err = CheckpointLayout::sharded(Path::new("."), &index, Vec::new())
            .err()
            .expect("no headers for two shards");
        assert!(
            matches!(&err, CheckpointError::Index { message, .. } if message.contains("2 shards")),
            "{err}"
        );
    }
}
