//! Flags shared by several commands, as groups flattened into each command's flags: which
//! model and device, BiCache's settings, and the generation parameters.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use clap::Args;
use unmask::{CacheMode, Engine, EngineOptions, GenerationParams};
use unmask_gpu::WeightFormat;
use unmask_gpu::ops::attention::AttentionKernel;
use unmask_gpu::ops::matmul::MatmulKernel;
use unmask_gpu::tune::TunePolicy;

use crate::error::CliError;
use crate::live::LoadBar;
pub use crate::sampling_flags::{GenerationArgs, GenerationDefaults, SamplingArgs};
use crate::values;

/// Used when `--gen-length` is not given.
pub const DEFAULT_GEN_LENGTH: usize = 64;
/// Used when `--block-length` is not given and it divides the generation length.
pub const DEFAULT_BLOCK_LENGTH: usize = 32;

/// Looked up, in order, when `--model` is not given.
const DEFAULT_MODELS: [&str; 2] = ["models/tiny", "tests/fixtures/tiny"];

/// `--model DIR`.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// model folder (config.json, *.safetensors, optional tokenizer.json); default
    /// models/tiny, else tests/fixtures/tiny
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
}

/// A prompt as the generating and scoring commands take it: a user turn after an optional
/// system turn (the chat template), or token ids.
#[derive(Args, Debug)]
pub struct PromptArgs {
    /// the user message (rendered with the chat template)
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// a system message before the prompt
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// token ids used as they are, e.g. 1,2,3 (no tokenizer needed)
    // The path spelled out: one value holding the list, not a value per occurrence.
    #[arg(long, value_name = "IDS", value_parser = values::token_ids)]
    pub prompt_ids: Option<::std::vec::Vec<u32>>,
}

impl PromptArgs {
    /// The prompt, with `system` as the system turn (the flag's, or a caller's rewrite of
    /// it).
    pub fn prompt(&self, system: Option<String>) -> Result<unmask::Prompt, CliError> {
        if let Some(ids) = &self.prompt_ids {
            if self.system.is_some() {
                return Err(CliError::usage(
                    "--system needs --prompt TEXT; with --prompt-ids put the system turn's ids \
                     in the list",
                ));
            }
            return Ok(unmask::Prompt::Ids(ids.clone()));
        }
        let mut messages = Vec::new();
        if let Some(system) = system {
            messages.push(unmask_core::chat::Message::system(system));
        }
        let user = self.prompt.as_deref().unwrap_or_default();
        messages.push(unmask_core::chat::Message::user(user));
        Ok(unmask::Prompt::Chat(messages))
    }
}

impl ModelArgs {
    /// The model folder: `--model`, else the first default that exists. Says on stderr
    /// which one is used.
    pub fn dir(&self) -> Result<PathBuf, CliError> {
        if let Some(path) = &self.model {
            if !path.exists() {
                return Err(CliError::runtime(format!(
                    "model directory {} does not exist",
                    path.display()
                )));
            }
            if !path.is_dir() {
                return Err(CliError::runtime(format!(
                    "--model {} is not a directory: expected a folder with config.json and *.safetensors",
                    path.display()
                )));
            }
            eprintln!("model: {}", path.display());
            return Ok(path.clone());
        }
        let dir = default_model().ok_or_else(|| {
            CliError::runtime(format!(
                "no --model given and no default model found (looked for {} in {})",
                DEFAULT_MODELS.join(" and "),
                std::env::current_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_else(|_| "the current directory".into())
            ))
        })?;
        eprintln!(
            "model: {} (default; choose another with --model DIR)",
            dir.display()
        );
        Ok(dir)
    }
}

fn default_model() -> Option<PathBuf> {
    DEFAULT_MODELS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("config.json").is_file())
}

