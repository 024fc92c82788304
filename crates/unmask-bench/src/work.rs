//! A request's work per cache mode without running it: the mode planner (the runtime's own
//! `cache::plan_mode`) over the request's whole schedule, with the quota sampler committing
//! the positions it is asked for, counted as rows × layers and FLOPs at a model's shapes.
//! Exact for every mode whose rows do not depend on the tokens (all of them under quota
//! decoding), and free of a GPU: the 8B shapes cost nothing to count.
//!
//! FLOPs per computed row and layer: the QKV, output, gate|up and down projections (2 per
//! multiply-add) and attention over the positions the row attends to. A row V-verify checks
//! but does not recompute costs its QKV projection (the runtime projects q, k and v of
//! every response row on such a step).

use serde_json::{Value, json};
use unmask_core::adaptive::AdaptiveRefresh;
use unmask_core::cache::{CacheMode, SeqState, plan_mode};
use unmask_core::config::ModelConfig;
use unmask_core::error::SamplerError;
use unmask_core::sampler::{GenerationParams, Sampler};

/// The request whose schedule is counted.
#[derive(Clone, Debug)]
pub struct WorkRequest {
    pub prompt_tokens: usize,
    /// Leading prompt tokens a BiCache mode shares (its segment A).
    pub prefix_tokens: usize,
    pub params: GenerationParams,
}

/// One mode's setting: BiCache's depth b, dLLM-Cache's refresh.
#[derive(Clone, Copy, Debug)]
pub struct WorkMode {
    pub cache: CacheMode,
    pub depth: usize,
    pub adaptive: AdaptiveRefresh,
}

/// FLOPs of one row through one layer attending to `kv` positions, and of its QKV
/// projection alone.
fn row_flops(cfg: &ModelConfig, kv: usize) -> (f64, f64) {
    let d = cfg.d_model as f64;
    let hd = cfg.head_dim() as f64;
    let (h, hkv) = (cfg.n_heads as f64, cfg.n_kv_heads as f64);
    let qkv = 2.0 * d * (h + 2.0 * hkv) * hd;
    let out = 2.0 * h * hd * d;
    let mlp = 2.0 * 3.0 * d * cfg.mlp_hidden_size as f64;
    let attention = 4.0 * h * hd * kv as f64;
    (qkv + out + mlp + attention, qkv)
}

/// The counts of one mode's whole request.
pub fn request_work(
    cfg: &ModelConfig,
    request: &WorkRequest,
    mode: WorkMode,
) -> Result<Value, SamplerError> {
    let n_layers = cfg.n_layers;
    let prompt: Vec<u32> = vec![1; request.prompt_tokens];
    let mut sampler = Sampler::new(&prompt, request.params.clone(), u32::MAX, usize::MAX)?;
    let t = sampler.tokens().len();
    let depth = if mode.cache.is_bicache() {
        mode.depth.min(n_layers)
    } else {
        n_layers
    };
    let (full_row, qkv_row) = row_flops(cfg, t);
    let (mut passes, mut verified, mut flops, mut steps) = (0usize, 0usize, 0.0f64, 0usize);
    let mut last_block = None;
    while !sampler.is_done() {
        let block_start = last_block != Some(sampler.block_index());
        last_block = Some(sampler.block_index());
        let step = plan_mode(&SeqState {
            mode: mode.cache,
            seq_len: t,
            prefix_len: request.prefix_tokens,
            block: sampler.block(),
            block_start,
            several_blocks: sampler.num_blocks() > 1,
            steps_done: steps,
            refresh_every: 16,
            recompute_all: false,
            span: None,
            anchors: &[],
            response_start: request.prompt_tokens,
            adaptive: mode.adaptive,
        });
        let n = step.token_layer_passes(depth, n_layers, request.prefix_tokens);
        let v = step
            .adaptive
            .as_ref()
            .map_or(0, |a| a.verified_rows() * n_layers);
        passes += n;
        verified += v;
        flops += n as f64 * full_row + v as f64 * qkv_row;
        // Every prediction is a token with a confidence falling along the canvas, so the
        // quota commits the first masked positions: the schedule, not the text, matters.
        let rows = sampler.rows_to_predict();
        let predictions: Vec<(u32, f32)> = rows
            .iter()
            .map(|&p| (2, 1.0 - p as f32 / (t as f32 + 1.0)))
            .collect();
        sampler.commit(&predictions)?;
        steps += 1;
    }
    let a = mode.adaptive;
    Ok(json!({
        "part": "work",
        "cache": mode.cache.name(),
        "depth": mode.cache.is_bicache().then_some(depth),
        "dllm_cache": mode.cache.is_adaptive().then(|| json!({
            "prompt_interval": a.prompt_interval,
            "response_interval": a.response_interval,
            "refresh_ratio": a.refresh_ratio.to_string().parse::<f64>().ok(),
            "pin_block": a.pin_block,
        })),
        "prompt_tokens": request.prompt_tokens,
        "gen_length": request.params.gen_length,
        "steps": steps,
        "block_length": request.params.block_length,
        "layers": n_layers,
        "token_layer_passes": passes,
        "token_layer_passes_per_step": passes as f64 / steps.max(1) as f64,
        "verified_row_layers": verified,
        "gflop": flops / 1e9,
        "gflop_per_step": flops / 1e9 / steps.max(1) as f64,
    }))
}

