//! Flags shared by several commands: which model and device, and the generation parameters.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use unmask::{CacheBudget, CacheMode, Engine, EngineOptions, GenerationParams, Remasking};
use unmask_core::error::SamplerError;
use unmask_core::tokenizer::DecodeMode;
use unmask_gpu::WeightFormat;

use crate::args::{Flag, Matches, invalid};
use crate::error::CliError;
use crate::live::LoadBar;

/// Used when `--gen-length` is not given.
pub const DEFAULT_GEN_LENGTH: usize = 64;
/// Used when `--block-length` is not given and it divides the generation length.
pub const DEFAULT_BLOCK_LENGTH: usize = 32;

/// Looked up, in order, when `--model` is not given.
const DEFAULT_MODELS: [&str; 2] = ["models/tiny", "tests/fixtures/tiny"];

pub const MODEL: Flag = Flag::value(
    "model",
    "DIR",
    "model folder (config.json, *.safetensors, optional tokenizer.json); default models/tiny, else tests/fixtures/tiny",
);
pub const BACKEND: Flag = Flag::value(
    "backend",
    "B",
    "vulkan, metal, dx12, gl or all (default: WGPU_BACKEND, else any)",
);
pub const DTYPE: Flag = Flag::value(
    "dtype",
    "D",
    "weights on the GPU: f16 (default; native when the device has shader-f16), f16-packed, f32",
);
pub const WEIGHTS: Flag = Flag::value(
    "weights",
    "W",
    "matrices on the GPU: f16 (default), f16-packed, f32, or q8 / q4 (8- or 4-bit blocks \
     quantized while loading); a checkpoint written by `unmask quantize` keeps its own format",
);
pub const EMBED_WEIGHTS: Flag = Flag::value(
    "embed-weights",
    "W",
    "embedding table and LM head on the GPU: f16, f16-packed, f32, q8 or q4 \
     (default: as --weights)",
);

/// Names `--weights`, `--embed-weights` and `--dtype` accept.
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

/// Every cache mode name, for help texts and error messages.
const CACHE_MODES: &str =
    "none, fast-dllm-prefix, fast-dllm-dual, prefix-arm, bicache, bicache-dual";

pub const CACHE: Flag = Flag::value(
    "cache",
    "MODE",
    "how K/V are reused: none (default), fast-dllm-prefix, fast-dllm-dual, prefix-arm, \
     bicache, bicache-dual",
);

/// Used when `--refresh` is not given (the paper's R).
pub const DEFAULT_REFRESH: usize = 16;

/// BiCache's flags: the depth, the refresh interval and the store's budget.
pub fn bicache_flags() -> Vec<Flag> {
    vec![
        Flag::value(
            "depth",
            "B",
            "BiCache: shallow layers that reuse the shared prefix (default: the model's \
             bicache_depth.json; without one BiCache falls back and says why)",
        ),
        Flag::value(
            "refresh",
            "R",
            "BiCache: steps between deep-prefix refreshes in one-block requests (default 16)",
        ),
        Flag::value(
            "cache-budget",
            "TOKENS[,BYTES]",
            "BiCache: what the shared prefix store may hold, e.g. 5000 or 5000,2G \
             (BYTES takes K, M, G; default 65536 tokens, 1G)",
        ),
    ]
}

pub const GPU_MEMORY: Flag = Flag::value(
    "gpu-memory",
    "BYTES",
    "most GPU memory the engine may hold (weights, request state, cached prefixes), e.g. \
     6G; work past it is refused with an error (default: what the device gives)",
);

pub const UNCHECKED_SHADERS: Flag = Flag::switch(
    "unchecked-shaders",
    "compile the kernels without wgpu's runtime bounds checks (native only; their indices \
     are clamped by construction and checked by the host; off by default)",
);

/// The flags that end the lists of the generating commands (generate, chat, eval): BiCache's,
/// the engine's (adapter and weight formats), and `--json` with the command's own help.
pub fn generation_run_flags(json_help: &'static str) -> Vec<Flag> {
    let mut flags = bicache_flags();
    flags.extend([
        BACKEND,
        DTYPE,
        WEIGHTS,
        EMBED_WEIGHTS,
        GPU_MEMORY,
        UNCHECKED_SHADERS,
    ]);
    flags.push(Flag::switch("json", json_help));
    flags
}

/// `--depth` and `--refresh` for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BicacheSettings {
    pub depth: Option<usize>,
    pub refresh_every: usize,
}