/// `--backend B`.
#[derive(Args, Clone, Debug)]
pub struct BackendArgs {
    /// vulkan, metal, dx12, gl or all (default: WGPU_BACKEND, else any)
    #[arg(long, value_name = "B", value_parser = values::backend)]
    pub backend: Option<String>,
}

/// Names `--weights`, `--embed-weights` and `--dtype` accept.
pub use crate::cache_flags::{CacheFlags, CacheSettings};

const WEIGHT_FORMATS: [&str; 5] = ["f16", "f16-packed", "f32", "q8", "q4"];

/// A weight format by its command-line name.
pub fn parse_weight_format(name: &str) -> Option<WeightFormat> {
    match name {
        "f16" => Some(WeightFormat::F16Native),
        "f16-packed" => Some(WeightFormat::F16Packed),
        "f32" => Some(WeightFormat::F32),
        "q8" => Some(WeightFormat::Q8),
        "q4" => Some(WeightFormat::Q4),
        _ => None,
    }
}

/// The adapter and the weight formats on the GPU.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    #[command(flatten)]
    pub backend: BackendArgs,
    /// weights on the GPU: f16 (default; native when the device has shader-f16), f16-packed,
    /// f32
    #[arg(long, value_name = "D", value_parser = ["f16", "f16-packed", "f32"])]
    pub dtype: Option<String>,
    /// matrices on the GPU: f16 (default), f16-packed, f32, or q8 / q4 (8- or 4-bit blocks
    /// quantized while loading); a checkpoint written by `unmask quantize` keeps its own
    /// format
    #[arg(long, value_name = "W", value_parser = WEIGHT_FORMATS)]
    pub weights: Option<String>,
    /// embedding table and LM head on the GPU: f16, f16-packed, f32, q8 or q4 (default: as
    /// --weights)
    #[arg(long, value_name = "W", value_parser = WEIGHT_FORMATS)]
    pub embed_weights: Option<String>,
    /// matmul kernel for every shape: auto (default: measured per shape on a GPU, see
    /// --tune) or one kernel by name (unmask info lists them)
    #[arg(long, value_name = "KERNEL", value_parser = values::matmul_kernel)]
    pub matmul: Option<MatmulKernel>,
    /// attention kernel: auto (default: measured per shape on a GPU, see --tune) or one
    /// kernel by name (unmask info lists them; one that cannot run here runs its fallback)
    #[arg(long, value_name = "KERNEL", value_parser = values::attention_kernel)]
    pub attention: Option<AttentionKernel>,
    /// choose auto kernels by timing them on first use: auto (default: on GPUs, not on CPU
    /// adapters), always or off
    #[arg(long, value_name = "WHEN", value_parser = values::choice(TunePolicy::NAMES, TunePolicy::parse))]
    pub tune: Option<TunePolicy>,
    /// file the measured choices are kept in (default: $UNMASK_TUNE_FILE, else
    /// <user cache dir>/unmask/kernels.json)
    #[arg(long, value_name = "PATH")]
    pub tune_file: Option<PathBuf>,
    /// storage of the K/V arena and cached prefixes: f32 (default) or f16 (half the memory)
    #[arg(long = "kv", value_name = "D", value_parser = ["f32", "f16"])]
    pub kv: Option<String>,
}

impl EngineArgs {
    /// The engine options these flags give, the others at their defaults.
    pub fn options(&self) -> Result<EngineOptions, CliError> {
        let name = match (self.dtype.as_deref(), self.weights.as_deref()) {
            (Some(d), Some(w)) if d != w => {
                return Err(CliError::usage(format!(
                    "--dtype {d} and --weights {w} disagree; give one of them"
                )));
            }
            (d, w) => w.or(d).unwrap_or("f16"),
        };
        let format = |name: &str| parse_weight_format(name).expect("checked by the parser");
        Ok(EngineOptions {
            backend: self.backend.backend.clone(),
            weight_format: format(name),
            embed_format: self.embed_weights.as_deref().map(format),
            matmul_kernel: self.matmul.unwrap_or(MatmulKernel::Auto),
            attention_kernel: self.attention.unwrap_or(AttentionKernel::Auto),
            tune: self.tune.unwrap_or_default(),
            tune_file: self.tune_file.clone(),
            kv_dtype: match self.kv.as_deref() {
                Some("f16") => unmask_gpu::DType::F16,
                _ => unmask_gpu::DType::F32,
            },
            ..EngineOptions::default()
        })
    }
}

