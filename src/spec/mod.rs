//! One request spec: the generation settings a client sends, read the same way by the
//! library, the server (`unmask serve`) and the browser API, and checked once by one set
//! of rules that name the field at fault. Fields are snake_case (the browser API turns its
//! camelCase keys into them).

mod bias;

pub use bias::logit_bias_ids;

use std::collections::BTreeMap;

use serde::Deserialize;
use unmask_core::adaptive::VerifyPick;
use unmask_core::cache::CacheMode;
use unmask_core::sampler::{GenerationParams, Remasking, Schedule};
use unmask_core::tokenizer::DecodeMode;

use crate::Request;

/// The block length when a request names none: 32, or the whole canvas when 32 does not
/// divide it (as `unmask generate`).
pub const DEFAULT_BLOCK: usize = 32;

/// A request's settings as a client writes them, every one optional. Numbers are taken as
/// JSON gives them and checked in the type the runtime uses (`RequestSpec::check`).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct RequestSpec {
    pub gen_length: Option<u64>,
    pub steps: Option<u64>,
    pub block_length: Option<u64>,
    pub temperature: Option<f64>,
    /// LLaDA's `remasking` or Dream's `alg` names.
    #[serde(alias = "alg")]
    pub remasking: Option<String>,
    pub cfg_scale: Option<f64>,
    pub threshold: Option<f64>,
    pub logits_eos_inf: Option<bool>,
    pub confidence_eos_eot_inf: Option<bool>,
    pub seed: Option<u64>,
    pub round_confidence_bf16: Option<bool>,
    /// `llada` or `dream`; `eps` alone means `dream`.
    pub schedule: Option<String>,
    pub eps: Option<f64>,
    pub alg_temp: Option<f64>,
    pub top_p: Option<f64>,
    /// Absent: the model's default (Dream's reference cuts to 50); 0 or -1: no cut.
    pub top_k: Option<i64>,
    /// vLLM's `min_p` (0 to 1; 0: no cut).
    pub min_p: Option<f64>,
    pub cache: Option<String>,
    pub prefix_len: Option<u64>,
    pub depth: Option<u64>,
    pub refresh_every: Option<u64>,
    pub recompute_all: Option<bool>,
    /// Run every step of the canvas instead of ending when the answer is final.
    pub full_canvas: Option<bool>,
    /// `clean` (the default) or `raw`.
    pub decode: Option<String>,
    /// ACache: text of the prompt that other requests share (a document, a table), at any
    /// position; absent: a stored span found inside the prompt.
    pub affix: Option<String>,
    /// ACache: the share of the span recomputed with the request (0 to 1).
    pub anchor_ratio: Option<f64>,
    /// dLLM-Cache: forwards between full recomputes of the prompt (K_p, at least 1).
    pub prompt_interval: Option<u64>,
    /// dLLM-Cache: forwards between full recomputes of the response (K_r, at least 1).
    pub response_interval: Option<u64>,
    /// dLLM-Cache: the share of the response V-verify recomputes in between (ρ, 0 to 1).
    pub refresh_ratio: Option<f64>,
    /// dLLM-Cache: `lowest-cosine` (the rule) or `highest-cosine` (wrong on purpose).
    pub verify_pick: Option<String>,
    /// dLLM-Cache with several blocks: the current block computed at every forward.
    pub pin_block: Option<bool>,
    /// Each committed token's log-probability (`Request::logprobs`).
    pub logprobs: Option<bool>,
    /// That many most likely ids beside each (`Request::top_logprobs`, 0 to 20).
    pub top_logprobs: Option<u64>,
    /// OpenAI's `logit_bias`: token ids (as decimal strings) to a bias from -100 to 100.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// OpenAI's penalties (-2 to 2) on the tokens committed so far (`LogitBias`).
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// vLLM's multiplicative penalty (0.01 to 100; 1: none) on the tokens of the prompt and
    /// the canvas.
    pub repetition_penalty: Option<f64>,
}

