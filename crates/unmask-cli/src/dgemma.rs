//! DiffusionGemma in the CLI: recognising its folder, its sampler settings and `unmask
//! generate` on it (the chat layout, the generation loop, the answer decoded).

use std::path::Path;

use unmask::{DgemmaEngine, DgemmaRequest, EngineOptions, Prompt};
use unmask_core::config::entropy_bound_params;
use unmask_core::sampler::entropy_bound::EntropyBoundParams;

use crate::error::CliError;

/// Whether `dir/config.json` says `model_type: "diffusion_gemma"` (a missing or unreadable
/// config is left to the usual loader, which names the problem).
pub fn is_diffusion_gemma(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .is_ok_and(|text| unmask::is_diffusion_gemma_config(&text))
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

/// What `unmask generate` asks of a DiffusionGemma run beyond the prompt.
pub struct DgemmaRun {
    pub seed: u64,
    /// `--gen-length`: max_new_tokens instead of generation_config.json's.
    pub max_new_tokens: Option<usize>,
    /// `--steps`: max_denoising_steps instead of generation_config.json's.
    pub max_steps: Option<usize>,
    pub json: bool,
    /// `--logprobs`: each answer token's log-probability in the JSON.
    pub logprobs: bool,
    /// `--logit-bias`: (id, bias) pairs added to every canvas row's logits.
    pub logit_bias: Vec<(u32, f32)>,
}

/// `unmask generate` on a DiffusionGemma folder: the sampler settings of its
/// generation_config.json (`--gen-length` and `--steps` override the token and step limits),
/// the project's random draws from the seed; prints the answer, or with `json` an object
/// with the ids, the text and each canvas's steps.
pub fn generate(
    dir: &Path,
    options: &EngineOptions,
    prompt: Prompt,
    run: DgemmaRun,
) -> Result<(), CliError> {
    if matches!(&prompt, Prompt::Ids(ids) if ids.is_empty()) {
        return Err(CliError::usage(
            "the prompt is empty: give --prompt TEXT or --prompt-ids",
        ));
    }
    let engine = DgemmaEngine::load(dir, options)?;
    eprintln!(
        "loaded DiffusionGemma in {:.2} s on {} ({} weights)",
        engine.load_s(),
        engine.ctx().info.name,
        options.weight_format.resolve(engine.ctx()).name()
    );
    let request = DgemmaRequest {
        seed: run.seed,
        max_new_tokens: run.max_new_tokens,
        max_denoising_steps: run.max_steps,
        logit_bias: run.logit_bias.clone(),
        ..DgemmaRequest::new(prompt)
    };
    let out = engine.generate(&request)?;
    let text = out.text.clone().unwrap_or_default();
    if run.json {
        let canvases: Vec<serde_json::Value> = out
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
        let json = serde_json::json!({
            "prompt_ids": out.prompt_ids,
            "ids": out.ids,
            "text": text,
            "logprobs": run.logprobs.then(|| out.logprobs()),
            "seed": run.seed,
            "canvases": canvases,
            "seconds": out.seconds,
        });
        println!("{json}");
    } else {
        println!("{text}");
        let steps: usize = out.canvases.iter().map(|c| c.steps.len()).sum();
        eprintln!(
            "{} canvases, {steps} denoising steps in {:.2} s",
            out.canvases.len(),
            out.seconds
        );
    }
    Ok(())
}

/// Refuses the masked-diffusion sampler's flags by name: DiffusionGemma's temperature
/// schedule and entropy bound come from its generation_config.json, and its canvases have
/// no committed tokens for the penalties to count.
pub fn refuse_masked_flags(sampling: &crate::sampling_flags::SamplingArgs) -> Result<(), CliError> {
    let given = sampling.masked_only_given();
    if given.is_empty() {
        return Ok(());
    }
    Err(CliError::usage(format!(
        "{}: not a DiffusionGemma setting (its sampler's temperature schedule and entropy \
         bound come from generation_config.json; it takes --gen-length, --steps, --seed and \
         --logit-bias); leave {} out",
        given.join(", "),
        if given.len() == 1 { "it" } else { "them" }
    )))
}
