//! The page's JSON for a DiffusionGemma model: its requests (a prompt and the few settings
//! the family has), its step events (shaped like the masked-diffusion ones, so the page
//! draws both the same way) and its results. Plain `serde_json`, tested natively.

use serde_json::{Value, json};
use unmask::{DgemmaEngine, DgemmaOutput, DgemmaRequest, Stopwatch};
use unmask_core::tokenizer::{DecodeMode, Tokenizer};
use unmask_gpu::dgemma::{PrefixUse, StepReport};

use crate::mapping::{self, Limits, MAX_SAFE_INTEGER, piece};

/// The request keys the family reads; any other is refused by name (a LLaDA setting such as
/// `cache` or `blockLength` would otherwise be silently ignored).
const KEYS: [&str; 9] = [
    "system",
    "prompt",
    "messages",
    "ids",
    "genLength",
    "steps",
    "seed",
    "shareSystem",
    "logitBias",
];

/// Most denoising steps per canvas a page may ask for.
const MOST_STEPS: usize = 4096;

pub fn limits(engine: &DgemmaEngine) -> Limits {
    let c = engine.config();
    Limits {
        context: engine.model().max_positions,
        vocab: c.vocab_size,
        layers: c.layers.len(),
    }
}

/// A page's request, every number checked: `genLength` (answer tokens, whole canvases are
/// generated), `steps` (most denoising steps per canvas), `seed`, `shareSystem`,
/// `logitBias` (`{"42": -100}`, as the server takes it).
pub fn request(obj: &Value, limits: &Limits) -> Result<DgemmaRequest, String> {
    if let Some(map) = obj.as_object()
        && let Some(key) = map.keys().find(|k| !KEYS.contains(&k.as_str()))
    {
        return Err(format!(
            "{key}: not a DiffusionGemma setting (it takes {})",
            KEYS.join(", ")
        ));
    }
    let prompt = mapping::prompt(obj, limits)?;
    let most = limits.context.saturating_sub(1).max(1);
    let why = format!(" (the model's {} positions)", limits.context);
    let seed = mapping::whole_in(obj, "seed", 0..=MAX_SAFE_INTEGER, "")?.unwrap_or(0);
    Ok(DgemmaRequest {
        seed,
        max_new_tokens: mapping::count_in(obj, "genLength", 1..=most, &why)?,
        max_denoising_steps: mapping::count_in(obj, "steps", 1..=MOST_STEPS, "")?,
        share_system: mapping::flag(obj, "shareSystem")?.unwrap_or(true),
        logit_bias: logit_bias(obj, limits)?,
        ..DgemmaRequest::new(prompt)
    })
}

/// `logitBias` by the rules the server and the masked-diffusion requests share.
fn logit_bias(obj: &Value, limits: &Limits) -> Result<Vec<(u32, f32)>, String> {
    let Some(v) = obj.get("logitBias") else {
        return Ok(Vec::new());
    };
    let map: std::collections::BTreeMap<String, f64> = serde_json::from_value(v.clone())
        .map_err(|_| format!("logitBias: expected an object of token ids to numbers, found {v}"))?;
    unmask::logit_bias_ids(&map, limits.vocab)
        .map_err(|e| format!("logitBias: expected {}, found {}", e.expected, e.found))
}

/// Whether the prompt and the canvases `genLength` asks for fit the model's positions.
pub fn fit_prompt(
    r: &DgemmaRequest,
    prompt_len: usize,
    engine: &DgemmaEngine,
) -> Result<(), String> {
    let canvas = engine.config().canvas_length;
    let tokens = r.max_new_tokens.unwrap_or(engine.params().max_new_tokens);
    let positions = prompt_len + tokens.div_ceil(canvas) * canvas;
    let most = engine.model().max_positions;
    if positions > most {
        return Err(format!(
            "genLength: {tokens} tokens take {} canvases of {canvas} after a prompt of \
             {prompt_len} tokens: {positions} positions, the model has {most}",
            tokens.div_ceil(canvas)
        ));
    }
    Ok(())
}

