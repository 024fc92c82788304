//! What `unmask synth` writes a checkpoint of: a preset or a `config.json`, of a
//! masked-diffusion model (LLaDA, Dream) or of DiffusionGemma, optionally cut to fewer layers.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::SynthError;
use crate::config::{DIFFUSION_GEMMA_26B_A4B_CONFIG_JSON, DiffusionGemmaConfig, ModelConfig};
use crate::error::ConfigError;

/// The DiffusionGemma preset: the published 26B-A4B's text stack.
pub const DIFFUSION_GEMMA_PRESET: &str = "diffusiongemma-26b-a4b";

/// Names accepted by [`SynthConfig::preset`].
pub const PRESET_NAMES: [&str; 5] = [
    ModelConfig::PRESETS[0],
    ModelConfig::PRESETS[1],
    ModelConfig::PRESETS[2],
    ModelConfig::PRESETS[3],
    DIFFUSION_GEMMA_PRESET,
];

/// The model a checkpoint is written for.
#[derive(Clone, Debug, PartialEq)]
pub enum SynthModel {
    /// LLaDA or Dream.
    Masked(ModelConfig),
    DiffusionGemma(DiffusionGemmaConfig),
}

impl SynthModel {
    /// Every tensor of the checkpoint, in checkpoint order: name and shape.
    pub fn tensor_specs(&self) -> Vec<(String, Vec<usize>)> {
        match self {
            Self::Masked(c) => c.tensor_specs(),
            Self::DiffusionGemma(c) => c.tensor_specs(),
        }
    }

    /// Parameters of the checkpoint (DiffusionGemma: its text stack's, the encoder's copies
    /// of the layer scalars included).
    pub fn parameter_count(&self) -> u64 {
        match self {
            Self::Masked(c) => c.parameter_count(),
            Self::DiffusionGemma(c) => c
                .tensor_specs()
                .iter()
                .map(|(_, s)| s.iter().product::<usize>() as u64)
                .sum(),
        }
    }

    /// The LLaDA or Dream config; `None` for DiffusionGemma.
    pub fn masked(&self) -> Option<&ModelConfig> {
        match self {
            Self::Masked(c) => Some(c),
            Self::DiffusionGemma(_) => None,
        }
    }

    fn parse(text: &str, file: &str) -> Result<Self, ConfigError> {
        let is_gemma = serde_json::from_str::<Value>(text)
            .ok()
            .and_then(|v| v.as_object().map(DiffusionGemmaConfig::is_diffusion_gemma))
            .unwrap_or(false);
        if is_gemma {
            DiffusionGemmaConfig::from_json_str(text, file).map(Self::DiffusionGemma)
        } else {
            ModelConfig::from_json_str(text).map(Self::Masked)
        }
    }
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
    pub config: SynthModel,
}

impl SynthConfig {
    /// A preset (see [`ModelConfig::preset`], and DiffusionGemma's published text stack);
    /// None for other names.
    pub fn preset(name: &str) -> Option<Self> {
        if name == DIFFUSION_GEMMA_PRESET {
            let text = DIFFUSION_GEMMA_26B_A4B_CONFIG_JSON;
            let config = DiffusionGemmaConfig::from_json_str(text, name).ok()?;
            // Pretty, like the published file; no generation_config.json: the engine then
            // takes the published sampler settings.
            let value: Value = serde_json::from_str(text).ok()?;
            return Some(Self {
                source: name.to_string(),
                config_json: pretty(&value),
                generation_config_json: None,
                config: SynthModel::DiffusionGemma(config),
            });
        }
        let files = ModelConfig::preset_files(name)?;
        Some(Self {
            source: name.to_string(),
            config_json: files.config_json,
            generation_config_json: Some(files.generation_config_json),
            config: SynthModel::Masked(ModelConfig::preset(name)?),
        })
    }

    /// A LLaDA, Dream or DiffusionGemma `config.json` (or a folder holding one), copied as
    /// it is, with the `generation_config.json` beside it when there is one.
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
        // A size-bounded read of a regular file first: a FIFO, a broken link or a file past
        // its size bound is refused before anything reads it whole.
        let bytes = crate::small_files::read(&config_path).map_err(|why| {
            err(ConfigError::Io {
                path: config_path.clone(),
                source: std::io::Error::other(why),
            })
        })?;
        let config_json = String::from_utf8(bytes).map_err(|e| {
            err(ConfigError::Io {
                path: config_path.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            })
        })?;
        let config = match SynthModel::parse(&config_json, &config_path.display().to_string()) {
            // LLaDA and Dream configs through their file reader, which also checks
            // generation_config.json's token ids.
            Ok(SynthModel::Masked(_)) => {
                SynthModel::Masked(ModelConfig::from_file(&config_path).map_err(err)?)
            }
            other => other.map_err(err)?,
        };
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

    /// The same model with `n_layers` layers (every other field kept): a checkpoint with the
    /// real tensor names and shapes of a big model, small enough to run a few layers of it.
    /// DiffusionGemma's `layer_types` and `per_layer_config` are cut to the layers kept.
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
        match (&self.config, value.as_object_mut()) {
            (SynthModel::Masked(c), Some(obj)) => {
                let key = c.family.config_key("n_layers");
                obj.insert(key.into(), Value::from(n_layers));
            }
            (SynthModel::DiffusionGemma(_), Some(obj)) => {
                if let Some(Value::Object(text)) = obj.get_mut("text_config") {
                    cut_gemma_layers(text, n_layers);
                }
            }
            _ => {}
        }
        let config_json = pretty(&value);
        self.config = SynthModel::parse(&config_json, "config.json").map_err(err)?;
        self.config_json = config_json;
        self.source = format!("{} with {n_layers} layers", self.source);
        Ok(self)
    }

    /// A preset name, else the path of a config file or folder.
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

/// `text_config` with its first `n` layers: the count, `layer_types` cut, and the
/// `per_layer_config` entries of the layers dropped removed.
fn cut_gemma_layers(text: &mut Map<String, Value>, n: usize) {
    text.insert("num_hidden_layers".into(), Value::from(n));
    if let Some(Value::Array(types)) = text.get_mut("layer_types") {
        types.truncate(n);
    }
    if let Some(Value::Object(per_layer)) = text.get_mut("per_layer_config") {
        per_layer.retain(|k, _| k.parse::<usize>().is_ok_and(|l| l < n));
    }
}

/// Indented like Hugging Face's JSON files.
pub(super) fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).expect("JSON values serialize") + "\n"
}