/// The flags that end the lists of the generating commands (generate, chat, eval, trace):
/// BiCache's, the engine's (adapter and weight formats) and the GPU's limits.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub bicache: CacheFlags,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// most GPU memory the engine may hold (weights, request state, cached prefixes), e.g.
    /// 6G; work past it is refused with an error (default: what the device gives)
    #[arg(long, value_name = "BYTES", value_parser = values::byte_size)]
    pub gpu_memory: Option<u64>,
    /// compile the kernels without wgpu's runtime bounds checks (native only; their indices
    /// are clamped by construction and checked by the host; off by default)
    #[arg(long)]
    pub unchecked_shaders: bool,
}

impl RunArgs {
    /// Every engine option these flags give.
    pub fn engine_options(&self) -> Result<EngineOptions, CliError> {
        Ok(EngineOptions {
            cache_budget: self.bicache.budget(),
            gpu_memory: self.gpu_memory,
            shader_checks: !self.unchecked_shaders,
            ..self.engine.options()?
        })
    }
}

/// The help of `--cache MODE`.
pub const CACHE_HELP: &str = "how K/V are reused: none (default), fast-dllm-prefix, \
     fast-dllm-dual, prefix-arm, bicache, bicache-dual, acache";

/// `--cache MODE`: one cache mode.
#[derive(Args, Clone, Debug)]
pub struct CacheArgs {
    #[arg(
        long = "cache",
        value_name = "MODE",
        help = CACHE_HELP,
        value_parser = values::cache_mode(),
        default_value = "none",
        hide_default_value = true
    )]
    pub mode: CacheMode,
}

/// Loads the model, with a progress bar when stderr is a terminal.
pub fn load_engine(dir: &Path, options: &EngineOptions) -> Result<Engine, CliError> {
    let show = std::io::stderr().is_terminal();
    let mut bar = LoadBar::new();
    let result = Engine::load_with_progress(dir, options, &mut |p| {
        if show {
            bar.update(&p);
        }
    });
    bar.finish();
    let engine = result?;
    let formats = engine.model().weights.formats();
    let described = if formats.layers == formats.embed {
        formats.layers.name().to_string()
    } else {
        format!(
            "{}, embedding and LM head {}",
            formats.layers.name(),
            formats.embed.name()
        )
    };
    eprintln!(
        "loaded in {:.2} s on {} ({described} weights, {:.1} MiB)",
        engine.load_s(),
        engine.ctx().info.name,
        engine.model().weights.size_bytes() as f64 / (1024.0 * 1024.0)
    );
    let asked = (
        options.weight_format.resolve(engine.ctx()),
        options
            .embed_format
            .unwrap_or(options.weight_format)
            .resolve(engine.ctx()),
    );
    let defaults = EngineOptions::default();
    let explicit =
        options.weight_format != defaults.weight_format || options.embed_format.is_some();
    if explicit && asked != (formats.layers, formats.embed) {
        // Only matrices stored quantized (`unmask quantize`) are loaded as they are.
        eprintln!(
            "note: {} holds quantized matrices, which keep their stored format",
            dir.display()
        );
    }
    Ok(engine)
}

/// Token ids given on the command line must index the model's embedding table.
pub fn check_ids(engine: &Engine, flag: &str, ids: &[u32]) -> Result<(), CliError> {
    check_ids_below(engine.config().embedding_size, flag, ids)
}