/// What a spec is checked against: the loaded model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecLimits {
    /// Positions the model attends over, prompt and canvas together.
    pub context: usize,
    /// Transformer layers: the most BiCache's shallow depth can be.
    pub layers: usize,
    /// Vocabulary ids: `logit_bias` keys lie below (`usize::MAX`: checked when it runs).
    pub vocab: usize,
}

/// A field of a request outside its rules.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: expected {expected}, found {found}")]
pub struct SpecError {
    /// The field as this module spells it (snake_case).
    pub field: &'static str,
    pub expected: String,
    pub found: String,
}

/// A checked spec: what a `Request` takes besides its prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub params: GenerationParams,
    /// `None`: the caller's default mode.
    pub cache: Option<CacheMode>,
    pub prefix_len: Option<usize>,
    pub depth: Option<usize>,
    pub refresh_every: Option<usize>,
    pub recompute_all: bool,
    /// `None`: the caller's default.
    pub full_canvas: Option<bool>,
    pub decode: DecodeMode,
    pub affix: Option<String>,
    pub anchor_ratio: Option<f32>,
    /// dLLM-Cache's settings the spec names (the others keep the caller's defaults).
    pub adaptive: AdaptiveOverrides,
    pub logprobs: bool,
    pub top_logprobs: usize,
}

/// dLLM-Cache's settings a spec names; `None` keeps the caller's default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AdaptiveOverrides {
    pub prompt_interval: Option<usize>,
    pub response_interval: Option<usize>,
    pub refresh_ratio: Option<f32>,
    pub verify_pick: Option<VerifyPick>,
    pub pin_block: Option<bool>,
}

fn error(field: &'static str, expected: impl Into<String>, found: impl ToString) -> SpecError {
    SpecError {
        field,
        expected: expected.into(),
        found: found.to_string(),
    }
}

/// A number as a person would write it: 0.5, 1e-300 (not 300 zeros), 1e300.
pub fn number(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-4..1e6).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// An optional whole number in `range`, as a `usize`; never past 2^32 - 1, which a
/// 32-bit `usize` (the browser build's) holds too.
fn count(
    field: &'static str,
    value: Option<u64>,
    range: std::ops::RangeInclusive<usize>,
    why: &str,
) -> Result<Option<usize>, SpecError> {
    let Some(v) = value else { return Ok(None) };
    let range = *range.start()..=(*range.end()).min(u32::MAX as usize);
    match usize::try_from(v) {
        Ok(n) if range.contains(&n) => Ok(Some(n)),
        _ => Err(error(
            field,
            format!(
                "a whole number from {} to {}{why}",
                range.start(),
                range.end()
            ),
            v,
        )),
    }
}

/// An optional number checked as the f32 the sampler uses: a value in range as f64 that
/// rounds out of it (1e-300 becomes 0) is refused with what it becomes.
fn single(
    field: &'static str,
    value: Option<f64>,
    expected: &str,
    ok: impl Fn(f32) -> bool,
) -> Result<Option<f32>, SpecError> {
    let Some(v) = value else { return Ok(None) };
    let s = v as f32;
    if s.is_finite() && ok(s) {
        return Ok(Some(s));
    }
    let found = if v.is_finite() && s as f64 != v {
        format!(
            "{} (it is {s} in single precision, which the sampler uses)",
            number(v)
        )
    } else {
        number(v)
    };
    Err(error(field, expected, found))
}

