//! `POST /v1/loglikelihood` (this server's own endpoint): the log-likelihood of one or more
//! continuations after a prompt, by LLaDA's Monte Carlo estimate, as `unmask score` gives
//! it. A harness scores multiple choice with it; OpenAI's `echo` + `logprobs` route does not
//! fit a masked model, whose estimate needs the prompt/continuation split.

use serde::Deserialize;
use unmask::LikelihoodParams;
use unmask_core::likelihood::{DEFAULT_MC_BATCH, DEFAULT_MC_NUM};

use super::{
    ChatMessage, CompletionPrompt, Family, Input, JobSpec, Limits, Sampling, chat_messages,
    served_model,
};
use crate::error::ApiError;
use crate::fields::{object, typed, whole};

/// Most continuations one request may score.
pub const MOST_CONTINUATIONS: usize = 64;

/// Most Monte Carlo samples per continuation (the reference's default is 128).
pub const MOST_MC_NUM: usize = 4096;

/// A continuation: text (tokenized as it is) or token ids.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Continuation {
    Text(String),
    Ids(Vec<u32>),
}

/// A scoring job's continuations (ids once encoded) and the estimate's settings.
#[derive(Clone, Debug)]
pub struct ScoreSpec {
    pub continuations: Vec<Continuation>,
    pub params: LikelihoodParams,
    /// Also whether greedy decoding of a canvas of the continuation's length gives the
    /// continuation (lm-eval's `is_greedy`).
    pub greedy: bool,
    /// A continuation too long for one sequence after the prompt is scored in windows
    /// (`Engine::rolling_windows`) and their estimates summed: perplexity over long
    /// documents.
    pub rolling: bool,
}

#[derive(Debug, Deserialize)]
struct ScoreFields {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<CompletionPrompt>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    continuations: Option<Vec<Continuation>>,
    #[serde(default)]
    continuation: Option<Continuation>,
    #[serde(default)]
    mc_num: Option<u64>,
    #[serde(default)]
    mc_batch: Option<u64>,
    #[serde(default)]
    pass_samples: Option<u64>,
    #[serde(default)]
    cfg_scale: Option<f64>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    greedy: Option<bool>,
    #[serde(default)]
    rolling: Option<bool>,
}

