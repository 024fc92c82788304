//! Hugging Face safetensors checkpoints: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. A `CheckpointLayout` holds only the files' headers, so a
//! checkpoint can be checked and its upload planned before any tensor byte is read (a
//! browser streams the bodies afterwards); a `Checkpoint` adds the files' bytes, memory-mapped
//! natively. Tensors are located by name and validated (dtype, shape, bounds) before any byte
//! is converted.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorInfo};
use thiserror::Error;

use crate::quant::{self, QuantFormat};

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

/// The header of one safetensors file: where each of its tensors lies.
pub struct FileHeader {
    pub path: PathBuf,
    /// Offset of the data section in the file (8 + the header's length).
    pub data_start: usize,
    tensors: HashMap<String, TensorInfo>,
    /// The header's `__metadata__`.
    metadata: HashMap<String, String>,
}

/// Largest header accepted from a stream (the safetensors crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Largest `model.safetensors.index.json` read: it is read whole, so its size is checked
/// first. Published indexes are tens to hundreds of KiB (one line per tensor).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

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

/// The bytes of one file.
enum FileBytes {
    #[cfg(not(target_arch = "wasm32"))]
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl FileBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            #[cfg(not(target_arch = "wasm32"))]
            FileBytes::Mapped(m) => m,
            FileBytes::Owned(v) => v,
        }
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

    /// Converts elements `[start, start + out.len())` to f32. Panics past `numel()`: the
    /// caller sizes its reads from the shape, which the header validated against the data.
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
/// Weights per block; must be `crate::quant::BLOCK`.
pub const META_BLOCK: &str = "unmask.quant.block";
/// Row padding; must be `crate::quant::ROW_ALIGN`.
pub const META_ROW_ALIGN: &str = "unmask.quant.row_align";
/// Format of the transformer blocks' matrices (`q8`, `q4` or `none`), informative.
pub const META_LAYERS: &str = "unmask.quant.layers";
/// Format of the embedding table and LM head (`q8`, `q4` or `none`), informative.
pub const META_EMBED: &str = "unmask.quant.embed";

/// A quantized matrix inside a mapped file, in the byte layout of `crate::quant`.
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

    /// Dequantizes rows `[row, row + n)` into `out` (`n * cols` values). Panics past
    /// `rows`, like `TensorBytes::read_f32`.
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

/// The shards an index names, sorted, and which shard holds each tensor.
pub struct ShardIndex {
    path: PathBuf,
    pub shards: Vec<String>,
    wanted: Vec<(String, String)>,
}

impl ShardIndex {
    /// Parses the text of `model.safetensors.index.json` read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self, CheckpointError> {
        let index_err = |message: String| CheckpointError::Index {
            path: path.to_path_buf(),
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| index_err(e.to_string()))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| index_err("expected an object `weight_map`".into()))?;
        let mut shards: Vec<String> = Vec::new();
        let mut wanted: Vec<(String, String)> = Vec::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| index_err(format!("weight_map[{name}] is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file.contains("..") {
                return Err(index_err(format!(
                    "weight_map[{name}] = {file:?} is not a file in the checkpoint folder"
                )));
            }
            if !shards.iter().any(|s| s == file) {
                shards.push(file.to_string());
            }
            wanted.push((name.clone(), file.to_string()));
        }
        shards.sort();
        Ok(Self {
            path: path.to_path_buf(),
            shards,
            wanted,
        })
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
/// racing the loader on purpose, which is not the mistake this guards against. Returns the
/// file's metadata: its length bounds what a caller reads whole.
#[cfg(not(target_arch = "wasm32"))]
pub fn require_regular_file(path: &Path) -> Result<std::fs::Metadata, CheckpointError> {
    let meta = std::fs::metadata(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let file_type = meta.file_type();
    if file_type.is_file() {
        return Ok(meta);
    }
    Err(CheckpointError::NotRegularFile {
        path: path.to_path_buf(),
        kind: file_kind(&file_type),
    })
}

/// What a path that is not a regular file is, for `CheckpointError::NotRegularFile`.
#[cfg(not(target_arch = "wasm32"))]
fn file_kind(file_type: &std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        return "directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_fifo() {
            return "FIFO (named pipe)";
        }
        if file_type.is_socket() {
            return "socket";
        }
        if file_type.is_block_device() {
            return "block device";
        }
        if file_type.is_char_device() {
            return "character device";
        }
    }
    "special file"
}