/// Turns the generation's step reports into page events.
pub struct StepTracker {
    /// The outputs of the canvases already finished.
    done: Vec<u32>,
    /// The last argmax canvas seen, and which canvas it belongs to.
    current: (usize, Vec<u32>),
    steps: usize,
    clock: Stopwatch,
}

impl Default for StepTracker {
    fn default() -> Self {
        Self::new()
    }
}

impl StepTracker {
    pub fn new() -> Self {
        Self {
            done: Vec::new(),
            current: (0, Vec::new()),
            steps: 0,
            clock: Stopwatch::start(),
        }
    }

    /// The event: the current canvas's argmax (`canvas`), its accepted positions as
    /// `committed` with their text in `pieces` (null elsewhere), the others as `masked`
    /// with the guess in `predicted`, `confidence` as `exp(-entropy)` per position, and
    /// `text` (every finished canvas, then this argmax).
    pub fn event(&mut self, r: &StepReport<'_>, tokenizer: Option<&Tokenizer>) -> Value {
        if r.canvas != self.current.0 {
            let finished = std::mem::take(&mut self.current.1);
            self.done.extend(finished);
        }
        self.current = (r.canvas, r.step.argmax.clone());
        self.steps += 1;
        let argmax = &r.step.argmax;
        let accepted: Vec<bool> = (0..argmax.len())
            .map(|i| r.step.accepted.binary_search(&i).is_ok())
            .collect();
        let text_of = |t: u32| Value::String(piece(tokenizer, t));
        let pieces: Vec<Value> = argmax
            .iter()
            .zip(&accepted)
            .map(|(&t, &a)| if a { text_of(t) } else { Value::Null })
            .collect();
        let predicted: Vec<Value> = argmax
            .iter()
            .zip(&accepted)
            .map(|(&t, &a)| if a { Value::Null } else { text_of(t) })
            .collect();
        let masked: Vec<usize> = (0..argmax.len()).filter(|&i| !accepted[i]).collect();
        let committed: Vec<[u32; 2]> = r
            .step
            .accepted
            .iter()
            .map(|&i| [i as u32, argmax[i]])
            .collect();
        let confidence: Vec<f32> = r.entropies.iter().map(|e| (-e).exp()).collect();
        let mut so_far = self.done.clone();
        so_far.extend_from_slice(argmax);
        let text = tokenizer
            .and_then(|t| t.decode(&so_far, DecodeMode::Clean).ok())
            .unwrap_or_default();
        json!({
            "family": "diffusion_gemma",
            "step": self.steps,
            "canvasIndex": r.canvas,
            "temperature": r.step.temperature,
            "meanEntropy": r.step.mean_entropy,
            "stable": r.step.stable,
            "stop": r.step.stop,
            "elapsed": self.clock.elapsed_s(),
            "canvas": argmax,
            "masked": masked,
            "committed": committed,
            "infilled": [],
            "confidence": confidence,
            "predicted": predicted,
            "pieces": pieces,
            "text": text,
        })
    }
}

fn prefix_json(p: &Option<PrefixUse>) -> Value {
    match p {
        None => Value::Null,
        Some(PrefixUse::Hit { reused }) => json!({"use": "hit", "tokens": reused}),
        Some(PrefixUse::Stored { tokens }) => json!({"use": "stored", "tokens": tokens}),
        Some(PrefixUse::Uncached) => json!({"use": "uncached", "tokens": 0}),
    }
}

/// A finished generation: ids, text, each canvas's steps, what the prefix store did, the
/// time and the rates.
pub fn generation(engine: &DgemmaEngine, out: &DgemmaOutput) -> Value {
    let steps: usize = out.canvases.iter().map(|c| c.steps.len()).sum();
    let canvas = engine.config().canvas_length;
    let positions = out.canvases.len() * canvas;
    let rate = |n: usize| n as f64 / out.seconds.max(1e-9);
    json!({
        "family": "diffusion_gemma",
        "ids": out.ids,
        "text": out.text.clone().unwrap_or_default(),
        "promptTokens": out.prompt_ids.len(),
        "canvases": out.canvases.iter().map(|c| json!({
            "steps": c.steps.len(),
            "stoppedEarly": c.steps.last().is_some_and(|s| s.stop),
            "acceptedPerStep": c.steps.iter().map(|s| s.accepted.len()).collect::<Vec<_>>(),
            "output": c.output,
            // Each output token's log-probability under the untempered softmax.
            "logprobs": c.logprobs,
        })).collect::<Vec<_>>(),
        "prefix": prefix_json(&out.prefix),
        "store": store_stats(engine),
        "timings": {
            "total_s": out.seconds,
            "steps": steps,
            "forward_passes": steps,
            "throughput_canvas": rate(positions),
            "throughput_answer": rate(out.ids.len()),
        },
    })
}