/// `--depth B` and `--refresh R`, checked; a note on stderr when no mode in `modes` uses them.
pub fn bicache_settings(m: &Matches, modes: &[CacheMode]) -> Result<BicacheSettings, CliError> {
    let depth = m.parsed::<usize>("depth", "a whole number >= 0")?;
    let refresh_every = m
        .checked("refresh", "a whole number >= 1", |r: usize| r >= 1)?
        .unwrap_or(DEFAULT_REFRESH);
    if !modes.iter().any(|c| c.is_bicache()) {
        let given: Vec<&str> = ["depth", "refresh", "cache-budget"]
            .into_iter()
            .filter(|f| m.value(f).is_some())
            .collect();
        if !given.is_empty() {
            eprintln!(
                "note: --{} {} used only by --cache bicache and bicache-dual",
                given.join(", --"),
                if given.len() == 1 { "is" } else { "are" }
            );
        }
    }
    Ok(BicacheSettings {
        depth,
        refresh_every,
    })
}

/// `TOKENS[,BYTES]`, BYTES with an optional K, M or G (powers of 1024); the bytes limit
/// stays `default_bytes` when only tokens are given.
pub fn parse_cache_budget(text: &str, default_bytes: u64) -> Option<CacheBudget> {
    let (tokens, bytes) = match text.split_once(',') {
        Some((t, b)) => (t, Some(b)),
        None => (text, None),
    };
    let max_tokens = tokens.trim().parse::<usize>().ok()?;
    let max_bytes = match bytes {
        None => default_bytes,
        Some(b) => parse_bytes(b.trim())?,
    };
    Some(CacheBudget {
        max_tokens,
        max_bytes,
    })
}

/// `512`, `64K`, `1.5G`: bytes with an optional binary suffix (a trailing `B` or `iB` is
/// accepted too).
pub fn parse_bytes(text: &str) -> Option<u64> {
    let upper = text.to_ascii_uppercase();
    let body = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (number, scale) = match body.chars().last()? {
        'K' => (&body[..body.len() - 1], 1u64 << 10),
        'M' => (&body[..body.len() - 1], 1 << 20),
        'G' => (&body[..body.len() - 1], 1 << 30),
        _ => (body, 1),
    };
    let number = number.trim();
    if let Ok(n) = number.parse::<u64>() {
        return n.checked_mul(scale);
    }
    let f = number.parse::<f64>().ok()?;
    let bytes = f * scale as f64;
    (f.is_finite() && f >= 0.0 && bytes < u64::MAX as f64).then(|| bytes.round() as u64)
}

/// `--cache MODE`, `none` when absent.
pub fn cache_mode(m: &Matches) -> Result<CacheMode, CliError> {
    match m.value("cache") {
        None => Ok(CacheMode::None),
        Some(text) => parse_cache_mode(text.trim())
            .ok_or_else(|| invalid("cache", &format!("one of {CACHE_MODES}"), text)),
    }
}

/// `--cache MODE[,MODE...]` or `--cache all`, in the order given; `[none]` when absent.
pub fn cache_modes(m: &Matches) -> Result<Vec<CacheMode>, CliError> {
    let Some(text) = m.value("cache") else {
        return Ok(vec![CacheMode::None]);
    };
    if text.trim() == "all" {
        return Ok(CacheMode::ALL.to_vec());
    }
    let expected = format!("`all` or a comma-separated list of {CACHE_MODES}");
    let mut modes = Vec::new();
    for part in text.split(',').map(str::trim) {
        let mode = parse_cache_mode(part).ok_or_else(|| {
            if part.is_empty() {
                invalid("cache", &expected, text)
            } else {
                CliError::usage(format!(
                    "invalid value for --cache: `{part}` is not a cache mode (expected {expected})"
                ))
            }
        })?;
        if modes.contains(&mode) {
            return Err(CliError::usage(format!(
                "--cache lists {mode} more than once"
            )));
        }
        modes.push(mode);
    }
    Ok(modes)
}

/// `cache_modes`, with every mode when `--cache` is absent.
pub fn cache_modes_or_all(m: &Matches) -> Result<Vec<CacheMode>, CliError> {
    match m.value("cache") {
        None => Ok(CacheMode::ALL.to_vec()),
        Some(_) => cache_modes(m),
    }
}

fn parse_cache_mode(name: &str) -> Option<CacheMode> {
    name.parse().ok()
}