/// All files of a checkpoint with their bytes (memory-mapped natively).
pub struct Checkpoint {
    layout: CheckpointLayout,
    bytes: Vec<FileBytes>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` and its shards, or `dir/model.safetensors`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single_path = dir.join("model.safetensors");
        if index_path.exists() {
            let len = require_regular_file(&index_path)?.len();
            if len > MAX_INDEX_BYTES {
                return Err(CheckpointError::Index {
                    path: index_path,
                    message: format!(
                        "the file is {len} bytes, expected at most {MAX_INDEX_BYTES} (an index \
                         lists tensor names only)"
                    ),
                });
            }
            let text =
                std::fs::read_to_string(&index_path).map_err(|source| CheckpointError::Io {
                    path: index_path.clone(),
                    source,
                })?;
            let index = ShardIndex::parse(&index_path, &text)?;
            let mut headers = Vec::new();
            let mut bytes = Vec::new();
            for shard in &index.shards {
                let (h, b) = Self::map_file(&dir.join(shard))?;
                headers.push(h);
                bytes.push(b);
            }
            Ok(Self {
                layout: CheckpointLayout::sharded(dir, &index, headers)?,
                bytes,
            })
        } else if single_path.exists() {
            let (h, b) = Self::map_file(&single_path)?;
            Ok(Self {
                layout: CheckpointLayout::single(dir, h),
                bytes: vec![b],
            })
        } else {
            Err(CheckpointError::NotFound {
                dir: dir.to_path_buf(),
            })
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn map_file(path: &Path) -> Result<(FileHeader, FileBytes), CheckpointError> {
        require_regular_file(path)?;
        let file = std::fs::File::open(path).map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: `Mmap::map` is sound only if nothing changes the file while it is mapped,
        // and nothing here can promise that: the mapping shares the file's pages, so another
        // process writing to it changes bytes behind a `&[u8]` (undefined behaviour to the
        // compiler; in practice tensors differ from the header validated at open), and one
        // that truncates it makes any later access of the pages past the new end raise
        // SIGBUS, which kills the process. Accepted here because this path serves `unmask
        // info`, `unmask quantize` and tests, which read a checkpoint that nothing is
        // rewriting; the engine's loader reads files with read() rather than mapping them.
        let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let header = Self::read_header(path, &bytes)?;
        Ok((header, FileBytes::Mapped(bytes)))
    }

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

    /// The bytes a span covers.
    pub fn span_bytes(&self, span: &Span) -> &[u8] {
        &self.bytes[span.file].as_slice()[span.bytes.clone()]
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
        Ok(self
            .layout
            .quantized_entry(name, rows, cols)?
            .map(|q| QuantTensor {
                path: q.path,
                format: q.format,
                rows,
                cols,
                codes: self.span_bytes(&q.codes),
                scales: self.span_bytes(&q.scales),
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
        let e = self.layout.tensor_entry(name, expected_shape)?;
        Ok(TensorBytes {
            name: e.name,
            path: e.path,
            dtype: e.dtype,
            shape: e.shape,
            data: self.span_bytes(&e.span),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
    }

    /// A fresh, empty folder for one test.
    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("unmask-core-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A safetensors file: the 8-byte length, the JSON header, then `data`.
    fn safetensors_file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    /// `Checkpoint::open` on another thread, so that a regression which blocks in `open()`
    /// fails the test instead of hanging the test run.
    fn open_with_deadline(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let dir = dir.to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(Checkpoint::open(&dir));
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("Checkpoint::open blocked for 20 s: it opened a path that is not a file")
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_is_refused_before_it_is_opened() {
        let dir = scratch("fifo");
        let fifo = dir.join("model.safetensors");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo runs");
        assert!(status.success(), "mkfifo {}", fifo.display());
        let err = open_with_deadline(&dir)
            .err()
            .expect("a FIFO is no checkpoint");
        assert!(
            matches!(&err, CheckpointError::NotRegularFile { kind, .. } if kind.contains("FIFO")),
            "{err}"
        );
        let message = err.to_string();
        assert!(message.contains("model.safetensors") && message.contains("not a regular file"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_directory_named_like_a_checkpoint_is_named_as_one() {
        let dir = scratch("dir");
        std::fs::create_dir(dir.join("model.safetensors.index.json")).unwrap();
        let err = open_with_deadline(&dir)
            .err()
            .expect("a directory is no index");
        assert!(
            matches!(&err, CheckpointError::NotRegularFile { kind: "directory", path }
                if path.ends_with("model.safetensors.index.json")),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The Hugging Face cache's layout: every file of a snapshot is a symlink to a blob.
    #[cfg(unix)]
    #[test]
    fn symlinks_to_checkpoint_files_open() {
        let dir = scratch("symlinks");
        let fixture = fixture_dir().canonicalize().unwrap();
        for name in [
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ] {
            std::os::unix::fs::symlink(fixture.join(name), dir.join(name)).unwrap();
        }
        let linked = open_with_deadline(&dir).expect("symlinked checkpoint opens");
        let direct = Checkpoint::open(&fixture).unwrap();
        assert_eq!(linked.names().count(), direct.names().count());
        assert_eq!(linked.data_bytes(), direct.data_bytes());
        let _ = std::fs::remove_dir_all(&dir);
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

    #[test]
    fn an_oversized_index_is_refused_before_it_is_read() {
        let dir = scratch("bigindex");
        let index = std::fs::File::create(dir.join("model.safetensors.index.json")).unwrap();
        // Sparse: the size is what is checked, no byte is written or read.
        index.set_len(MAX_INDEX_BYTES + 1).unwrap();
        let err = open_with_deadline(&dir).err().expect("too large");
        assert!(
            matches!(&err, CheckpointError::Index { message, .. } if message.contains("at most")),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

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