/// The prefix store's counters.
pub fn store_stats(engine: &DgemmaEngine) -> Value {
    let s = engine.prefix_stats();
    json!({"entries": s.entries, "tokens": s.tokens, "hits": s.hits, "misses": s.misses})
}

/// What was loaded and on which adapter; `family` tells the page which settings apply.
pub fn engine_info(engine: &DgemmaEngine) -> Value {
    let c = engine.config();
    let ctx = engine.ctx();
    let (total, active) = c.parameter_counts();
    let mut info = mapping::adapter_info(ctx);
    info.extend(mapping::json_object(json!({
        "family": "diffusion_gemma",
        "layers": c.layers.len(),
        "dModel": c.hidden_size,
        "vocab": c.vocab_size,
        "experts": c.num_experts,
        "topKExperts": c.top_k_experts,
        "canvasLength": c.canvas_length,
        "maxSequenceLength": engine.model().max_positions,
        "parameters": total,
        "activeParameters": active,
        "weights": engine.weight_format().name(),
        "weightBytes": engine.weight_bytes(),
        "hasTokenizer": engine.tokenizer().is_some(),
        "hasDepthTable": false,
        "loadSeconds": engine.load_s(),
        "genLength": engine.params().max_new_tokens,
        "steps": engine.params().max_denoising_steps,
    })));
    Value::Object(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        context: 1024,
        vocab: 1000,
        layers: 4,
    };

    #[test]
    fn requests_read_the_family_settings_and_refuse_others_by_name() {
        let r = request(
            &json!({"prompt": "Hi", "system": "Be brief.", "genLength": 40, "steps": 12, "seed": 9}),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(
            (r.max_new_tokens, r.max_denoising_steps, r.seed),
            (Some(40), Some(12), 9)
        );
        assert!(r.share_system);
        let e = request(&json!({"prompt": "Hi", "cache": "bicache"}), &LIMITS).unwrap_err();
        assert!(e.starts_with("cache: not a DiffusionGemma setting"), "{e}");
        let e = request(&json!({"prompt": "Hi", "genLength": 1.5}), &LIMITS).unwrap_err();
        assert!(
            e.starts_with("genLength: expected a whole number from 1 to 1023"),
            "{e}"
        );
        let e = request(&json!({"prompt": "Hi", "steps": 0}), &LIMITS).unwrap_err();
        assert!(
            e.starts_with("steps: expected a whole number from 1 to 4096"),
            "{e}"
        );
        let e = request(&json!({"ids": [1, 1000]}), &LIMITS).unwrap_err();
        assert!(
            e.starts_with("ids[1]: expected a token id from 0 to 999"),
            "{e}"
        );
        let e = request(&json!({"seed": -1, "prompt": "x"}), &LIMITS).unwrap_err();
        assert!(e.starts_with("seed: expected a whole number"), "{e}");
        let e = request(&json!({"shareSystem": "yes", "prompt": "x"}), &LIMITS).unwrap_err();
        assert!(e.starts_with("shareSystem: expected true or false"), "{e}");
        let r = request(&json!({"ids": [1], "logitBias": {"7": -100}}), &LIMITS).unwrap();
        assert_eq!(r.logit_bias, vec![(7, -100.0)]);
        let e = request(&json!({"ids": [1], "logitBias": {"1000": 1}}), &LIMITS).unwrap_err();
        assert!(e.contains("vocabulary size 1000"), "{e}");
        let e = request(&json!({"ids": [1], "logitBias": [1]}), &LIMITS).unwrap_err();
        assert!(e.starts_with("logitBias: expected an object"), "{e}");
    }
}
