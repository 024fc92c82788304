//! Hugging Face safetensors checkpoints: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Files are memory-mapped; tensors are located by name and
//! validated (dtype, shape, bounds) before any byte is converted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorInfo};
use thiserror::Error;
use unmask_core::quant::{self, QuantFormat};

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

struct ShardFile {
    path: PathBuf,
    #[cfg(not(target_arch = "wasm32"))]
    bytes: memmap2::Mmap,
    #[cfg(target_arch = "wasm32")]
    bytes: Vec<u8>,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
    /// The header's `__metadata__`.
    metadata: HashMap<String, String>,
}

impl ShardFile {
    /// The bytes of one of this file's tensors.
    fn data(&self, info: &TensorInfo) -> &[u8] {
        let (start, end) = info.data_offsets;
        &self.bytes[self.data_start + start..self.data_start + end]
    }
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

/// Names and `__metadata__` keys of quantized checkpoints (`unmask quantize`).
pub const QWEIGHT_SUFFIX: &str = ".qweight";
pub const SCALES_SUFFIX: &str = ".scales";
/// Weights per block; must be `unmask_core::quant::BLOCK`.
pub const META_BLOCK: &str = "unmask.quant.block";
/// Row padding; must be `unmask_core::quant::ROW_ALIGN`.
pub const META_ROW_ALIGN: &str = "unmask.quant.row_align";
/// Format of the transformer blocks' matrices (`q8`, `q4` or `none`), informative.
pub const META_LAYERS: &str = "unmask.quant.layers";
/// Format of the embedding table and LM head (`q8`, `q4` or `none`), informative.
pub const META_EMBED: &str = "unmask.quant.embed";

/// A quantized matrix inside a mapped file, in the byte layout of `unmask_core::quant`.
pub struct QuantTensor<'a> {
    pub path: &'a Path,
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub codes: &'a [u8],
    pub scales: &'a [u8],
}

impl QuantTensor<'_> {
    /// Bytes stored (codes and scales).
    pub fn stored_bytes(&self) -> usize {
        self.codes.len() + self.scales.len()
    }

    /// Dequantizes rows `[row, row + n)` into `out` (`n * cols` values).
    pub fn read_f32(&self, row: usize, out: &mut [f32]) {
        let n = out.len() / self.cols;
        let code_row = self.format.row_code_bytes(self.cols);
        let scale_row = quant::row_scale_bytes(self.cols);
        let values = self.format.dequantize_rows(
            &self.codes[row * code_row..(row + n) * code_row],
            &self.scales[row * scale_row..(row + n) * scale_row],
            n,
            self.cols,
        );
        out.copy_from_slice(&values);
    }

    /// The stored bytes of rows `[row, row + n)`: (codes, scales).
    pub fn rows(&self, row: usize, n: usize) -> (&[u8], &[u8]) {
        let code_row = self.format.row_code_bytes(self.cols);
        let scale_row = quant::row_scale_bytes(self.cols);
        (
            &self.codes[row * code_row..(row + n) * code_row],
            &self.scales[row * scale_row..(row + n) * scale_row],
        )
    }
}

/// How a model tensor is stored, for reports: float or quantized alike.
#[derive(Clone, Debug)]
pub struct StoredTensor<'a> {
    pub path: &'a Path,
    /// `BF16`, `F16`, `F32`, or `q8` / `q4` for a quantized matrix.
    pub dtype: String,
    /// Bytes in the file (codes and scales for a quantized matrix).
    pub bytes: u64,
    /// Tensors of the file it takes: 1, or 2 for a quantized matrix (codes, scales).
    pub file_tensors: usize,
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
        let (n, tensors, metadata) = Self::read_header(path, &bytes)?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            bytes,
            data_start: 8 + n,
            tensors,
            metadata,
        })
    }

    #[cfg(target_arch = "wasm32")]
    fn parse(path: &Path, bytes: Vec<u8>) -> Result<ShardFile, CheckpointError> {
        let (n, tensors, metadata) = Self::read_header(path, &bytes)?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            bytes,
            data_start: 8 + n,
            tensors,
            metadata,
        })
    }

    #[allow(clippy::type_complexity)]
    fn read_header(
        path: &Path,
        bytes: &[u8],
    ) -> Result<(usize, HashMap<String, TensorInfo>, HashMap<String, String>), CheckpointError>
    {
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
        let metadata = meta.metadata().clone().unwrap_or_default();
        Ok((n, tensors, metadata))
    }

    /// A `__metadata__` value of the checkpoint's files (the first file that has the key).
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.files
            .iter()
            .find_map(|f| f.metadata.get(key).map(String::as_str))
    }

    /// The `[rows, cols]` matrix `name` (e.g. `...q_proj.weight`) when the checkpoint stores
    /// it quantized, as `unmask quantize` writes it: `<prefix>.qweight` (I8 codes for q8,
    /// U8 nibble pairs for q4, `unmask_core::quant` layout) and `<prefix>.scales` (F16),
    /// where `<prefix>` is `name` without `.weight`. None when it is stored as floats.
    pub fn quantized(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<QuantTensor<'_>>, CheckpointError> {
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
        Ok(Some(QuantTensor {
            path: &file.path,
            format,
            rows,
            cols,
            codes: file.data(codes),
            scales: sfile.data(scales),
        }))
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

    /// How the tensor `name` of the given shape is stored, whether as floats or (for a
    /// matrix) quantized, checked like `tensor` and `quantized` check it.
    pub fn stored_tensor(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<StoredTensor<'_>, CheckpointError> {
        if let &[rows, cols] = shape
            && let Some(q) = self.quantized(name, rows, cols)?
        {
            return Ok(StoredTensor {
                path: q.path,
                dtype: q.format.name().to_string(),
                bytes: q.stored_bytes() as u64,
                file_tensors: 2,
            });
        }
        let t = self.tensor(name, shape)?;
        Ok(StoredTensor {
            path: t.path,
            dtype: format!("{:?}", t.dtype),
            bytes: t.data.len() as u64,
            file_tensors: 1,
        })
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
