//! Checkpoints with random weights under the real LLaDA, Dream or DiffusionGemma tensor names
//! and shapes, in the Hugging Face layout (`config.json`, safetensors shards and their index), for loading
//! tests and benchmarks at sizes whose real weights are not at hand.
//!
//! Every tensor's values come from its own counter-based stream keyed by (seed, tensor
//! name), so the bytes of a tensor do not depend on the shard budget, the chunking or the
//! order of writing, and a file is written chunk by chunk in constant memory.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use serde_json::{Value, json};
use thiserror::Error;

use crate::error::ConfigError;

mod config;
use crate::rng::SplitMix64;
use crate::safetensors_writer::{Dtype, SafetensorsError, SafetensorsWriter, TensorDecl};
use config::pretty;
pub use config::{DIFFUSION_GEMMA_PRESET, PRESET_NAMES, SynthConfig, SynthModel};

/// Standard deviation of the weight matrices: LLaDA's `init_std`.
pub const INIT_STD: f32 = 0.02;

/// Largest tensor data per shard when none is given: Hugging Face's `max_shard_size`
/// default ("5GB").
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// The index that lists the shards of a multi-file checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The one file of a single-shard checkpoint (as Hugging Face names it).
pub const SINGLE_FILE: &str = "model.safetensors";

/// Values per generated chunk: 4 MiB of f32 whatever the tensor's size.
const CHUNK_VALUES: usize = 1 << 20;

/// How the weights are stored in the files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    BF16,
    F16,
    F32,
}

impl WeightDtype {
    /// Spellings accepted by [`WeightDtype::parse`].
    pub const NAMES: [&str; 3] = ["bf16", "f16", "f32"];

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "bf16" => Some(Self::BF16),
            "f16" => Some(Self::F16),
            "f32" => Some(Self::F32),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::BF16 => "bf16",
            Self::F16 => "f16",
            Self::F32 => "f32",
        }
    }

    pub fn safetensors(self) -> Dtype {
        match self {
            Self::BF16 => Dtype::BF16,
            Self::F16 => Dtype::F16,
            Self::F32 => Dtype::F32,
        }
    }

    /// Appends the little-endian bytes of `values` in this format.
    fn encode(self, values: &[f32], out: &mut Vec<u8>) {
        match self {
            Self::BF16 => out.extend(
                values
                    .iter()
                    .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes()),
            ),
            Self::F16 => out.extend(
                values
                    .iter()
                    .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes()),
            ),
            Self::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        }
    }
}

#[derive(Debug, Error)]
pub enum SynthError {
    #[error(
        "unknown config `{given}`: expected a preset ({}) or the path of a LLaDA, Dream or DiffusionGemma config.json",
        PRESET_NAMES.join(", ")
    )]
    UnknownConfig { given: String },
    #[error("config {}: {source}", .path.display())]
    Config {
        path: PathBuf,
        #[source]
        source: ConfigError,
    },
    #[error("{} exists and is not a directory", .path.display())]
    NotADirectory { path: PathBuf },
    #[error("{} is not empty (it holds {entry})", .path.display())]
    NotEmpty { path: PathBuf, entry: String },
    #[error("cannot create {}: {source}", .path.display())]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {}: {source}", .path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: SafetensorsError,
    },
}

#[derive(Clone, Copy, Debug)]
pub struct SynthOptions {
    pub seed: u64,
    pub dtype: WeightDtype,
    /// Largest tensor data per shard (a larger tensor gets a shard of its own).
    pub shard_bytes: u64,
    /// Write into a non-empty folder, replacing the checkpoint files there.
    pub force: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            dtype: WeightDtype::BF16,
            shard_bytes: DEFAULT_SHARD_BYTES,
            force: false,
        }
    }
}

/// Progress of a write, reported after every chunk.
#[derive(Clone, Debug)]
pub struct SynthProgress<'a> {
    pub file: &'a str,
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct SynthSummary {
    pub params: u64,
    /// Tensor bytes over all shards (the index's `metadata.total_size`).
    pub data_bytes: u64,
    /// Bytes of every file written, headers and JSON files included.
    pub file_bytes: u64,
    /// The safetensors files, in order.
    pub shards: Vec<PathBuf>,
}