pub fn generation_flags() -> Vec<Flag> {
    vec![
        Flag::value("gen-length", "N", "tokens to generate (default 64)"),
        Flag::value(
            "steps",
            "N",
            "denoising steps over all blocks (default: gen-length)",
        ),
        Flag::value(
            "block-length",
            "N",
            "semi-autoregressive block size (default 32, or gen-length when 32 does not divide it)",
        ),
        Flag::value("temperature", "T", "0 is greedy (default 0)"),
        Flag::value("remasking", "R", "low_confidence (default) or random"),
        Flag::value(
            "cfg-scale",
            "W",
            "classifier-free guidance weight (default 0: off)",
        ),
        Flag::value(
            "threshold",
            "T",
            "commit every prediction at least this confident, in (0, 1] (Fast-dLLM)",
        ),
        Flag::value(
            "seed",
            "S",
            "random seed for temperature > 0 and random remasking (default 0)",
        ),
        Flag::switch("logits-eos-inf", "never predict the end-of-text token"),
        Flag::switch(
            "confidence-eos-eot-inf",
            "commit end-of-text / end-of-turn predictions last",
        ),
        Flag::value(
            "confidence-precision",
            "P",
            "precision of the confidences that rank positions: bf16 (default) rounds them as \
             the reference run in bfloat16 does (its softmax returns bf16); f32 keeps them, as \
             a float32 reference does (tools/llada_ref.py, tools/llada_torch.py --dtype f32). \
             Near-ties can commit different positions under the two",
        ),
        Flag::switch(
            "raw",
            "decode every generated token (default: stop at end of turn)",
        ),
    ]
}

/// Defaults of the generation flags that differ between commands.
#[derive(Clone, Copy, Debug)]
pub struct GenerationDefaults {
    pub gen_length: usize,
    /// True: one block over the whole canvas. False: `DEFAULT_BLOCK_LENGTH` when it divides
    /// the generation length, else the generation length.
    pub single_block: bool,
}

impl GenerationDefaults {
    /// `generate` and `chat`: 64 tokens in blocks of 32.
    pub const STANDARD: Self = Self {
        gen_length: DEFAULT_GEN_LENGTH,
        single_block: false,
    };
}

/// The generation parameters and decode mode given by `generation_flags`, checked as the
/// sampler will check them, so a bad combination is reported before the model loads.
pub fn generation_params(m: &Matches) -> Result<(GenerationParams, DecodeMode), CliError> {
    generation_params_with(m, GenerationDefaults::STANDARD)
}

/// `generation_params` with other defaults for the flags that are not given.
pub fn generation_params_with(
    m: &Matches,
    defaults: GenerationDefaults,
) -> Result<(GenerationParams, DecodeMode), CliError> {
    const WHOLE: &str = "a whole number >= 1";
    let positive = |v: usize| v >= 1;
    let gen_length = m
        .checked("gen-length", WHOLE, positive)?
        .unwrap_or(defaults.gen_length);
    let block_length = match m.checked("block-length", WHOLE, positive)? {
        Some(b) => b,
        None if !defaults.single_block && gen_length.is_multiple_of(DEFAULT_BLOCK_LENGTH) => {
            DEFAULT_BLOCK_LENGTH
        }
        None => gen_length,
    };
    let steps = m.checked("steps", WHOLE, positive)?.unwrap_or(gen_length);
    let temperature = m
        .checked("temperature", "a number >= 0", |t: f32| {
            t.is_finite() && t >= 0.0
        })?
        .unwrap_or(0.0);
    let remasking = match m.choice("remasking", &["low_confidence", "random"])? {
        Some("random") => Remasking::Random,
        _ => Remasking::LowConfidence,
    };
    let cfg_scale = m
        .checked("cfg-scale", "a number >= 0", |w: f32| {
            w.is_finite() && w >= 0.0
        })?
        .unwrap_or(0.0);
    let threshold = m.checked("threshold", "a number in (0, 1]", |t: f32| {
        t > 0.0 && t <= 1.0
    })?;
    let seed = m.parsed("seed", "a whole number >= 0")?.unwrap_or(0);
    let round_confidence_bf16 = match m.choice("confidence-precision", &["f32", "bf16"])? {
        Some("f32") => false,
        Some(_) => true,
        None => GenerationParams::default().round_confidence_bf16,
    };
    let params = GenerationParams {
        gen_length,
        steps,
        block_length,
        temperature,
        remasking,
        cfg_scale,
        threshold,
        logits_eos_inf: m.switch("logits-eos-inf"),
        confidence_eos_eot_inf: m.switch("confidence-eos-eot-inf"),
        seed,
        round_confidence_bf16,
    };
    params
        .validate(1, usize::MAX)
        .map_err(|e| schedule_error(&params, e))?;
    let decode = if m.switch("raw") {
        DecodeMode::Raw
    } else {
        DecodeMode::Clean
    };
    Ok((params, decode))
}

/// The sampler's objection, in terms of the flags.
fn schedule_error(p: &GenerationParams, e: SamplerError) -> CliError {
    let blocks = p.gen_length / p.block_length.max(1);
    CliError::usage(match e {
        SamplerError::GenNotMultipleOfBlock { .. } => format!(
            "--gen-length {} is not a multiple of --block-length {}",
            p.gen_length, p.block_length
        ),
        SamplerError::TooFewSteps { .. } => format!(
            "--steps {} is fewer than the {blocks} blocks (--gen-length {} / --block-length {}); \
             every block needs at least one step",
            p.steps, p.gen_length, p.block_length
        ),
        SamplerError::StepsNotMultipleOfBlocks { .. } => format!(
            "--steps {} is not a multiple of the {blocks} blocks (--gen-length {} / --block-length {})",
            p.steps, p.gen_length, p.block_length
        ),
        other => format!("invalid generation flags: {other}"),
    })
}

