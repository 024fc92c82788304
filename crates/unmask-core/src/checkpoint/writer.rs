//! Writing safetensors files as a stream: the tensors (name, dtype, shape) are declared up
//! front, which fixes the header, and their bytes are then written in order, in chunks of
//! any size, so a file of many GB never has to be in memory.
//!
//! Layout (the safetensors format): an 8-byte little-endian header length N, N bytes of
//! JSON (`__metadata__` with string values, then one entry per tensor with `dtype`,
//! `shape` and `data_offsets` relative to the data section), padded with spaces so the data
//! starts at a multiple of 8 bytes, then the tensors' bytes back to back in declaration
//! order.

use std::collections::{BTreeMap, HashSet};
use std::io::{self, Write};

use thiserror::Error;

/// Element types of the safetensors format, spelled as in the header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    U16,
    I16,
    F16,
    BF16,
    U32,
    I32,
    F32,
    U64,
    I64,
    F64,
}

impl Dtype {
    /// The header's spelling (`"BF16"`, `"F8_E4M3"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::F32 => "F32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F64 => "F64",
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E5M2 | Dtype::F8E4M3 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }
}

/// A tensor as the header declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorDecl {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>) -> Self {
        Self {
            name: name.into(),
            dtype,
            shape,
        }
    }

    /// Elements, or None when the product overflows.
    pub fn numel(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
    }

    /// Bytes of data, or None when they overflow.
    pub fn byte_len(&self) -> Option<u64> {
        self.numel()?.checked_mul(self.dtype.size_bytes())
    }
}

#[derive(Debug, Error)]
pub enum SafetensorsError {
    #[error("tensor name {name:?} is declared twice")]
    DuplicateName { name: String },
    #[error("`__metadata__` is reserved for the header's metadata and cannot name a tensor")]
    ReservedName,
    #[error("tensor {name}: shape {shape:?} is too large to address")]
    TooLarge { name: String, shape: Vec<usize> },
    #[error("tensor {name}: {given} more bytes written where only {room} of its {declared} remain")]
    Overflow {
        name: String,
        declared: u64,
        room: u64,
        given: u64,
    },
    #[error("{given} bytes written after the last declared tensor")]
    PastEnd { given: u64 },
    #[error("tensor {name} is incomplete: {written} of its {declared} bytes were written")]
    Incomplete {
        name: String,
        written: u64,
        declared: u64,
    },
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// The header's data section is aligned to this many bytes from the start of the file.
const ALIGN: usize = 8;

/// The file's first bytes: the header length, the JSON header, and its space padding.
pub fn header_bytes(
    metadata: &BTreeMap<String, String>,
    tensors: &[TensorDecl],
) -> Result<Vec<u8>, SafetensorsError> {
    let mut seen = HashSet::new();
    // Written by hand (not through a JSON map) so the key order, and so the bytes, are
    // fixed: metadata first, then the tensors in data order.
    let mut json = String::from("{");
    if !metadata.is_empty() {
        json.push_str("\"__metadata__\":{");
        for (i, (key, value)) in metadata.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json.push_str(&json_string(key));
            json.push(':');
            json.push_str(&json_string(value));
        }
        json.push('}');
    }
    let mut offset = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if t.name == "__metadata__" {
            return Err(SafetensorsError::ReservedName);
        }
        if !seen.insert(t.name.as_str()) {
            return Err(SafetensorsError::DuplicateName {
                name: t.name.clone(),
            });
        }
        let end = t
            .byte_len()
            .and_then(|len| offset.checked_add(len))
            .ok_or_else(|| SafetensorsError::TooLarge {
                name: t.name.clone(),
                shape: t.shape.clone(),
            })?;
        if i > 0 || !metadata.is_empty() {
            json.push(',');
        }
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            json_string(&t.name),
            t.dtype.name(),
            shape.join(",")
        ));
        offset = end;
    }
    json.push('}');
    let mut header = json.into_bytes();
    let padded = header.len().div_ceil(ALIGN) * ALIGN;
    header.resize(padded, b' ');
    let mut out = Vec::with_capacity(8 + header.len());
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    Ok(out)
}

