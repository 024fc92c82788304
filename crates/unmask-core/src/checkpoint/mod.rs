//! Hugging Face safetensors checkpoints: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. A `CheckpointLayout` holds only the files' headers, so a
//! checkpoint can be checked and its upload planned before any tensor byte is read (a
//! browser streams the bodies afterwards); a `Checkpoint` adds the files' bytes, memory-mapped
//! natively. Tensors are located by name and validated (dtype, shape, bounds) before any byte
//! is converted. `writer` writes the format, as a stream.

#[cfg(not(target_arch = "wasm32"))]
mod files;
mod header;
mod index;
mod layout;
mod tensor;
pub mod writer;

use std::path::{Path, PathBuf};

use thiserror::Error;

#[cfg(not(target_arch = "wasm32"))]
pub use files::require_regular_file;
pub use header::FileHeader;
pub use index::{MAX_INDEX_BYTES, ShardIndex};
pub use layout::{CheckpointLayout, QuantEntry, Span, TensorEntry};
pub use tensor::{
    META_BLOCK, META_EMBED, META_LAYERS, META_ROW_ALIGN, QWEIGHT_SUFFIX, QuantTensor,
    SCALES_SUFFIX, StoredDType, StoredTensor, TensorBytes,
};

/// A checkpoint problem, naming the file and tensor involved.
#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("no checkpoint in {dir}: expected model.safetensors or model.safetensors.index.json")]
    NotFound { dir: PathBuf },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path} is not a regular file but a {kind}; checkpoint files must be regular files (or symlinks to one)"
    )]
    NotRegularFile { path: PathBuf, kind: &'static str },
    #[error("{path} is not a valid safetensors index: {message}")]
    Index { path: PathBuf, message: String },
    #[error("{path} is not a valid safetensors file (truncated or corrupt?): {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("tensor {name} is missing (looked in {looked_in})")]
    MissingTensor { name: String, looked_in: String },
    #[error("tensor {name} in {path}: expected shape {expected:?}, found {found:?}")]
    Shape {
        name: String,
        path: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor {name} in {path}: expected dtype BF16, F16 or F32, found {found}")]
    DType {
        name: String,
        path: PathBuf,
        found: String,
    },
    /// A malformed quantized tensor, or a tensor that cannot be quantized.
    #[error("tensor {name} in {path}: {message}")]
    Quantized {
        name: String,
        path: PathBuf,
        message: String,
    },
    #[error(
        "tensor {name} in {path}: {count} values do not fit in f16 (largest magnitude {max}); load with f32 weights"
    )]
    F16Range {
        name: String,
        path: PathBuf,
        count: usize,
        max: f32,
    },
}

/// The bytes of one file.
enum FileBytes {
    /// A file on disk, read whole the first time one of its tensors is asked for (`info`
    /// asks for none). Read, not memory-mapped: a mapped file cut short while in use kills
    /// the process with SIGBUS on the next access past its new end; a read that comes up
    /// short is a named error (`files::read_whole`).
    #[cfg(not(target_arch = "wasm32"))]
    OnDisk {
        path: PathBuf,
        /// The length the header was validated against.
        len: u64,
        bytes: std::sync::OnceLock<Result<Vec<u8>, String>>,
    },
    Owned(Vec<u8>),
}

impl FileBytes {
    fn as_slice(&self) -> Result<&[u8], CheckpointError> {
        match self {
            #[cfg(not(target_arch = "wasm32"))]
            FileBytes::OnDisk { path, len, bytes } => bytes
                .get_or_init(|| files::read_whole(path, *len))
                .as_deref()
                .map_err(|message| CheckpointError::Corrupt {
                    path: path.clone(),
                    message: message.clone(),
                }),
            FileBytes::Owned(v) => Ok(v),
        }
    }
}

/// All files of a checkpoint with their bytes (read from disk when first used, natively).
pub struct Checkpoint {
    layout: CheckpointLayout,
    bytes: Vec<FileBytes>,
}

