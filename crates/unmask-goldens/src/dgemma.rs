//! DiffusionGemma's recorded generations (tests/fixtures/tiny-dgemma/goldens/generate.json,
//! written with the transformers reference): each case's prompt, sampler settings and random
//! draws, and the check of a run against every step the reference took.

use serde_json::Value;
use unmask_core::sampler::entropy_bound::{EntropyBoundParams, EntropyBoundStep, ReplayedDraws};

use crate::ids;

/// Ids written as a JSON list, or as a string holding one (how the recorder writes tensors).
pub fn flat_ids(v: &Value) -> Vec<u32> {
    match v {
        Value::String(s) => ids(&serde_json::from_str(s).expect("ids in a string are JSON")),
        other => ids(other),
    }
}

fn number(v: &Value) -> f64 {
    match v {
        Value::String(s) => s.parse().expect("a number in a string"),
        other => other.as_f64().expect("a number"),
    }
}

fn truth(v: &Value) -> bool {
    match v {
        Value::String(s) => s == "True",
        other => other.as_bool().expect("a boolean"),
    }
}

/// One recorded generation.
pub struct GenerationCase {
    pub name: String,
    pub prompt: Vec<u32>,
    pub params: EntropyBoundParams,
    /// The reference's draws in the order it drew them.
    pub draws: ReplayedDraws,
    case: Value,
}

/// The cases of a goldens file, from its text.
pub fn generation_cases(text: &str) -> Vec<GenerationCase> {
    crate::cases(text)
        .into_iter()
        .map(|case| {
            let p = &case["params"];
            let size = |k: &str| p[k].as_u64().expect("a size") as usize;
            let params = EntropyBoundParams {
                max_new_tokens: size("max_new_tokens"),
                max_denoising_steps: size("max_denoising_steps"),
                entropy_bound: number(&p["entropy_bound"]) as f32,
                t_min: number(&p["t_min"]),
                t_max: number(&p["t_max"]),
                stability_threshold: size("stability_threshold"),
                confidence_threshold: number(&p["confidence_threshold"]) as f32,
                eos: ids(&p["eos_token_id"]),
                pad: p["pad_token_id"].as_u64().map(|x| x as u32),
            };
            let mut draws = ReplayedDraws::default();
            for c in case["canvases"].as_array().expect("canvases") {
                draws.uniform.push_back(flat_ids(&c["init"]));
                for s in c["steps"].as_array().expect("steps") {
                    draws.categorical.push_back(flat_ids(&s["sampled"]));
                    draws.uniform.push_back(flat_ids(&s["renoise"]));
                }
            }
            GenerationCase {
                name: case["name"].as_str().expect("a name").to_string(),
                prompt: flat_ids(&case["prompt"]),
                params,
                draws,
                case,
            }
        })
        .collect()
}

/// What a run gave, canvas by canvas: its steps and its output.
pub struct RunCanvas<'a> {
    pub steps: &'a [EntropyBoundStep],
    pub output: &'a [u32],
}

impl GenerationCase {
    /// Panics, naming the case, canvas and step, where the run differs from the reference:
    /// each step's temperature, accepted positions, argmax canvas, mean entropy (within
    /// 1e-4), stability and stop; each canvas's output; the whole sequence. Returns how many
    /// canvases stopped early.
    pub fn assert_run(&self, canvases: &[RunCanvas<'_>], sequence: &[u32]) -> usize {
        let name = &self.name;
        let want_canvases = self.case["canvases"].as_array().expect("canvases");
        assert_eq!(canvases.len(), want_canvases.len(), "{name}: canvases");
        let mut early_stops = 0;
        for (ci, (g, want)) in canvases.iter().zip(want_canvases).enumerate() {
            let steps = want["steps"].as_array().expect("steps");
            for (si, (gs, ws)) in g.steps.iter().zip(steps).enumerate() {
                let at = format!("{name} canvas {ci} step {si}");
                assert_eq!(gs.argmax, flat_ids(&ws["argmax"]), "{at}: argmax");
                let accepted: Vec<u32> = gs.accepted.iter().map(|&i| i as u32).collect();
                assert_eq!(accepted, flat_ids(&ws["accepted"]), "{at}: accepted");
                assert_eq!(
                    gs.temperature as f64,
                    number(&ws["temperature"]) as f32 as f64,
                    "{at}: temperature"
                );
                let entropy = number(&ws["mean_entropy"]);
                assert!(
                    (gs.mean_entropy as f64 - entropy).abs() < 1e-4,
                    "{at}: mean entropy {} vs {entropy}",
                    gs.mean_entropy
                );
                assert_eq!(gs.stable, truth(&ws["stable"]), "{at}: stable");
                assert_eq!(gs.stop, truth(&ws["stop"]), "{at}: stop");
            }
            assert_eq!(g.steps.len(), steps.len(), "{name} canvas {ci}: steps");
            early_stops += usize::from(g.steps.last().is_some_and(|s| s.stop));
            assert_eq!(
                g.output,
                flat_ids(&want["output"]),
                "{name} canvas {ci}: output"
            );
        }
        assert_eq!(
            sequence,
            flat_ids(&self.case["sequence"]),
            "{name}: sequence"
        );
        early_stops
    }
}
