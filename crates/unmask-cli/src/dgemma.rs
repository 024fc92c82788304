//! DiffusionGemma in the CLI: recognising its folder, its sampler settings and `unmask
//! generate` on it (the chat layout, the generation loop, the answer decoded).

use std::path::Path;

use unmask::EngineOptions;
use unmask_core::chat::Message;
use unmask_core::config::{DiffusionGemmaConfig, entropy_bound_params};
use unmask_core::sampler::entropy_bound::{EntropyBoundParams, SeededDraws};
use unmask_core::tokenizer::{DecodeMode, Tokenizer};
use unmask_gpu::GpuContext;
use unmask_gpu::dgemma::DgemmaModel;

use crate::error::CliError;

/// Whether `dir/config.json` says `model_type: "diffusion_gemma"` (a missing or unreadable
/// config is left to the usual loader, which names the problem).
pub fn is_diffusion_gemma(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| v.as_object().map(DiffusionGemmaConfig::is_diffusion_gemma))
        .unwrap_or(false)
}

/// The sampler settings of `dir/generation_config.json`, the published ones without it.
pub fn generation_params(dir: &Path) -> Result<EntropyBoundParams, CliError> {
    let path = dir.join("generation_config.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => entropy_bound_params(&text, &path.display().to_string())
            .map_err(|e| CliError::runtime(e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(EntropyBoundParams::default()),
        Err(e) => Err(CliError::context(
            format!("cannot read {}", path.display()),
            e,
        )),
    }
}

/// The prompt of a generation: chat messages (rendered with Gemma 4's layout) or ids.
pub enum DgemmaPrompt {
    Chat(Vec<Message>),
    Ids(Vec<u32>),
}

/// What `unmask generate` asks of a DiffusionGemma run beyond the prompt.
pub struct DgemmaRun {
    pub seed: u64,
    /// `--gen-length`: max_new_tokens instead of generation_config.json's.
    pub max_new_tokens: Option<usize>,
    /// `--steps`: max_denoising_steps instead of generation_config.json's.
    pub max_steps: Option<usize>,
    pub json: bool,
}

/// `unmask generate` on a DiffusionGemma folder: the sampler settings of its
/// generation_config.json (`--gen-length` and `--steps` override the token and step limits),
/// the project's random draws from the seed; prints the answer, or with `json` an object
/// with the ids, the text and each canvas's steps.
pub fn generate(
    dir: &Path,
    options: &EngineOptions,
    prompt: DgemmaPrompt,
    run: DgemmaRun,
) -> Result<(), CliError> {
    let mut params = generation_params(dir)?;
    params.max_new_tokens = run.max_new_tokens.unwrap_or(params.max_new_tokens);
    params.max_denoising_steps = run.max_steps.unwrap_or(params.max_denoising_steps);
    let (seed, json) = (run.seed, run.json);
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let ids = match prompt {
        DgemmaPrompt::Ids(ids) => ids,
        DgemmaPrompt::Chat(messages) => {
            unmask_core::gemma_chat::encode(&tokenizer, &messages, false)?
        }
    };
    if ids.is_empty() {
        return Err(CliError::usage(
            "the prompt is empty: give --prompt TEXT or --prompt-ids",
        ));
    }
    let ctx = GpuContext::new(&options.context_options()?)?;
    let config = std::fs::read_to_string(dir.join("config.json"))
        .map_err(|e| CliError::context(format!("cannot read {}/config.json", dir.display()), e))?;
    let cfg = DiffusionGemmaConfig::from_json_str(&config, "config.json")
        .map_err(|e| CliError::runtime(e.to_string()))?;
    let positions =
        ids.len() + params.max_new_tokens.div_ceil(cfg.canvas_length) * cfg.canvas_length;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(CliError::usage(format!(
            "--prompt-ids: expected ids below the vocabulary size {}, found {bad}",
            cfg.vocab_size
        )));
    }
    let started = std::time::Instant::now();
    let model = DgemmaModel::load(&ctx, dir, options.weight_format, positions)?;
    eprintln!(
        "loaded DiffusionGemma in {:.2} s on {} ({} weights)",
        started.elapsed().as_secs_f64(),
        ctx.info.name,
        options.weight_format.resolve(&ctx).name()
    );
    let started = std::time::Instant::now();
    let mut draws = SeededDraws::new(seed);
    let g = model.generate(&ctx, &ids, &params, &mut draws, seed)?;
    let seconds = started.elapsed().as_secs_f64();
    let answer = &g.sequence[ids.len()..];
    let text = tokenizer.decode(answer, DecodeMode::Clean)?;
    if json {
        let canvases: Vec<serde_json::Value> = g
            .canvases
            .iter()
            .map(|c| {
                serde_json::json!({
                    "steps": c.steps.len(),
                    "stopped_early": c.steps.last().is_some_and(|s| s.stop),
                    "accepted_per_step": c.steps.iter().map(|s| s.accepted.len()).collect::<Vec<_>>(),
                    "output": c.output,
                })
            })
            .collect();
        let out = serde_json::json!({
            "prompt_ids": ids,
            "ids": answer,
            "text": text,
            "seed": seed,
            "canvases": canvases,
            "seconds": seconds,
        });
        println!("{out}");
    } else {
        println!("{text}");
        let steps: usize = g.canvases.iter().map(|c| c.steps.len()).sum();
        eprintln!(
            "{} canvases, {steps} denoising steps in {seconds:.2} s",
            g.canvases.len()
        );
    }
    Ok(())
}