/// The tensors of a checkpoint of `config`, in checkpoint order, stored as `dtype`.
pub fn tensor_decls(config: &SynthModel, dtype: WeightDtype) -> Vec<TensorDecl> {
    config
        .tensor_specs()
        .into_iter()
        .map(|(name, shape)| TensorDecl::new(name, dtype.safetensors(), shape))
        .collect()
}

/// Splits tensors into consecutive shards of at most `budget` data bytes, as Hugging Face
/// does: a tensor that would overflow the current shard starts the next one, and a tensor
/// larger than the budget gets a shard of its own.
pub fn plan_shards(tensors: &[TensorDecl], budget: u64) -> Vec<Range<usize>> {
    let mut shards = Vec::new();
    let mut start = 0;
    let mut bytes = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let len = t.byte_len().unwrap_or(u64::MAX);
        if i > start && bytes.saturating_add(len) > budget {
            shards.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes = bytes.saturating_add(len);
    }
    if start < tensors.len() {
        shards.push(start..tensors.len());
    }
    shards
}

/// File names of `count` shards: `model.safetensors` alone, else
/// `model-00001-of-0000N.safetensors`, ...
pub fn shard_names(count: usize) -> Vec<String> {
    if count == 1 {
        return vec![SINGLE_FILE.to_string()];
    }
    (1..=count)
        .map(|k| format!("model-{k:05}-of-{count:05}.safetensors"))
        .collect()
}

/// 64-bit FNV-1a: a fixed, platform-independent hash of a tensor name.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Values `start .. start + out.len()` of tensor `name`'s stream: approximately
/// N(0, INIT_STD²), as the sum of four 16-bit uniforms (Irwin–Hall, tails end at ±3.46σ).
/// Integer sums and one f32 multiply make every platform produce the same values, which
/// a Box–Muller transform through the platform's `ln`/`cos` would not guarantee.
pub fn fill_normal(seed: u64, name: &str, start: u64, out: &mut [f32]) {
    let key = SplitMix64::nth(seed, name_hash(name));
    // The sum of four uniforms on 0..=65535 has mean 2·65535 and variance (65536² − 1)/3.
    const MEAN: i32 = 2 * 65535;
    let scale = (INIT_STD as f64 / ((65536.0f64 * 65536.0 - 1.0) / 3.0).sqrt()) as f32;
    for (i, o) in out.iter_mut().enumerate() {
        let bits = SplitMix64::nth(key, start + i as u64);
        let sum =
            (bits & 0xffff) + ((bits >> 16) & 0xffff) + ((bits >> 32) & 0xffff) + (bits >> 48);
        *o = (sum as i32 - MEAN) as f32 * scale;
    }
}

/// Values of tensor `decl` from element `start`: RMSNorm weights are 1 as at
/// initialization (so are DiffusionGemma's router and expert scales and layer scalars, its
/// other vectors); matrices (DiffusionGemma's stacked experts too) and biases (Dream's q/k/v,
/// random so their path is exercised) are random.
fn fill_tensor(seed: u64, decl: &TensorDecl, start: u64, out: &mut [f32]) {
    if decl.shape.len() == 1 && !decl.name.ends_with(".bias") {
        out.fill(1.0);
    } else {
        fill_normal(seed, &decl.name, start, out);
    }
}

/// Makes `out` ready to receive a checkpoint: created when missing; refused when it holds
/// anything unless `force`, in which case the checkpoint files a previous run may have left
/// (other shard counts) are removed so the new index cannot be mixed with stale shards.
fn prepare_dir(out: &Path, force: bool) -> Result<(), SynthError> {
    if out.exists() {
        if !out.is_dir() {
            return Err(SynthError::NotADirectory {
                path: out.to_path_buf(),
            });
        }
        let io = |source| SynthError::Io {
            path: out.to_path_buf(),
            source,
        };
        let mut entries: Vec<String> = std::fs::read_dir(out)
            .map_err(io)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()
            .map_err(io)?;
        entries.sort();
        let Some(first) = entries.first() else {
            return Ok(());
        };
        if !force {
            return Err(SynthError::NotEmpty {
                path: out.to_path_buf(),
                entry: if entries.len() == 1 {
                    first.clone()
                } else {
                    format!("{first} and {} more", entries.len() - 1)
                },
            });
        }
        for name in &entries {
            let stale = name == SINGLE_FILE
                || name == INDEX_FILE
                || (name.starts_with("model-") && name.ends_with(".safetensors"));
            if stale {
                let path = out.join(name);
                std::fs::remove_file(&path).map_err(|source| SynthError::Io { path, source })?;
            }
        }
        Ok(())
    } else {
        std::fs::create_dir_all(out).map_err(|source| SynthError::Create {
            path: out.to_path_buf(),
            source,
        })
    }
}

