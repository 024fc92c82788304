//! Checkpoints with random weights under the real LLaDA tensor names and shapes, in the
//! Hugging Face layout (`config.json`, safetensors shards and their index), for loading
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

use crate::config::ModelConfig;
use crate::error::ConfigError;
use crate::rng::SplitMix64;
use crate::safetensors_writer::{Dtype, SafetensorsError, SafetensorsWriter, TensorDecl};

/// Standard deviation of the weight matrices: LLaDA's `init_std`.
pub const INIT_STD: f32 = 0.02;

/// Largest tensor data per shard when none is given: Hugging Face's `max_shard_size`
/// default ("5GB").
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// Names accepted by [`SynthConfig::preset`].
pub const PRESET_NAMES: [&str; 4] = ModelConfig::PRESETS;

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
        "unknown config `{given}`: expected a preset ({}) or the path of a LLaDA or Dream config.json",
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

/// A model configuration to synthesize: the files' text and the parsed config.
#[derive(Clone, Debug)]
pub struct SynthConfig {
    /// Where it came from (a preset name or a path), for messages.
    pub source: String,
    /// The `config.json` written into the checkpoint.
    pub config_json: String,
    /// The `generation_config.json` written beside it, when there is one.
    pub generation_config_json: Option<String>,
    pub config: ModelConfig,
}

impl SynthConfig {
    /// A preset (see [`ModelConfig::preset`]); None for other names.
    pub fn preset(name: &str) -> Option<Self> {
        let files = ModelConfig::preset_files(name)?;
        Some(Self {
            source: name.to_string(),
            config_json: files.config_json,
            generation_config_json: Some(files.generation_config_json),
            config: ModelConfig::preset(name)?,
        })
    }

    /// A LLaDA `config.json` (or a folder holding one), copied as it is, with the
    /// `generation_config.json` beside it when there is one.
    pub fn from_file(path: &Path) -> Result<Self, SynthError> {
        let config_path = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let err = |source| SynthError::Config {
            path: config_path.clone(),
            source,
        };
        // from_file first: it refuses a FIFO, a broken link or a file past its size bound
        // before anything reads it whole, and checks generation_config.json's token ids.
        let config = ModelConfig::from_file(&config_path).map_err(err)?;
        let config_json = std::fs::read_to_string(&config_path).map_err(|source| {
            err(ConfigError::Io {
                path: config_path.clone(),
                source,
            })
        })?;
        let generation_path = config_path.with_file_name("generation_config.json");
        let generation_config_json = if generation_path.is_file() {
            Some(std::fs::read_to_string(&generation_path).map_err(|source| {
                err(ConfigError::Io {
                    path: generation_path.clone(),
                    source,
                })
            })?)
        } else {
            None
        };
        Ok(Self {
            source: config_path.display().to_string(),
            config_json,
            generation_config_json,
            config,
        })
    }

    /// A preset name, else the path of a config file or folder.
    /// The same model with `n_layers` layers (every other field kept): a checkpoint with the
    /// real tensor names and shapes of a big model, small enough to run a few layers of it.
    pub fn with_layers(mut self, n_layers: usize) -> Result<Self, SynthError> {
        let path = PathBuf::from(&self.source);
        let err = |source| SynthError::Config {
            path: path.clone(),
            source,
        };
        let mut value: Value = serde_json::from_str(&self.config_json).map_err(|source| {
            err(ConfigError::Json {
                file: "config.json".into(),
                source,
            })
        })?;
        if let Some(obj) = value.as_object_mut() {
            let key = self.config.family.config_key("n_layers");
            obj.insert(key.into(), Value::from(n_layers));
        }
        let config_json = pretty(&value);
        self.config = ModelConfig::from_json_str(&config_json).map_err(err)?;
        self.config_json = config_json;
        self.source = format!("{} with {n_layers} layers", self.source);
        Ok(self)
    }

    pub fn resolve(spec: &str) -> Result<Self, SynthError> {
        if let Some(preset) = Self::preset(spec) {
            return Ok(preset);
        }
        let path = Path::new(spec);
        if !path.exists() {
            return Err(SynthError::UnknownConfig {
                given: spec.to_string(),
            });
        }
        Self::from_file(path)
    }
}

