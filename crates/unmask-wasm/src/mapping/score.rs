//! The page's `score` request and answer: a prompt as `generate` takes it (`{system,
//! prompt}`, `{messages}` or `{ids}`; `ids: []` is no prompt, the text's own likelihood),
//! `answers` (texts, tokenized as they are, or arrays of token ids), `rolling` (an answer
//! of any length, scored in windows of the context and summed: perplexity over a document)
//! and the estimate's settings `mcNum`, `mcBatch`, `cfgScale`, `seed`, `passSamples`. Every
//! other field is refused by name: a generation setting here would mean nothing.

use serde_json::{Value, json};
use unmask::{Likelihood, LikelihoodParams, Prompt};
use unmask_core::likelihood::{DEFAULT_MC_BATCH, DEFAULT_MC_NUM};

use super::{Limits, MAX_SAFE_INTEGER, count_in, field, prompt, token_ids, whole_in};

/// Most answers one request scores.
pub const MOST_ANSWERS: usize = 64;

/// Most Monte Carlo samples per answer.
pub const MOST_MC_NUM: usize = 4096;

/// Most tokens a rolling answer may have (windows of the context each).
pub const MOST_ROLLING_TOKENS: usize = 1 << 20;

const FIELDS: [&str; 11] = [
    "ids",
    "messages",
    "system",
    "prompt",
    "answers",
    "mcNum",
    "mcBatch",
    "cfgScale",
    "seed",
    "passSamples",
    "rolling",
];

/// One answer as the page gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum AnswerInput {
    Text(String),
    Ids(Vec<u32>),
}

/// A checked `score` request.
#[derive(Clone, Debug)]
pub struct ScoreRequest {
    pub prompt: Prompt,
    pub answers: Vec<AnswerInput>,
    pub params: LikelihoodParams,
    /// Each answer scored in windows of the context (`Engine::log_likelihood_rolling`).
    pub rolling: bool,
}

pub fn score_request(obj: &Value, limits: &Limits) -> Result<ScoreRequest, String> {
    let Some(map) = obj.as_object() else {
        return Err(format!("a score request must be an object, found {obj}"));
    };
    if let Some(k) = map.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(format!(
            "{k}: not a field of a score request (expected {})",
            FIELDS.join(", ")
        ));
    }
    let rolling = super::flag(obj, "rolling")?.unwrap_or(false);
    // No prompt: the answer's own likelihood (the engine names the models and settings
    // where that is undefined).
    let prompt = match obj.get("ids").and_then(Value::as_array) {
        Some(ids) if ids.is_empty() => Prompt::Ids(Vec::new()),
        _ => prompt(obj, limits)?,
    };
    // A rolling answer is windowed, so the context does not bound it.
    let answer_limits = if rolling {
        Limits {
            context: MOST_ROLLING_TOKENS + 1,
            ..*limits
        }
    } else {
        *limits
    };
    let list = match obj.get("answers") {
        Some(Value::Array(list)) => list,
        None | Some(Value::Null) => return Err("answers: a score request needs them".into()),
        Some(other) => {
            return Err(format!(
                "answers: expected an array of texts or token id arrays, found {other}"
            ));
        }
    };
    if list.is_empty() || list.len() > MOST_ANSWERS {
        return Err(format!(
            "answers: expected 1 to {MOST_ANSWERS} answers, found {}",
            list.len()
        ));
    }
    let mut answers = Vec::with_capacity(list.len());
    for (i, a) in list.iter().enumerate() {
        let name = format!("answers[{i}]");
        answers.push(match a {
            Value::String(t) if t.is_empty() => {
                return Err(format!("{name}: expected a non-empty text, found \"\""));
            }
            Value::String(t) => AnswerInput::Text(t.clone()),
            Value::Array(_) => AnswerInput::Ids(token_ids(&name, a, &answer_limits)?),
            other => {
                return Err(format!(
                    "{name}: expected a text or an array of token ids, found {other}"
                ));
            }
        });
    }
    let mc_num = count_in(obj, "mcNum", 1..=MOST_MC_NUM, "")?.unwrap_or(DEFAULT_MC_NUM);
    let batch =
        count_in(obj, "mcBatch", 1..=MOST_MC_NUM, "")?.unwrap_or(DEFAULT_MC_BATCH.min(mc_num));
    let cfg_scale = field(obj, "cfgScale", "a number >= 0", |v| {
        v.as_f64().filter(|w| *w >= 0.0 && *w <= f32::MAX as f64)
    })?
    .unwrap_or(0.0);
    let seed = whole_in(
        obj,
        "seed",
        0..=MAX_SAFE_INTEGER,
        " (exact in a JavaScript number)",
    )?
    .unwrap_or(0);
    let pass_samples = count_in(obj, "passSamples", 1..=MOST_MC_NUM, "")?;
    let params = LikelihoodParams {
        mc_num,
        batch,
        cfg_scale: cfg_scale as f32,
        seed,
        pass_samples,
    };
    params.check().map_err(|e| {
        let name = match e.field {
            "mc_num" => "mcNum",
            "mc_batch" => "mcBatch",
            "pass_samples" => "passSamples",
            _ => "cfgScale",
        };
        format!("{name}: expected {}, found {}", e.expected, e.found)
    })?;
    Ok(ScoreRequest {
        prompt,
        answers,
        params,
        rolling,
    })
}