/// The model folder: `--model`, else the first default that exists. Says on stderr which
/// one is used.
pub fn model_dir(m: &Matches) -> Result<PathBuf, CliError> {
    if let Some(dir) = m.value("model") {
        let path = PathBuf::from(dir);
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
        return Ok(path);
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

fn default_model() -> Option<PathBuf> {
    DEFAULT_MODELS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("config.json").is_file())
}

/// `--backend` and `--dtype`, checked.
pub fn engine_options(m: &Matches) -> Result<EngineOptions, CliError> {
    let backend = match m.value("backend") {
        Some(name) => {
            unmask_gpu::parse_backend(name).map_err(|_| {
                invalid(
                    "backend",
                    "one of vulkan, metal, dx12, gl, webgpu, all",
                    name,
                )
            })?;
            Some(name.to_string())
        }
        None => None,
    };
    let dtype = m.choice("dtype", &["f16", "f16-packed", "f32"])?;
    let weights = m.choice("weights", &WEIGHT_FORMATS)?;
    let name = match (dtype, weights) {
        (Some(d), Some(w)) if d != w => {
            return Err(CliError::usage(format!(
                "--dtype {d} and --weights {w} disagree; give one of them"
            )));
        }
        (d, w) => w.or(d).unwrap_or("f16"),
    };
    let weight_format = parse_weight_format(name).expect("checked by choice");
    let embed_format = m
        .choice("embed-weights", &WEIGHT_FORMATS)?
        .map(|n| parse_weight_format(n).expect("checked by choice"));
    let defaults = EngineOptions::default().cache_budget;
    let cache_budget = match m.value("cache-budget") {
        None => defaults,
        Some(text) => parse_cache_budget(text, defaults.max_bytes).ok_or_else(|| {
            invalid(
                "cache-budget",
                "TOKENS or TOKENS,BYTES such as 5000 or 5000,2G (BYTES may end in K, M or G)",
                text,
            )
        })?,
    };
    let gpu_memory = match m.value("gpu-memory") {
        None => None,
        Some(text) => Some(parse_bytes(text.trim()).filter(|&b| b > 0).ok_or_else(|| {
            invalid(
                "gpu-memory",
                "a size in bytes > 0 such as 6G, 512M or 1000000",
                text,
            )
        })?),
    };
    Ok(EngineOptions {
        backend,
        weight_format,
        embed_format,
        cache_budget,
        gpu_memory,
        shader_checks: !m.switch("unchecked-shaders"),
    })
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
    let rows = engine.config().embedding_size;
    match ids.iter().find(|&&id| id as usize >= rows) {
        Some(bad) => Err(CliError::usage(format!(
            "--{flag}: token id {bad} is outside the model's vocabulary (ids 0..{rows})"
        ))),
        None => Ok(()),
    }
}

/// The prompt and the generated tokens must fit the model's maximum sequence length.
pub fn check_length(
    engine: &Engine,
    prompt_len: usize,
    params: &GenerationParams,
) -> Result<(), CliError> {
    let max = engine.config().max_sequence_length;
    let total = prompt_len.saturating_add(params.gen_length);
    if total > max {
        return Err(CliError::usage(format!(
            "the prompt's {prompt_len} tokens + --gen-length {} = {} exceed the model's maximum \
             sequence length {max}; lower --gen-length or shorten the prompt",
            params.gen_length,
            prompt_len as u128 + params.gen_length as u128
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_budgets_take_tokens_and_optional_bytes() {
        let b = |t: &str| parse_cache_budget(t, 7).map(|b| (b.max_tokens, b.max_bytes));
        assert_eq!(b("5000"), Some((5000, 7)));
        assert_eq!(b("5000,2G"), Some((5000, 2 << 30)));
        assert_eq!(b(" 4 , 512 "), Some((4, 512)));
        assert_eq!(b("10,64K"), Some((10, 64 << 10)));
        assert_eq!(b("10,1.5m"), Some((10, 3 << 19)));
        assert_eq!(b("10,3MiB"), Some((10, 3 << 20)));
        assert_eq!(b("10,100B"), Some((10, 100)));
        for bad in ["", "x", "-1", "4,", "4,G", "4,-2K", "4,2T", "4,2,3"] {
            assert_eq!(b(bad), None, "{bad}");
        }
    }
}
