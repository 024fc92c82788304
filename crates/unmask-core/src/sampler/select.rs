//! What the GPU's selection kernel is told about one row: how its token is chosen and which
//! confidence it reports.

/// Which confidence of its prediction a row reports (the value positions are ranked by).
/// All are computed on the CFG-combined logits after `suppress_token` and the top-p/top-k
/// cut, untempered unless `SelectParams::tempered`; the chosen token is the same for every
/// kind.
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConfidenceKind {
    /// The softmax probability of the chosen token (LLaDA `low_confidence`; Dream
    /// `maskgit_plus`), with `SelectParams::conf_exclude` left out of the softmax.
    #[default]
    Probability,
    /// Top-1 minus top-2 softmax probability of the row (Dream `topk_margin`): 0 when the
    /// two largest logits tie, 1/Z with one column.
    Margin,
    /// Negative entropy `sum p log p` of the row's softmax (Dream `entropy`), at most 0.
    /// Dream adds 1e-10 inside the log; this does not (the sum changes by less than
    /// `vocab * 1e-10`, under 2e-5 at 152k ids).
    NegEntropy,
}

/// How one row's token and confidence are chosen (LLaDA `generate`, one denoising step):
/// what the GPU's selection kernel is given, and the CPU oracle reproduces.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectParams {
    /// Gumbel-noise temperature; 0 is a plain argmax.
    pub temperature: f32,
    /// Classifier-free guidance weight `w`: `l = u + (w + 1)(c - u)` when unconditional
    /// logits are given.
    pub cfg_scale: f32,
    pub seed: u64,
    /// Denoising step index: a counter of the noise, so every step draws fresh noise.
    pub step: u32,
    /// `logits_eos_inf`: this id's logit is -inf before anything else.
    pub suppress_token: Option<u32>,
    /// Ids left out of the confidence softmax after the token was chosen
    /// (`confidence_eos_eot_inf`); a chosen excluded id has confidence 0. Only
    /// `ConfidenceKind::Probability` uses them; the other kinds see the whole row.
    pub conf_exclude: [Option<u32>; 2],
    /// Which confidence the row reports.
    pub confidence: ConfidenceKind,
    /// The confidence softmax is over `l / T` when T > 0 (Dream's `sample_tokens`) instead
    /// of `l` (LLaDA's `generate`). The token is the same either way.
    pub tempered: bool,
    /// Nucleus cut before the token choice (Dream's `top_p_logits`): over the ids sorted by
    /// logit, an id stays when the probability of the ids strictly above it is at most
    /// `top_p` (so the most probable id always stays). The probabilities are `softmax(l / T)`
    /// at T > 0 and `softmax(l)` at T = 0. Ids with equal logits stay or go together.
    /// Cut ids are out of the token choice and of every confidence. `None` or 1 keeps all.
    pub top_p: Option<f32>,
    /// Keeps the ids whose logit is at least the k-th largest (Dream's `top_k_logits`, ties
    /// included); with `top_p`, an id must pass both.
    pub top_k: Option<u32>,
    /// Keeps the ids whose probability is at least `min_p` times the row's largest (vLLM's
    /// `min_p`), under the same probabilities as `top_p`: the logit at least
    /// `max + SelectParams::min_p_gap`. With the other cuts, an id must pass all. `None` or
    /// 0 keeps all.
    pub min_p: Option<f32>,
    /// Also report the chosen token's log-probability under the model's own softmax: the
    /// CFG-combined logits of the whole vocabulary at temperature 1, before the
    /// suppression and the cut. Costs one more exp per logit, so it is asked for.
    pub logprob: bool,
    /// Also report this many most likely ids of the row (0 to 20) with their
    /// log-probabilities under the same softmax (OpenAI's `top_logprobs`); implies `logprob`.
    pub top_logprobs: u32,
}

impl SelectParams {
    /// Whether some ids may be cut from a row.
    pub fn cuts(&self) -> bool {
        self.top_p.is_some_and(|p| p < 1.0) || self.top_k.is_some() || self.min_p_gap().is_some()
    }

    /// How far below its row's largest logit a logit may lie and stay under `min_p`:
    /// `ln(min_p) * T` at temperature T > 0 (the probabilities are `softmax(l / T)`), else
    /// `ln(min_p)`. `None` when `min_p` cuts nothing. The kernel and the oracle both take
    /// this f32, so they draw the same line.
    pub fn min_p_gap(&self) -> Option<f32> {
        let min_p = self.min_p.filter(|&p| p > 0.0)?;
        let t = self.temperature;
        Some(if t > 0.0 { min_p.ln() * t } else { min_p.ln() })
    }
}

impl Default for SelectParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            cfg_scale: 0.0,
            seed: 0,
            step: 0,
            suppress_token: None,
            conf_exclude: [None; 2],
            confidence: ConfidenceKind::Probability,
            tempered: false,
            top_p: None,
            top_k: None,
            min_p: None,
            logprob: false,
            top_logprobs: 0,
        }
    }
}