/// The answer: each estimate in the order given, and the index of the best.
pub fn scores(prompt_tokens: usize, estimates: &[Likelihood]) -> Value {
    let answers: Vec<Value> = estimates
        .iter()
        .enumerate()
        .map(|(index, l)| {
            json!({
                "index": index,
                "logLikelihood": l.log_likelihood,
                "standardError": l.standard_error,
                "tokens": l.answer_tokens,
                "windows": l.windows,
                "perToken": l.log_likelihood / l.answer_tokens.max(1) as f64,
                "forwardPasses": l.forward_passes,
                "totalS": l.total_s,
            })
        })
        .collect();
    json!({
        "promptTokens": prompt_tokens,
        "answers": answers,
        "best": unmask::best_estimate(estimates),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        context: 64,
        vocab: 100,
        layers: 4,
    };

    fn refused(v: Value) -> String {
        score_request(&v, &LIMITS).unwrap_err()
    }

    #[test]
    fn defaults_answers_and_refusals() {
        let r = score_request(
            &json!({"system": "s", "prompt": "q", "answers": [" a", [1, 2]]}),
            &LIMITS,
        )
        .unwrap();
        assert!(matches!(r.prompt, Prompt::Chat(ref m) if m.len() == 2));
        assert_eq!(
            r.answers,
            [AnswerInput::Text(" a".into()), AnswerInput::Ids(vec![1, 2])]
        );
        assert_eq!((r.params.mc_num, r.params.batch), (128, 16));
        assert_eq!((r.params.seed, r.params.pass_samples), (0, None));
        let r = score_request(
            &json!({"ids": [5], "answers": [[1]], "mcNum": 8, "seed": 3, "passSamples": 2,
                    "cfgScale": 0.5}),
            &LIMITS,
        )
        .unwrap();
        assert_eq!((r.params.mc_num, r.params.batch, r.params.seed), (8, 8, 3));
        assert_eq!((r.params.pass_samples, r.params.cfg_scale), (Some(2), 0.5));
        let ok = |extra: Value| {
            let mut v = json!({"ids": [5], "answers": [[1]]});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            v
        };
        assert!(refused(json!([1])).starts_with("a score request must be an object"));
        assert!(refused(ok(json!({"steps": 4}))).starts_with("steps: not a field"));
        assert!(refused(json!({"ids": [5]})).starts_with("answers: a score request needs"));
        assert!(refused(ok(json!({"answers": "a"}))).starts_with("answers: expected an array"));
        assert!(refused(ok(json!({"answers": [[1], [100]]}))).starts_with("answers[1][0]: "));
        assert!(refused(ok(json!({"answers": [7]}))).starts_with("answers[0]: expected a text"));
        assert!(refused(ok(json!({"mcNum": 0}))).starts_with("mcNum: expected a whole number"));
        assert!(refused(ok(json!({"mcNum": 5000}))).starts_with("mcNum: expected a whole"));
        assert!(refused(ok(json!({"mcNum": 24}))).starts_with("mcNum: expected a positive"));
        assert!(refused(ok(json!({"cfgScale": -1}))).starts_with("cfgScale: expected a number"));
        assert!(refused(ok(json!({"seed": 1.5}))).starts_with("seed: expected a whole number"));
        assert!(refused(ok(json!({"passSamples": 0}))).starts_with("passSamples: expected"));
        // No prompt, and a rolling answer past the context.
        let long: Vec<u32> = (0..200).map(|i| i % 100).collect();
        let r = score_request(
            &json!({"ids": [], "answers": [long], "rolling": true}),
            &LIMITS,
        )
        .unwrap();
        assert!(r.rolling && matches!(r.prompt, Prompt::Ids(ref p) if p.is_empty()));
        assert!(
            refused(json!({"ids": [], "answers": [long]})).starts_with("answers[0]: expected 1 to")
        );
        assert!(refused(ok(json!({"rolling": 1}))).starts_with("rolling: expected true or false"));
    }

    #[test]
    fn the_best_is_the_first_of_the_highest() {
        let l = |v: f64| Likelihood {
            log_likelihood: v,
            sample_losses: vec![-v],
            standard_error: 0.0,
            answer_tokens: 2,
            sequences: 1,
            forward_passes: 1,
            pass_samples: 1,
            total_s: 0.0,
            windows: 1,
        };
        let out = scores(7, &[l(-3.0), l(-1.0), l(-1.0)]);
        assert_eq!(out["best"], 1);
        assert_eq!(out["answers"][2]["perToken"], -0.5);
        assert_eq!(out["promptTokens"], 7);
        assert_eq!(scores(7, &[])["best"], Value::Null);
    }
}