fn write_text(path: &Path, text: &str) -> Result<u64, SynthError> {
    std::fs::write(path, text).map_err(|source| SynthError::Create {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(text.len() as u64)
}

/// Writes a checkpoint of `config` with random weights into `out`: config.json (and
/// generation_config.json when known) first, so an unwritable folder fails before the long
/// part, then the shards tensor by tensor in chunks, then the index when there are several.
pub fn write_checkpoint(
    out: &Path,
    config: &SynthConfig,
    options: &SynthOptions,
    progress: &mut dyn FnMut(SynthProgress<'_>),
) -> Result<SynthSummary, SynthError> {
    prepare_dir(out, options.force)?;
    let mut file_bytes = write_text(&out.join("config.json"), &config.config_json)?;
    if let Some(generation) = &config.generation_config_json {
        file_bytes += write_text(&out.join("generation_config.json"), generation)?;
    }

    let decls = tensor_decls(&config.config, options.dtype);
    let data_bytes: u64 = decls.iter().map(|d| d.byte_len().unwrap_or(0)).sum();
    let shards = plan_shards(&decls, options.shard_bytes);
    let names = shard_names(shards.len());
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        (
            "unmask_synth".to_string(),
            format!("random weights, seed {}", options.seed),
        ),
    ]);

    let mut done = 0u64;
    let mut values = vec![0f32; CHUNK_VALUES];
    let mut bytes = Vec::with_capacity(CHUNK_VALUES * 4);
    let mut paths = Vec::with_capacity(shards.len());
    let mut weight_map = BTreeMap::new();
    for (range, name) in shards.iter().zip(&names) {
        let path = out.join(name);
        let write_err = |source| SynthError::Write {
            path: path.clone(),
            source,
        };
        let file = File::create(&path).map_err(|source| SynthError::Create {
            path: path.clone(),
            source,
        })?;
        let part = &decls[range.clone()];
        let mut writer = SafetensorsWriter::new(
            BufWriter::with_capacity(8 << 20, file),
            &metadata,
            part.to_vec(),
        )
        .map_err(write_err)?;
        file_bytes += writer.file_len();
        for decl in part {
            weight_map.insert(decl.name.clone(), name.clone());
            let numel = decl.numel().unwrap_or(0);
            let mut start = 0u64;
            while start < numel {
                let n = (numel - start).min(CHUNK_VALUES as u64) as usize;
                fill_tensor(options.seed, decl, start, &mut values[..n]);
                bytes.clear();
                options.dtype.encode(&values[..n], &mut bytes);
                writer.write(&bytes).map_err(write_err)?;
                start += n as u64;
                done += bytes.len() as u64;
                progress(SynthProgress {
                    file: name,
                    done_bytes: done,
                    total_bytes: data_bytes,
                });
            }
        }
        let buffered = writer.finish().map_err(write_err)?;
        buffered
            .into_inner()
            .map_err(|e| SynthError::Io {
                path: path.clone(),
                source: e.into_error(),
            })?
            .sync_all()
            .map_err(|source| SynthError::Io {
                path: path.clone(),
                source,
            })?;
        paths.push(path);
    }

    if shards.len() > 1 {
        let mut index = serde_json::Map::new();
        index.insert("metadata".into(), json!({ "total_size": data_bytes }));
        index.insert(
            "weight_map".into(),
            Value::Object(
                weight_map
                    .into_iter()
                    .map(|(k, v)| (k, Value::String(v)))
                    .collect(),
            ),
        );
        file_bytes += write_text(&out.join(INDEX_FILE), &pretty(&Value::Object(index)))?;
    }

    Ok(SynthSummary {
        params: config.config.parameter_count(),
        data_bytes,
        file_bytes,
        shards: paths,
    })
}

#[cfg(test)]
mod tests;