fn json_string(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

/// Writes one safetensors file: the header on creation, then the declared tensors' bytes in
/// declaration order through `write`, then `finish`.
pub struct SafetensorsWriter<W: Write> {
    out: W,
    tensors: Vec<TensorDecl>,
    /// End of each tensor's bytes in the data section.
    ends: Vec<u64>,
    /// The tensor the next bytes belong to (`tensors.len()` once all are complete).
    current: usize,
    /// Bytes of the data section written so far.
    written: u64,
    header_len: u64,
}

impl<W: Write> SafetensorsWriter<W> {
    /// Checks the declarations and writes the header.
    pub fn new(
        mut out: W,
        metadata: &BTreeMap<String, String>,
        tensors: Vec<TensorDecl>,
    ) -> Result<Self, SafetensorsError> {
        let header = header_bytes(metadata, &tensors)?;
        out.write_all(&header)?;
        let mut ends = Vec::with_capacity(tensors.len());
        let mut end = 0u64;
        for t in &tensors {
            // header_bytes has checked that the sizes and their sum fit.
            end += t.byte_len().unwrap_or(0);
            ends.push(end);
        }
        let mut writer = Self {
            out,
            tensors,
            ends,
            current: 0,
            written: 0,
            header_len: header.len() as u64,
        };
        writer.skip_complete();
        Ok(writer)
    }

    /// Bytes before the data section (the length prefix, the JSON and its padding).
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// Size of the whole file once every tensor is written.
    pub fn file_len(&self) -> u64 {
        self.header_len + self.ends.last().copied().unwrap_or(0)
    }

    /// The tensor the next bytes belong to; None when every tensor is complete.
    pub fn current(&self) -> Option<&TensorDecl> {
        self.tensors.get(self.current)
    }

    /// Bytes the current tensor still needs.
    pub fn remaining_in_current(&self) -> u64 {
        self.ends
            .get(self.current)
            .map_or(0, |&end| end - self.written)
    }

    /// Appends bytes of the current tensor. A write may not run past the current tensor's
    /// end, so a producer that writes a wrong amount is caught at the tensor it got wrong.
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), SafetensorsError> {
        if bytes.is_empty() {
            return Ok(());
        }
        let given = bytes.len() as u64;
        let Some(t) = self.tensors.get(self.current) else {
            return Err(SafetensorsError::PastEnd { given });
        };
        let room = self.remaining_in_current();
        if given > room {
            return Err(SafetensorsError::Overflow {
                name: t.name.clone(),
                declared: t.byte_len().unwrap_or(0),
                room,
                given,
            });
        }
        self.out.write_all(bytes)?;
        self.written += given;
        self.skip_complete();
        Ok(())
    }

    /// Moves past every tensor whose bytes are all written (including empty ones).
    fn skip_complete(&mut self) {
        while self.current < self.ends.len() && self.written == self.ends[self.current] {
            self.current += 1;
        }
    }

    /// Checks that every tensor is complete, flushes, and returns the sink.
    pub fn finish(mut self) -> Result<W, SafetensorsError> {
        if let Some(t) = self.tensors.get(self.current) {
            let start = if self.current == 0 {
                0
            } else {
                self.ends[self.current - 1]
            };
            return Err(SafetensorsError::Incomplete {
                name: t.name.clone(),
                written: self.written - start,
                declared: t.byte_len().unwrap_or(0),
            });
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> BTreeMap<String, String> {
        BTreeMap::from([("format".to_string(), "pt".to_string())])
    }

    fn decls() -> Vec<TensorDecl> {
        vec![
            TensorDecl::new("b.weight", Dtype::BF16, vec![2, 3]),
            TensorDecl::new("empty", Dtype::F32, vec![0, 4]),
            TensorDecl::new("a \"quoted\"", Dtype::U8, vec![5]),
            TensorDecl::new("scalar", Dtype::F32, vec![]),
        ]
    }

    fn write_all(chunk: usize) -> Vec<u8> {
        let mut w = SafetensorsWriter::new(Vec::new(), &meta(), decls()).unwrap();
        let data: Vec<u8> = (0..12 + 5 + 4).map(|i| i as u8).collect();
        let mut at = 0;
        while at < data.len() {
            let n = chunk.min(w.remaining_in_current() as usize);
            w.write(&data[at..at + n]).unwrap();
            at += n;
        }
        assert!(w.current().is_none());
        assert_eq!(w.file_len(), w.header_len() + 21);
        w.finish().unwrap()
    }

    #[test]
    fn reads_back_with_the_reference_parser() {
        let bytes = write_all(4);
        let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!((8 + n) % 8, 0, "data section is 8-byte aligned");
        assert_eq!(
            meta.metadata().as_ref().unwrap().get("format").unwrap(),
            "pt"
        );
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let b = st.tensor("b.weight").unwrap();
        assert_eq!(b.dtype(), safetensors::Dtype::BF16);
        assert_eq!(b.shape(), &[2, 3]);
        assert_eq!(b.data(), &(0..12).collect::<Vec<u8>>()[..]);
        let q = st.tensor("a \"quoted\"").unwrap();
        assert_eq!(q.dtype(), safetensors::Dtype::U8);
        assert_eq!(q.data(), &[12, 13, 14, 15, 16]);
        assert_eq!(st.tensor("empty").unwrap().shape(), &[0, 4]);
        assert_eq!(st.tensor("scalar").unwrap().data(), &[17, 18, 19, 20]);
        assert_eq!(bytes.len(), 8 + n + 21);
    }

    #[test]
    fn chunking_does_not_change_the_bytes() {
        let one = write_all(usize::MAX);
        assert_eq!(write_all(1), one);
        assert_eq!(write_all(3), one);
    }

    #[test]
    fn header_is_padded_with_spaces() {
        let h = header_bytes(&BTreeMap::new(), &decls()).unwrap();
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(h.len(), 8 + n);
        assert_eq!(n % 8, 0);
        let text = std::str::from_utf8(&h[8..]).unwrap();
        let json: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
        assert!(json.get("__metadata__").is_none());
        assert_eq!(json["b.weight"]["data_offsets"], serde_json::json!([0, 12]));
        assert_eq!(json["scalar"]["dtype"], "F32");
    }

    #[test]
    fn misuse_is_named() {
        let mut w = SafetensorsWriter::new(Vec::new(), &meta(), decls()).unwrap();
        assert_eq!(w.current().unwrap().name, "b.weight");
        let e = w.write(&[0; 13]).unwrap_err();
        assert!(
            matches!(&e, SafetensorsError::Overflow { name, room: 12, .. } if name == "b.weight"),
            "{e}"
        );
        w.write(&[0; 12]).unwrap();
        // The empty tensor is skipped.
        assert_eq!(w.current().unwrap().name, "a \"quoted\"");
        w.write(&[0; 2]).unwrap();
        let e = w.finish().unwrap_err();
        assert!(
            matches!(
                &e,
                SafetensorsError::Incomplete {
                    written: 2,
                    declared: 5,
                    ..
                }
            ),
            "{e}"
        );

        let mut w = SafetensorsWriter::new(Vec::new(), &meta(), vec![]).unwrap();
        assert!(matches!(
            w.write(&[1]),
            Err(SafetensorsError::PastEnd { given: 1 })
        ));

        let twice = vec![
            TensorDecl::new("x", Dtype::F32, vec![1]),
            TensorDecl::new("x", Dtype::F32, vec![1]),
        ];
        assert!(matches!(
            header_bytes(&meta(), &twice),
            Err(SafetensorsError::DuplicateName { .. })
        ));
        let reserved = vec![TensorDecl::new("__metadata__", Dtype::F32, vec![1])];
        assert!(matches!(
            header_bytes(&meta(), &reserved),
            Err(SafetensorsError::ReservedName)
        ));
        let huge = vec![TensorDecl::new("h", Dtype::F64, vec![usize::MAX, 4])];
        assert!(matches!(
            header_bytes(&meta(), &huge),
            Err(SafetensorsError::TooLarge { .. })
        ));
    }

    #[test]
    fn dtype_names_and_sizes() {
        assert_eq!(Dtype::BF16.name(), "BF16");
        assert_eq!(Dtype::F8E4M3.name(), "F8_E4M3");
        assert_eq!(Dtype::U32.size_bytes(), 4);
        assert_eq!(Dtype::F8E5M2.size_bytes(), 1);
    }
}