/// Indented like Hugging Face's JSON files.
fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).expect("JSON values serialize") + "\n"
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
pub fn tensor_decls(config: &ModelConfig, dtype: WeightDtype) -> Vec<TensorDecl> {
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
/// initialization; matrices and biases (Dream's q/k/v, random so their path is exercised)
/// are random.
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
mod tests {

    #[test]
    fn fewer_layers_keep_every_other_field() {
        let full = SynthConfig::preset("llada-8b").unwrap();
        let two = full.clone().with_layers(2).unwrap();
        assert_eq!(two.config.n_layers, 2);
        assert_eq!(two.config.d_model, full.config.d_model);
        assert_eq!(two.config.embedding_size, full.config.embedding_size);
        assert_eq!(two.generation_config_json, full.generation_config_json);
        let reread = ModelConfig::from_json_str(&two.config_json).unwrap();
        assert_eq!(reread, two.config);
        assert!(two.source.contains("2 layers"), "{}", two.source);
    }

    use super::*;

    #[test]
    fn llada_8b_preset_has_the_reference_size() {
        let preset = SynthConfig::preset("llada-8b").unwrap();
        // llada.md §5: 8,015,581,184 parameters, 16,031,162,368 bytes in bf16.
        assert_eq!(preset.config.parameter_count(), 8_015_581_184);
        let decls = tensor_decls(&preset.config, WeightDtype::BF16);
        assert_eq!(decls.len(), 291);
        let bytes: u64 = decls.iter().map(|d| d.byte_len().unwrap()).sum();
        assert_eq!(bytes, 16_031_162_368);
        let c = &preset.config;
        assert_eq!(
            (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads),
            (4096, 32, 32, 32)
        );
        assert_eq!((c.mlp_hidden_size, c.vocab_size), (12288, 126464));
        assert_eq!(c.embedding_size, 126464);
        assert!(!c.weight_tying);
        // Four shards under Hugging Face's 5 GB default, none over it.
        let shards = plan_shards(&decls, DEFAULT_SHARD_BYTES);
        assert_eq!(shards.len(), 4);
        for s in &shards {
            let size: u64 = decls[s.clone()].iter().map(|d| d.byte_len().unwrap()).sum();
            assert!(size <= DEFAULT_SHARD_BYTES, "{size}");
        }
    }

    #[test]
    fn llada_8b_preset_is_the_reference_file() {
        let preset = SynthConfig::preset("llada-8b").unwrap();
        let value: Value = serde_json::from_str(&preset.config_json).unwrap();
        let map = value.as_object().unwrap();
        assert_eq!(map.len(), 46);
        assert_eq!(map["rms_norm_eps"], json!(1e-5));
        assert_eq!(map["init_std"], json!(0.02));
        assert!(preset.config_json.contains("\"rms_norm_eps\": 1e-05,\n"));
        assert!(!preset.config_json.ends_with('\n'));
        let generation = preset.generation_config_json.unwrap();
        let generation: Value = serde_json::from_str(&generation).unwrap();
        assert_eq!(generation["bos_token_id"], 126080);
    }

    #[test]
    fn unknown_configs_name_the_presets() {
        let e = SynthConfig::resolve("llada-9b").unwrap_err().to_string();
        assert!(
            e.contains("llada-9b") && e.contains("llada-8b, tiny"),
            "{e}"
        );
    }

    #[test]
    fn streams_are_counter_based() {
        let mut whole = vec![0f32; 1000];
        fill_normal(5, "w", 0, &mut whole);
        let mut part = vec![0f32; 300];
        fill_normal(5, "w", 700, &mut part);
        assert_eq!(&whole[700..], &part[..]);
        let mut other = vec![0f32; 1000];
        fill_normal(5, "v", 0, &mut other);
        assert_ne!(whole, other);
        fill_normal(6, "w", 0, &mut other);
        assert_ne!(whole, other);
    }

    #[test]
    fn values_have_the_init_statistics() {
        let mut v = vec![0f32; 1 << 18];
        fill_normal(1, "model.transformer.wte.weight", 0, &mut v);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!(
            (var.sqrt() - INIT_STD as f64).abs() < 2e-4,
            "std {}",
            var.sqrt()
        );
        let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(max <= 3.47 * INIT_STD && max > 2.5 * INIT_STD, "max {max}");
    }

    #[test]
    fn shards_follow_the_budget() {
        let d = |n: usize| TensorDecl::new(format!("t{n}"), Dtype::U8, vec![n]);
        let tensors = vec![d(4), d(3), d(10), d(2), d(2)];
        assert_eq!(plan_shards(&tensors, 7), vec![0..2, 2..3, 3..5]);
        assert_eq!(plan_shards(&tensors, 100), vec![0..5]);
        assert_eq!(plan_shards(&tensors, 1).len(), 5);
        assert!(plan_shards(&[], 10).is_empty());
        assert_eq!(shard_names(1), vec!["model.safetensors"]);
        assert_eq!(
            shard_names(2),
            vec![
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
    }
}