impl Checkpoint {
    /// Builds a checkpoint from whole files held in memory: (file name, bytes), one file or
    /// the shards of an index given as (index file name, its text).
    pub fn from_bytes(
        files_in: Vec<(String, Vec<u8>)>,
        index: Option<(&str, &str)>,
    ) -> Result<Self, CheckpointError> {
        let dir = Path::new("(memory)");
        let mut headers = Vec::new();
        let mut bytes = Vec::new();
        let index = index
            .map(|(name, text)| ShardIndex::parse(Path::new(name), text))
            .transpose()?;
        let order: Vec<String> = match &index {
            Some(i) => i.shards.clone(),
            None => files_in.iter().map(|(n, _)| n.clone()).collect(),
        };
        let mut files_in = files_in;
        for name in &order {
            let at = files_in
                .iter()
                .position(|(n, _)| n == name)
                .ok_or_else(|| CheckpointError::Index {
                    path: index
                        .as_ref()
                        .map_or_else(|| PathBuf::from(name), |i| i.path.clone()),
                    message: format!("names the shard {name}, which is not among the files"),
                })?;
            let (name, data) = files_in.swap_remove(at);
            headers.push(Self::read_header(Path::new(&name), &data)?);
            bytes.push(FileBytes::Owned(data));
        }
        let layout = match &index {
            Some(i) => CheckpointLayout::sharded(dir, i, headers)?,
            None if headers.len() == 1 => {
                CheckpointLayout::single(dir, headers.pop().expect("one file"))
            }
            None => {
                return Err(CheckpointError::Index {
                    path: dir.to_path_buf(),
                    message: format!("{} files without an index", headers.len()),
                });
            }
        };
        Ok(Self { layout, bytes })
    }

    fn read_header(path: &Path, bytes: &[u8]) -> Result<FileHeader, CheckpointError> {
        // Validates the header and that the data section covers every tensor exactly, so a
        // truncated download is caught here rather than as garbage weights. `parse` rather
        // than `SafeTensors::read_metadata`, whose check of the file's length adds offsets
        // taken from the header without checking for overflow.
        FileHeader::parse(path, bytes, Some(bytes.len() as u64))
    }

    /// The headers alone.
    pub fn layout(&self) -> &CheckpointLayout {
        &self.layout
    }

    /// The bytes a span covers; an error when its file cannot be read whole (it changed
    /// on disk since its header was read).
    pub fn span_bytes(&self, span: &Span) -> Result<&[u8], CheckpointError> {
        Ok(&self.bytes[span.file].as_slice()?[span.bytes.clone()])
    }

    /// A `__metadata__` value of the checkpoint's files (the first file that has the key).
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.layout.metadata(key)
    }

    /// `CheckpointLayout::quantized_entry` with the codes' and scales' bytes.
    pub fn quantized(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<QuantTensor<'_>>, CheckpointError> {
        let Some(q) = self.layout.quantized_entry(name, rows, cols)? else {
            return Ok(None);
        };
        Ok(Some(QuantTensor {
            path: q.path,
            format: q.format,
            rows,
            cols,
            codes: self.span_bytes(&q.codes)?,
            scales: self.span_bytes(&q.scales)?,
        }))
    }

    pub fn dir(&self) -> &Path {
        self.layout.dir()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.layout.names()
    }

    /// Total bytes of tensor data over all files.
    pub fn data_bytes(&self) -> u64 {
        self.layout.data_bytes()
    }

    /// How the tensor `name` of the given shape is stored, whether as floats or (for a
    /// matrix) quantized, checked like `tensor` and `quantized` check it.
    pub fn stored_tensor(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<StoredTensor<'_>, CheckpointError> {
        // From the headers alone: no tensor data is read.
        if let &[rows, cols] = shape
            && let Some(q) = self.layout.quantized_entry(name, rows, cols)?
        {
            return Ok(StoredTensor {
                path: q.path,
                dtype: q.format.name().to_string(),
                bytes: (q.codes.bytes.len() + q.scales.bytes.len()) as u64,
                file_tensors: 2,
            });
        }
        let e = self.layout.tensor_entry(name, shape)?;
        Ok(StoredTensor {
            path: e.path,
            dtype: format!("{:?}", e.dtype),
            bytes: e.span.bytes.len() as u64,
            file_tensors: 1,
        })
    }

    /// The tensor `name`, checked against the expected shape.
    pub fn tensor(
        &self,
        name: &str,
        expected_shape: &[usize],
    ) -> Result<TensorBytes<'_>, CheckpointError> {
        let e = self.layout.tensor_entry(name, expected_shape)?;
        Ok(TensorBytes {
            name: e.name,
            path: e.path,
            dtype: e.dtype,
            shape: e.shape,
            data: self.span_bytes(&e.span)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn fixture_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
    }

    #[test]
    fn an_index_naming_a_shard_not_given_is_an_index_error() {
        let index = r#"{"weight_map": {"a": "shard-1.safetensors"}}"#;
        let err = Checkpoint::from_bytes(Vec::new(), Some(("index.json", index)))
            .err()
            .expect("the shard is missing");
        assert!(
            matches!(&err, CheckpointError::Index { path, message }
                if path == Path::new("index.json") && message.contains("shard-1.safetensors")),
            "{err}"
        );
    }
}