/// Each record of `records` with its FLOPs against those of the `none` and
/// `fast-dllm-dual` records among them (`flops_vs_none` = none's FLOPs / the mode's: how
/// many times less work).
pub fn with_ratios(mut records: Vec<Value>) -> Vec<Value> {
    let of = |records: &[Value], name: &str| {
        records
            .iter()
            .find(|r| r["cache"] == name)
            .and_then(|r| r["gflop"].as_f64())
    };
    let none = of(&records, "none");
    let dual = of(&records, "fast-dllm-dual");
    for r in &mut records {
        let mine = r["gflop"].as_f64().unwrap_or(f64::NAN);
        r["less_work_than_none"] = json!(none.map(|n| n / mine));
        r["less_work_than_fast_dllm_dual"] = json!(dual.map(|d| d / mine));
    }
    records
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llada_8b() -> ModelConfig {
        ModelConfig::preset("llada-8b").expect("the preset")
    }

    #[test]
    fn counts_follow_the_schedules() {
        let cfg = llada_8b();
        let request = WorkRequest {
            prompt_tokens: 16,
            prefix_tokens: 12,
            params: GenerationParams {
                gen_length: 16,
                steps: 8,
                block_length: 4,
                ..GenerationParams::default()
            },
        };
        let work = |cache, adaptive| {
            let mode = WorkMode {
                cache,
                depth: 1,
                adaptive,
            };
            request_work(&cfg, &request, mode).unwrap()
        };
        let none = work(CacheMode::None, AdaptiveRefresh::default());
        assert_eq!(none["steps"], 8);
        assert_eq!(none["token_layer_passes"], 8 * 32 * 32);
        // Dual cache: per block, one full pass and one pass over the block.
        let dual = work(CacheMode::FastDllmDual, AdaptiveRefresh::default());
        assert_eq!(dual["token_layer_passes"], 4 * (32 + 4) * 32);
        // dLLM-Cache: the first forward in full, then the block and ⌊0.25 · 16⌋ others,
        // with a response refresh at forward 8 (K_r = 7).
        let dllm = work(CacheMode::DllmCache, AdaptiveRefresh::default());
        assert_eq!(dllm["token_layer_passes"], (32 + 6 * (4 + 4) + 16) * 32);
        assert_eq!(dllm["verified_row_layers"], 6 * 16 * 32);
        let rated = with_ratios(vec![none, dual, dllm]);
        let less = rated[2]["less_work_than_none"].as_f64().unwrap();
        assert!(less > 2.0 && less < 256.0 / 96.0, "{less}");
        assert_eq!(rated[0]["less_work_than_none"], 1.0);
    }
}