impl RequestSpec {
    /// Applies every rule once: ranges (from the model's `limits` where they depend on it),
    /// divisibility of the canvas into blocks and steps, names of modes, schedules and
    /// remasking strategies. The first field at fault is named.
    pub fn check(&self, limits: &SpecLimits) -> Result<Settings, SpecError> {
        let d = GenerationParams::default();
        let most = limits.context.saturating_sub(1).max(1);
        let context = format!(
            " (the model's context of {} tokens, less at least one prompt token)",
            limits.context
        );
        let gen_length =
            count("gen_length", self.gen_length, 1..=most, &context)?.unwrap_or(d.gen_length);
        let steps =
            count("steps", self.steps, 1..=gen_length, " (gen_length)")?.unwrap_or(gen_length);
        let block_length = count(
            "block_length",
            self.block_length,
            1..=gen_length,
            " (gen_length)",
        )?
        .unwrap_or(if gen_length.is_multiple_of(DEFAULT_BLOCK) {
            DEFAULT_BLOCK
        } else {
            gen_length
        });
        if !gen_length.is_multiple_of(block_length) {
            return Err(error(
                "block_length",
                format!("a divisor of gen_length {gen_length}"),
                block_length,
            ));
        }
        let threshold = single("threshold", self.threshold, "a number in (0, 1]", |t| {
            t > 0.0 && t <= 1.0
        })?;
        let blocks = gen_length / block_length;
        // Threshold decoding takes as many steps as each block needs; `steps` is unused then.
        if threshold.is_none() && !steps.is_multiple_of(blocks) {
            return Err(error(
                "steps",
                format!(
                    "a multiple of the {blocks} blocks (gen_length {gen_length} / block_length \
                     {block_length})"
                ),
                steps,
            ));
        }
        let non_negative = "a finite number >= 0";
        let remasking = match self.remasking.as_deref() {
            None => d.remasking,
            Some(name) => Remasking::parse(name).ok_or_else(|| {
                error(
                    "remasking",
                    format!("one of {}", Remasking::NAMES.join(", ")),
                    format!("{name:?}"),
                )
            })?,
        };
        let eps = self.eps;
        let schedule = match (self.schedule.as_deref(), eps) {
            (_, Some(e)) if !(e > 0.0 && e < 1.0) => {
                return Err(error("eps", "a number in (0, 1)", number(e)));
            }
            (Some("llada"), None) => Schedule::Llada,
            (Some("dream"), eps) | (None, eps @ Some(_)) => Schedule::Dream {
                eps: eps.unwrap_or(1e-3),
            },
            (None, None) => d.schedule,
            (Some(other), _) => {
                return Err(error(
                    "schedule",
                    "\"llada\" or \"dream\" (eps only with dream)",
                    format!("{other:?}"),
                ));
            }
        };
        let top_k = match self.top_k {
            None => None,
            // No cut: a k past any vocabulary.
            Some(-1) | Some(0) => Some(u32::MAX),
            Some(k) if k >= 1 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
            Some(k) => {
                return Err(error("top_k", "a whole number >= 1 (or 0 / -1: no cut)", k));
            }
        };
        let params = GenerationParams {
            gen_length,
            steps,
            block_length,
            temperature: single("temperature", self.temperature, non_negative, |t| t >= 0.0)?
                .unwrap_or(d.temperature),
            remasking,
            cfg_scale: single("cfg_scale", self.cfg_scale, non_negative, |c| c >= 0.0)?
                .unwrap_or(d.cfg_scale),
            threshold,
            logits_eos_inf: self.logits_eos_inf.unwrap_or(d.logits_eos_inf),
            confidence_eos_eot_inf: self
                .confidence_eos_eot_inf
                .unwrap_or(d.confidence_eos_eot_inf),
            seed: self.seed.unwrap_or(d.seed),
            round_confidence_bf16: self
                .round_confidence_bf16
                .unwrap_or(d.round_confidence_bf16),
            schedule,
            alg_temp: single("alg_temp", self.alg_temp, non_negative, |t| t >= 0.0)?
                .unwrap_or(d.alg_temp),
            top_p: single("top_p", self.top_p, "a number in (0, 1]", |p| {
                p > 0.0 && p <= 1.0
            })?,
            top_k,
            min_p: single("min_p", self.min_p, "a number from 0 to 1", |p| {
                (0.0..=1.0).contains(&p)
            })?,
            bias: self.logit_bias(limits.vocab)?,
        };
        let cache = match self.cache.as_deref() {
            None => None,
            Some(name) => Some(name.parse::<CacheMode>().map_err(|_| {
                let names: Vec<&str> = CacheMode::ALL.iter().map(|m| m.name()).collect();
                error(
                    "cache",
                    format!("one of {}", names.join(", ")),
                    format!("{name:?}"),
                )
            })?),
        };
        let decode = match self.decode.as_deref() {
            None | Some("clean") => DecodeMode::Clean,
            Some("raw") => DecodeMode::Raw,
            Some(other) => {
                return Err(error(
                    "decode",
                    "\"clean\" or \"raw\"",
                    format!("{other:?}"),
                ));
            }
        };
        let layers = format!(" (the model's {} layers)", limits.layers);
        Ok(Settings {
            params,
            cache,
            prefix_len: count(
                "prefix_len",
                self.prefix_len,
                0..=most,
                " (the longest prompt the model's context leaves room for)",
            )?,
            depth: count("depth", self.depth, 0..=limits.layers, &layers)?,
            refresh_every: count(
                "refresh_every",
                self.refresh_every,
                1..=usize::MAX,
                " (steps)",
            )?,
            recompute_all: self.recompute_all.unwrap_or(false),
            full_canvas: self.full_canvas,
            logprobs: self.logprobs.unwrap_or(false),
            top_logprobs: count(
                "top_logprobs",
                self.top_logprobs,
                0..=crate::MOST_TOP_LOGPROBS,
                " (alternatives per token)",
            )?
            .unwrap_or(0),
            decode,
            affix: match self.affix.as_deref() {
                Some(a) if a.trim().is_empty() => {
                    return Err(error("affix", "the text of the shared span", "empty text"));
                }
                a => a.map(str::to_string),
            },
            anchor_ratio: single(
                "anchor_ratio",
                self.anchor_ratio,
                "a number from 0 to 1",
                |r| (0.0..=1.0).contains(&r),
            )?,
            adaptive: AdaptiveOverrides {
                prompt_interval: count(
                    "prompt_interval",
                    self.prompt_interval,
                    1..=usize::MAX,
                    " (forwards)",
                )?,
                response_interval: count(
                    "response_interval",
                    self.response_interval,
                    1..=usize::MAX,
                    " (forwards)",
                )?,
                refresh_ratio: single(
                    "refresh_ratio",
                    self.refresh_ratio,
                    "a number from 0 to 1",
                    |r| (0.0..=1.0).contains(&r),
                )?,
                verify_pick: match self.verify_pick.as_deref() {
                    None => None,
                    Some(name) => Some(
                        name.parse::<VerifyPick>()
                            .map_err(|e| error("verify_pick", e.expected, format!("{name:?}")))?,
                    ),
                },
                pin_block: self.pin_block,
            },
        })
    }
}

