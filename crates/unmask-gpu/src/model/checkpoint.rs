//! Hugging Face safetensors checkpoints: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Files are memory-mapped; tensors are located by name and
//! validated (dtype, shape, bounds) before any byte is converted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorInfo};
use thiserror::Error;

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

struct ShardFile {
    path: PathBuf,
    #[cfg(not(target_arch = "wasm32"))]
    bytes: memmap2::Mmap,
    #[cfg(target_arch = "wasm32")]
    bytes: Vec<u8>,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
}

/// Element type of a tensor as stored in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDType {
    BF16,
    F16,
    F32,
}

/// A tensor's bytes inside a mapped file.
pub struct TensorBytes<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub dtype: StoredDType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl TensorBytes<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Converts elements `[start, start + out.len())` to f32.
    pub fn read_f32(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self.dtype {
            StoredDType::F32 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[start * 4..(start + n) * 4].chunks_exact(4))
                {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            StoredDType::BF16 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[start * 2..(start + n) * 2].chunks_exact(2))
                {
                    *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            StoredDType::F16 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[start * 2..(start + n) * 2].chunks_exact(2))
                {
                    *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
        }
    }
}

/// All files of a checkpoint, mapped, with a name → file index.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<ShardFile>,
    by_name: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` and its shards, or `dir/model.safetensors`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single_path = dir.join("model.safetensors");
        let mut by_name = HashMap::new();
        let mut files = Vec::new();
        if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|source| CheckpointError::Io {
                    path: index_path.clone(),
                    source,
                })?;
            let value: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| CheckpointError::Index {
                    path: index_path.clone(),
                    message: e.to_string(),
                })?;
            let map = value
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| CheckpointError::Index {
                    path: index_path.clone(),
                    message: "expected an object `weight_map`".into(),
                })?;
            let mut shard_names: Vec<String> = Vec::new();
            let mut wanted: Vec<(String, String)> = Vec::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| CheckpointError::Index {
                    path: index_path.clone(),
                    message: format!("weight_map[{name}] is not a file name"),
                })?;
                if file.contains('/') || file.contains('\\') || file.contains("..") {
                    return Err(CheckpointError::Index {
                        path: index_path.clone(),
                        message: format!(
                            "weight_map[{name}] = {file:?} is not a file in the checkpoint folder"
                        ),
                    });
                }
                if !shard_names.iter().any(|s| s == file) {
                    shard_names.push(file.to_string());
                }
                wanted.push((name.clone(), file.to_string()));
            }
            shard_names.sort();
            for shard in &shard_names {
                files.push(Self::map_file(&dir.join(shard))?);
            }
            for (name, file) in wanted {
                let idx = shard_names
                    .iter()
                    .position(|s| *s == file)
                    .expect("listed above");
                if !files[idx].tensors.contains_key(&name) {
                    return Err(CheckpointError::MissingTensor {
                        name,
                        looked_in: format!(
                            "{} (named by {})",
                            files[idx].path.display(),
                            index_path.display()
                        ),
                    });
                }
                by_name.insert(name, idx);
            }
        } else if single_path.exists() {
            let file = Self::map_file(&single_path)?;
            for name in file.tensors.keys() {
                by_name.insert(name.clone(), 0);
            }
            files.push(file);
        } else {
            return Err(CheckpointError::NotFound {
                dir: dir.to_path_buf(),
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            by_name,
        })
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn map_file(path: &Path) -> Result<ShardFile, CheckpointError> {
        let file = std::fs::File::open(path).map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the file is opened read-only; a checkpoint modified while mapped is a user
        // error that can at worst produce wrong weights, which validation of shapes bounds.
        let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(path, bytes)
    }

    /// Builds a checkpoint from in-memory files (browsers, tests): (file name, bytes).
    #[cfg(target_arch = "wasm32")]
    pub fn from_bytes(files_in: Vec<(String, Vec<u8>)>) -> Result<Self, CheckpointError> {
        let mut files = Vec::new();
        let mut by_name = HashMap::new();
        for (i, (name, bytes)) in files_in.into_iter().enumerate() {
            let f = Self::parse(Path::new(&name), bytes)?;
            for t in f.tensors.keys() {
                by_name.insert(t.clone(), i);
            }
            files.push(f);
        }
        Ok(Self {
            dir: PathBuf::from("(memory)"),
            files,
            by_name,
        })
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn parse(path: &Path, bytes: memmap2::Mmap) -> Result<ShardFile, CheckpointError> {
        let (n, meta) = Self::read_header(path, &bytes)?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            bytes,
            data_start: 8 + n,
            tensors: meta,
        })
    }

    #[cfg(target_arch = "wasm32")]
    fn parse(path: &Path, bytes: Vec<u8>) -> Result<ShardFile, CheckpointError> {
        let (n, meta) = Self::read_header(path, &bytes)?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            bytes,
            data_start: 8 + n,
            tensors: meta,
        })
    }

    fn read_header(
        path: &Path,
        bytes: &[u8],
    ) -> Result<(usize, HashMap<String, TensorInfo>), CheckpointError> {
        // Validates the header and that the data section covers every tensor exactly, so a
        // truncated download is caught here rather than as garbage weights.
        let (n, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| {
            CheckpointError::Corrupt {
                path: path.to_path_buf(),
                message: format!("{e:?}"),
            }
        })?;
        let tensors = meta
            .tensors()
            .into_iter()
            .map(|(k, v)| (k, v.clone()))
            .collect();
        Ok((n, tensors))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// Total bytes of tensor data over all files.
    pub fn data_bytes(&self) -> u64 {
        self.files
            .iter()
            .map(|f| {
                f.tensors
                    .values()
                    .map(|t| (t.data_offsets.1 - t.data_offsets.0) as u64)
                    .sum::<u64>()
            })
            .sum()
    }

    /// The tensor `name`, checked against the expected shape.
    pub fn tensor(
        &self,
        name: &str,
        expected_shape: &[usize],
    ) -> Result<TensorBytes<'_>, CheckpointError> {
        let &idx = self
            .by_name
            .get(name)
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
        let (start, end) = info.data_offsets;
        let data = &file.bytes[file.data_start + start..file.data_start + end];
        Ok(TensorBytes {
            name: self
                .by_name
                .get_key_value(name)
                .map(|(k, _)| k.as_str())
                .unwrap_or(""),
            path: &file.path,
            dtype,
            shape: &info.shape,
            data,
        })
    }
}