/// A checked scoring request: the job the scheduler runs.
pub fn check_score(body: &[u8], limits: &Limits, served: &str) -> Result<JobSpec, ApiError> {
    let f: ScoreFields = typed(object(body)?, "")?;
    if limits.family == Family::DiffusionGemma {
        return Err(ApiError::unnamed(
            "/v1/loglikelihood: DiffusionGemma's decoder denoises whole canvases with \
             self-conditioning; the masked-token estimate is defined for LLaDA and Dream models",
        ));
    }
    served_model(f.model.as_deref(), served)?;
    let input = match (f.prompt, f.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "messages: give a prompt (text or ids) or chat messages, not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "prompt: this field is required (or messages, for a chat prompt ending with the \
                 assistant's turn)",
            ));
        }
        (None, Some(messages)) => Input::Chat(chat_messages(messages)?),
        (Some(CompletionPrompt::Text(t)), None) => Input::Text(t),
        (Some(CompletionPrompt::Ids(ids)), None) => Input::Ids(ids),
        (Some(CompletionPrompt::Texts(mut v)), None) if v.len() == 1 => Input::Text(v.remove(0)),
        // `[]` reads as a list of no texts; it is the empty list of ids.
        (Some(CompletionPrompt::Texts(v)), None) if v.is_empty() => Input::Ids(Vec::new()),
        (Some(CompletionPrompt::Texts(v)), None) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("prompt: expected one prompt, found {}", v.len()),
            ));
        }
    };
    // An empty prompt scores a continuation unconditionally; the engine refuses it by name
    // where that is not defined (Dream, guidance).
    let continuations = match (f.continuations, f.continuation) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "continuation",
                "continuation: give continuation (one) or continuations (a list), not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "continuations",
                "continuations: this field is required (or continuation, for one)",
            ));
        }
        (Some(list), None) => list,
        (None, Some(one)) => vec![one],
    };
    if continuations.is_empty() || continuations.len() > MOST_CONTINUATIONS {
        return Err(ApiError::invalid(
            "continuations",
            format!(
                "continuations: expected 1 to {MOST_CONTINUATIONS} continuations, found {}",
                continuations.len()
            ),
        ));
    }
    if let Some(i) = continuations.iter().position(|c| match c {
        Continuation::Text(t) => t.is_empty(),
        Continuation::Ids(ids) => ids.is_empty(),
    }) {
        return Err(ApiError::invalid(
            format!("continuations[{i}]"),
            format!("continuations[{i}]: expected at least one token, found an empty one"),
        ));
    }
    let mc_num = whole("mc_num", f.mc_num)?.unwrap_or(DEFAULT_MC_NUM);
    if mc_num > MOST_MC_NUM {
        return Err(ApiError::invalid(
            "mc_num",
            format!("mc_num: expected at most {MOST_MC_NUM}, found {mc_num}"),
        ));
    }
    let batch = whole("mc_batch", f.mc_batch)?.unwrap_or(DEFAULT_MC_BATCH.min(mc_num));
    let cfg_scale = f.cfg_scale.unwrap_or(0.0);
    let params = LikelihoodParams {
        mc_num,
        batch,
        cfg_scale: cfg_scale as f32,
        seed: f.seed.unwrap_or(0),
        pass_samples: whole("pass_samples", f.pass_samples)?,
    };
    // A weight past f32's range becomes infinite here, which the check refuses.
    params
        .check()
        .map_err(|e| ApiError::invalid(e.field, e.to_string()))?;
    let (greedy, rolling) = (f.greedy.unwrap_or(false), f.rolling.unwrap_or(false));
    if greedy && rolling {
        return Err(ApiError::invalid(
            "greedy",
            "greedy: expected false with rolling (is_greedy decodes one canvas of the \
             continuation's length, which rolling windows split)",
        ));
    }
    Ok(JobSpec {
        input,
        sampling: Sampling::Score(Box::new(ScoreSpec {
            continuations,
            params,
            greedy,
            rolling,
        })),
        stop: Vec::new(),
        stream: false,
        include_usage: false,
        include_canvas: false,
        logprobs: None,
        choices: 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use unmask::CacheMode;

    fn limits(family: Family) -> Limits {
        Limits {
            max_tokens: 256,
            default_max_tokens: 64,
            default_cache: CacheMode::None,
            family,
        }
    }

    fn check(body: &str) -> Result<(Input, ScoreSpec), ApiError> {
        let spec = check_score(body.as_bytes(), &limits(Family::MaskedDiffusion), "tiny")?;
        match spec.sampling {
            Sampling::Score(s) => Ok((spec.input, *s)),
            other => panic!("a scoring job, found {other:?}"),
        }
    }

    fn refused(body: &str) -> String {
        check(body).unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn defaults_shapes_and_refusals() {
        let (input, s) = check(r#"{"prompt": "q", "continuation": " a"}"#).unwrap();
        assert_eq!(input, Input::Text("q".into()));
        assert_eq!(s.continuations, [Continuation::Text(" a".into())]);
        assert_eq!((s.params.mc_num, s.params.batch), (128, 16));
        assert_eq!((s.params.seed, s.params.pass_samples), (0, None));
        assert!(!s.greedy);
        // Fewer samples than a batch: one batch of them.
        let (_, s) =
            check(r#"{"prompt": [1], "continuations": [[2], "b"], "mc_num": 8, "greedy": true}"#)
                .unwrap();
        assert!(s.greedy);
        assert_eq!((s.params.mc_num, s.params.batch), (8, 8));
        assert_eq!(s.continuations.len(), 2);
        let (input, _) =
            check(r#"{"messages": [{"role": "user", "content": "q"}], "continuation": "a"}"#)
                .unwrap();
        assert!(matches!(input, Input::Chat(m) if m.len() == 1));
        assert_eq!(
            refused(r#"{"prompt": ["a", "b"], "continuation": "a"}"#),
            "prompt"
        );
        // An empty prompt, for an unconditional estimate, and rolling windows.
        let (input, s) = check(r#"{"prompt": "", "continuation": "a", "rolling": true}"#).unwrap();
        assert_eq!(input, Input::Text(String::new()));
        assert!(s.rolling && !s.greedy);
        let (input, _) = check(r#"{"prompt": [], "continuation": [3]}"#).unwrap();
        assert_eq!(input, Input::Ids(Vec::new()));
        assert_eq!(
            refused(r#"{"prompt": "q", "continuation": "a", "rolling": true, "greedy": true}"#),
            "greedy"
        );
        assert_eq!(
            refused(r#"{"prompt": "q", "continuation": "a", "continuations": ["b"]}"#),
            "continuation"
        );
        assert_eq!(
            refused(r#"{"prompt": "q", "continuations": []}"#),
            "continuations"
        );
        assert_eq!(
            refused(r#"{"prompt": "q", "continuation": 3}"#),
            "continuation"
        );
        assert_eq!(
            refused(r#"{"prompt": "q", "continuation": "a", "mc_num": 8192}"#),
            "mc_num"
        );
        assert_eq!(
            refused(r#"{"prompt": "q", "continuation": "a", "mc_batch": 0}"#),
            "mc_batch"
        );
        assert_eq!(
            refused(r#"{"prompt": "q", "continuation": "a", "cfg_scale": -1}"#),
            "cfg_scale"
        );
        assert_eq!(
            refused(r#"{"messages": [{"role": "robot", "content": "q"}], "continuation": "a"}"#),
            "messages[0].role"
        );
        let gemma = check_score(
            br#"{"prompt": "q", "continuation": "a"}"#,
            &limits(Family::DiffusionGemma),
            "tiny",
        );
        assert!(gemma.unwrap_err().message.contains("DiffusionGemma"));
    }
}