impl Request {
    /// The request with checked settings (`RequestSpec::check`); its cache mode stays
    /// where the settings name none.
    pub fn with_settings(mut self, s: Settings) -> Self {
        self.params = s.params;
        if let Some(cache) = s.cache {
            self.cache = cache;
        }
        self.prefix_len = s.prefix_len;
        self.depth = s.depth;
        if let Some(r) = s.refresh_every {
            self.refresh_every = r;
        }
        self.recompute_all = s.recompute_all;
        if let Some(f) = s.full_canvas {
            self.full_canvas = f;
        }
        self.decode = s.decode;
        if let Some(a) = s.affix {
            self.span = Some(crate::Span::Text(a));
        }
        if let Some(r) = s.anchor_ratio {
            self.anchor_ratio = r;
        }
        s.adaptive.apply(&mut self.adaptive);
        self.logprobs = s.logprobs;
        self.top_logprobs = s.top_logprobs;
        self
    }
}

impl AdaptiveOverrides {
    /// Sets the settings named over `adaptive` (the caller's defaults).
    pub fn apply(&self, adaptive: &mut crate::AdaptiveRefresh) {
        if let Some(k) = self.prompt_interval {
            adaptive.prompt_interval = k;
        }
        if let Some(k) = self.response_interval {
            adaptive.response_interval = k;
        }
        if let Some(r) = self.refresh_ratio {
            adaptive.refresh_ratio = r;
        }
        if let Some(p) = self.verify_pick {
            adaptive.pick = p;
        }
        if let Some(p) = self.pin_block {
            adaptive.pin_block = p;
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(super) const LIMITS: SpecLimits = SpecLimits {
        context: 256,
        layers: 4,
        vocab: 100,
    };

    pub(super) fn spec(json: &str) -> RequestSpec {
        serde_json::from_str(json).unwrap()
    }

    fn field_of(json: &str) -> &'static str {
        spec(json).check(&LIMITS).unwrap_err().field
    }

    #[test]
    fn defaults_follow_the_canvas() {
        let s = spec(r#"{"gen_length": 40}"#).check(&LIMITS).unwrap();
        // 32 does not divide 40: one block of the whole canvas, one step per token.
        assert_eq!((s.params.block_length, s.params.steps), (40, 40));
        let s = spec(r#"{"gen_length": 64, "block_length": 16, "steps": 8}"#)
            .check(&LIMITS)
            .unwrap();
        assert_eq!((s.params.gen_length, s.params.block_length), (64, 16));
        assert_eq!(s.params.steps, 8);
        assert_eq!(s.cache, None);
        assert_eq!(s.decode, DecodeMode::Clean);
    }

    #[test]
    fn every_rule_names_its_field() {
        for (json, field) in [
            (r#"{"gen_length": 0}"#, "gen_length"),
            (r#"{"gen_length": 256}"#, "gen_length"),
            (r#"{"gen_length": 64, "block_length": 24}"#, "block_length"),
            (
                r#"{"gen_length": 64, "block_length": 16, "steps": 6}"#,
                "steps",
            ),
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"temperature": 1e300}"#, "temperature"),
            (r#"{"top_p": 1e-300}"#, "top_p"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"top_k": -3}"#, "top_k"),
            (r#"{"threshold": 0}"#, "threshold"),
            (r#"{"eps": 1}"#, "eps"),
            (r#"{"schedule": "cosine"}"#, "schedule"),
            (r#"{"remasking": "best"}"#, "remasking"),
            (r#"{"cache": "bicache2"}"#, "cache"),
            (r#"{"depth": 5}"#, "depth"),
            (r#"{"refresh_every": 0}"#, "refresh_every"),
            (r#"{"decode": "pretty"}"#, "decode"),
            (r#"{"alg_temp": -0.5}"#, "alg_temp"),
            (r#"{"top_logprobs": 21}"#, "top_logprobs"),
            (r#"{"logit_bias": {"100": 1}}"#, "logit_bias"),
            (r#"{"logit_bias": {"a": 1}}"#, "logit_bias"),
            (r#"{"logit_bias": {"3": 101}}"#, "logit_bias"),
            (r#"{"logit_bias": {"3": 1, "03": 2}}"#, "logit_bias"),
            (r#"{"presence_penalty": 2.5}"#, "presence_penalty"),
            (r#"{"frequency_penalty": -3}"#, "frequency_penalty"),
        ] {
            assert_eq!(field_of(json), field, "{json}");
        }
        let e = spec(r#"{"top_p": 1e-300}"#).check(&LIMITS).unwrap_err();
        assert!(e.found.contains("single precision"), "{e}");
    }

    #[test]
    fn names_and_cuts_read_as_the_reference_spells_them() {
        let s =
            spec(r#"{"alg": "maskgit_plus", "eps": 0.01, "top_k": 0, "cache": "bicache-dual"}"#)
                .check(&LIMITS)
                .unwrap();
        assert_eq!(s.params.remasking, Remasking::LowConfidence);
        assert_eq!(s.params.schedule, Schedule::Dream { eps: 0.01 });
        assert_eq!(s.params.top_k, Some(u32::MAX), "0 is no cut");
        assert_eq!(s.cache, Some(CacheMode::BicacheDual));
        let s = spec(r#"{"threshold": 0.9, "steps": 3, "gen_length": 64, "block_length": 32}"#)
            .check(&LIMITS)
            .unwrap();
        assert_eq!(
            s.params.threshold,
            Some(0.9),
            "steps unused under a threshold"
        );
        let r = Request::ids(vec![1, 2]).with_settings(s);
        assert_eq!(r.params.gen_length, 64);
        assert_eq!(r.cache, CacheMode::None);
        assert!(!r.logprobs && r.top_logprobs == 0);
        let s = spec(r#"{"logprobs": true, "top_logprobs": 20}"#)
            .check(&LIMITS)
            .unwrap();
        let r = Request::ids(vec![1, 2]).with_settings(s);
        assert!(r.logprobs && r.top_logprobs == 20);
    }
}