/// `check_ids` against `rows` embedding rows (a model folder read without its weights).
pub fn check_ids_below(rows: usize, flag: &str, ids: &[u32]) -> Result<(), CliError> {
    match ids.iter().find(|&&id| id as usize >= rows) {
        Some(bad) => Err(CliError::usage(format!(
            "--{flag}: token id {bad} is outside the model's vocabulary (ids 0..{rows})"
        ))),
        None => Ok(()),
    }
}

/// The prompt, the generated tokens and an infilling suffix must fit the model's maximum
/// sequence length.
pub fn check_length(
    engine: &Engine,
    prompt_len: usize,
    suffix_len: usize,
    params: &GenerationParams,
) -> Result<(), CliError> {
    let max = engine.config().max_sequence_length;
    let total = prompt_len as u128 + params.gen_length as u128 + suffix_len as u128;
    if total > max as u128 {
        let suffix = if suffix_len > 0 {
            format!(" + the suffix's {suffix_len}")
        } else {
            String::new()
        };
        return Err(CliError::usage(format!(
            "the prompt's {prompt_len} tokens + --gen-length {}{suffix} = {total} exceed the \
             model's maximum sequence length {max}; lower --gen-length or shorten the prompt",
            params.gen_length,
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use unmask_core::tokenizer::DecodeMode;

    use super::*;

    /// The generating commands' shared flags on their own.
    #[derive(Parser, Debug)]
    struct Flags {
        #[command(flatten)]
        generation: GenerationArgs,
        #[command(flatten)]
        run: RunArgs,
    }

    fn parse(line: &str) -> Result<Flags, String> {
        Flags::try_parse_from(std::iter::once("unmask").chain(line.split_whitespace()))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn values_follow_the_flag_or_an_equals_sign() {
        let f =
            parse("--gen-length=16 --steps 8 --block-length 8 --raw --cache-budget 10,1K").unwrap();
        let (params, decode) = f.generation.params().unwrap();
        assert_eq!(
            (params.gen_length, params.steps, params.block_length),
            (16, 8, 8)
        );
        assert_eq!(decode, DecodeMode::Raw);
        let options = f.run.engine_options().unwrap();
        assert_eq!(options.cache_budget.max_tokens, 10);
        assert_eq!(options.cache_budget.max_bytes, 1024);
        assert!(options.shader_checks);
        let f = parse("--weights q8 --gpu-memory=6G --unchecked-shaders --depth 0").unwrap();
        let options = f.run.engine_options().unwrap();
        assert_eq!(options.weight_format, WeightFormat::Q8);
        assert_eq!(options.gpu_memory, Some(6 << 30));
        assert!(!options.shader_checks);
        assert_eq!(f.run.bicache.settings(&[CacheMode::Bicache]).depth, Some(0));
    }

    #[test]
    fn errors_name_the_flag_and_what_it_takes() {
        let err = |line: &str| parse(line).unwrap_err();
        assert!(err("--step 3").contains("'--steps'"), "a similar flag");
        let e = err("--steps -1");
        assert!(
            e.contains("'-1' for '--steps <N>': expected a whole number >= 1"),
            "{e}"
        );
        assert!(err("--temperature=x").contains("expected a number >= 0"));
        assert!(err("--steps 1 --steps 2").contains("cannot be used multiple times"));
        assert!(err("--remasking best").contains("low_confidence"));
        assert!(err("--raw=yes").contains("--raw"));
        assert!(err("--cache-budget 4,2T").contains("TOKENS or TOKENS,BYTES"));
        let f = parse("--dtype f32 --weights q8").unwrap();
        assert!(
            f.run
                .engine_options()
                .unwrap_err()
                .message
                .contains("disagree")
        );
        let f = parse("--gen-length 48 --block-length 32").unwrap();
        let e = f.generation.params().unwrap_err();
        assert!(
            e.message.contains("not a multiple of --block-length 32"),
            "{}",
            e.message
        );
    }
}
