//! Logit biases of a request: OpenAI's `logit_bias` (a fixed bias per id) and its presence
//! and frequency penalties, and vLLM's (and transformers') multiplicative
//! `repetition_penalty`. An autoregressive model counts the tokens it has emitted; a
//! diffusion canvas has no order of emission, so the penalties count the tokens committed
//! anywhere in the generated canvas so far, and each step's rows see the counts of the
//! canvas as that step starts. The repetition penalty also covers the prompt (and an
//! infilling suffix), as vLLM's covers the prompt. End tokens are never counted: a canvas
//! pads its tail with them, and penalising them would push text into the padding.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::error::SamplerError;

/// Most ids `LogitBias::ids` may list (each costs every sampled row a read per step).
pub const MOST_LOGIT_BIAS: usize = 1024;
/// A bias lies in `[-BIAS_LIMIT, BIAS_LIMIT]` (OpenAI's range: -100 bans an id in
/// practice, 100 forces it).
pub const BIAS_LIMIT: f32 = 100.0;
/// A penalty lies in `[-PENALTY_LIMIT, PENALTY_LIMIT]` (OpenAI's range).
pub const PENALTY_LIMIT: f32 = 2.0;
/// A repetition penalty lies in `[1 / REPETITION_LIMIT, REPETITION_LIMIT]`: past it every
/// seen id is as good as banned (or forced), which `logit_bias` says plainly, and its
/// inverse stays a finite f32.
pub const REPETITION_LIMIT: f32 = 100.0;

/// What one step does to one id's logit `l`, in vLLM's order: the fixed bias first, then
/// the repetition penalty (a positive value divided by it, a negative one multiplied),
/// then the presence and frequency penalties subtracted: `rep(l + bias) - penalty`. The
/// kernel multiplies by `1 / repetition` rather than dividing, so both sides of a
/// comparison compute `IdBias::apply` the same way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IdBias {
    pub id: u32,
    /// OpenAI's `logit_bias` of this id.
    pub bias: f32,
    /// The repetition penalty on this id (1 when the id was not seen).
    pub repetition: f32,
    /// The presence and frequency penalties of this id's committed occurrences.
    pub penalty: f32,
}

impl IdBias {
    /// The scale of a positive value (`1 / repetition`) and of a negative one.
    pub fn scales(&self) -> (f32, f32) {
        (1.0 / self.repetition, self.repetition)
    }

    /// The biased logit, as the kernel computes it.
    pub fn apply(&self, logit: f32) -> f32 {
        let (positive, negative) = self.scales();
        let x = logit + self.bias;
        x * if x > 0.0 { positive } else { negative } + -self.penalty
    }

    /// Whether the logit is left as it is.
    pub fn is_neutral(&self) -> bool {
        self.bias == 0.0 && self.repetition == 1.0 && self.penalty == 0.0
    }
}

impl From<(u32, f32)> for IdBias {
    /// A fixed bias alone (`logit_bias`).
    fn from((id, bias): (u32, f32)) -> Self {
        Self {
            id,
            bias,
            repetition: 1.0,
            penalty: 0.0,
        }
    }
}

/// What a request does to its logits before the token choice (and before its
/// log-probabilities, which are taken under the distribution the token is drawn from).
#[derive(Clone, Debug, PartialEq)]
pub struct LogitBias {
    /// (vocabulary id, bias), sorted by id, one entry per id.
    pub ids: Vec<(u32, f32)>,
    /// Subtracted once from the logit of every id committed at least once in the canvas.
    pub presence_penalty: f32,
    /// Subtracted from an id's logit once per committed occurrence in the canvas.
    pub frequency_penalty: f32,
    /// Divides the positive logits and multiplies the negative ones of the ids in the
    /// prompt, the suffix or committed in the canvas (1: none; above 1 discourages them).
    /// Applied to the model's logit before the additive biases.
    pub repetition_penalty: f32,
}

impl Default for LogitBias {
    fn default() -> Self {
        Self {
            ids: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl LogitBias {
    /// Fixed biases from (id, bias) pairs in any order; an id listed twice is refused.
    pub fn with_ids(mut ids: Vec<(u32, f32)>) -> Result<Self, SamplerError> {
        ids.sort_by_key(|&(id, _)| id);
        if let Some(w) = ids.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(SamplerError::BadLogitBias {
                expected: "each token id at most once".into(),
                found: format!("id {} twice", w[0].0),
            });
        }
        Ok(Self {
            ids,
            ..Self::default()
        })
    }

    /// Whether the logits are left as the model gives them.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty() && !self.penalises()
    }

    /// Whether the biases depend on the tokens seen (and so change from step to step).
    pub fn penalises(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// Checks ranges and counts; `vocab` (when known) bounds the ids.
    pub fn check(&self, vocab: Option<usize>) -> Result<(), SamplerError> {
        let bad = |expected: String, found: String| SamplerError::BadLogitBias { expected, found };
        if self.ids.len() > MOST_LOGIT_BIAS {
            return Err(bad(
                format!("at most {MOST_LOGIT_BIAS} ids"),
                format!("{} ids", self.ids.len()),
            ));
        }
        if let Some(w) = self.ids.windows(2).find(|w| w[0].0 >= w[1].0) {
            return Err(bad(
                "ids sorted, each at most once".into(),
                format!("id {} before id {}", w[0].0, w[1].0),
            ));
        }
        if let Some(&(id, b)) = self
            .ids
            .iter()
            .find(|(_, b)| !(b.is_finite() && b.abs() <= BIAS_LIMIT))
        {
            return Err(bad(
                format!("biases from -{BIAS_LIMIT} to {BIAS_LIMIT}"),
                format!("{b} for id {id}"),
            ));
        }
        if let Some(v) = vocab
            && let Some(&(id, _)) = self.ids.iter().find(|&&(id, _)| id as usize >= v)
        {
            return Err(bad(
                format!("token ids below the vocabulary size {v}"),
                format!("id {id}"),
            ));
        }
        for (field, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(value.is_finite() && value.abs() <= PENALTY_LIMIT) {
                return Err(SamplerError::BadPenalty { field, value });
            }
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && (1.0 / REPETITION_LIMIT..=REPETITION_LIMIT).contains(&r)) {
            return Err(SamplerError::BadRepetitionPenalty { value: r });
        }
        Ok(())
    }

    /// The biases of one step's rows over the sequence `tokens`, whose generated canvas is
    /// `canvas`: the fixed biases, the presence and frequency penalties of the ids
    /// committed in the canvas, and the repetition penalty of the ids anywhere in `tokens`
    /// (the prompt and suffix around the canvas count too); masked positions and
    /// `uncounted` ids are not counted. Sorted by id, without neutral entries.
    pub fn step_biases(
        &self,
        tokens: &[u32],
        canvas: Range<usize>,
        mask: u32,
        uncounted: &[u32],
    ) -> Vec<IdBias> {
        let mut out: BTreeMap<u32, IdBias> = self
            .ids
            .iter()
            .map(|&pair| (pair.0, IdBias::from(pair)))
            .collect();
        let counted = |t: &&u32| **t != mask && !uncounted.contains(t);
        let additive = self.presence_penalty != 0.0 || self.frequency_penalty != 0.0;
        let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
        if additive {
            for &t in tokens[canvas].iter().filter(counted) {
                *counts.entry(t).or_default() += 1;
            }
        }
        for (id, c) in counts {
            out.entry(id)
                .or_insert_with(|| IdBias::from((id, 0.0)))
                .penalty = self.presence_penalty + self.frequency_penalty * c as f32;
        }
        if self.repetition_penalty != 1.0 {
            for &id in tokens.iter().filter(counted) {
                out.entry(id)
                    .or_insert_with(|| IdBias::from((id, 0.0)))
                    .repetition = self.repetition_penalty;
            }
        }
        out.into_values().filter(|b| !b.is_neutral()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalties_count_committed_tokens_but_not_masks_or_end_tokens() {
        let bias = LogitBias {
            ids: vec![(3, 1.5), (9, -100.0)],
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..LogitBias::default()
        };
        let (mask, eos) = (99, 7);
        let canvas = [5, 5, 99, 3, 5, 7, 7, 7, 99];
        let all = 0..canvas.len();
        let adds = |v: Vec<IdBias>| {
            v.iter()
                .map(|b| (b.id, b.bias, b.penalty))
                .collect::<Vec<_>>()
        };
        // 5 three times: 0.5 + 3 * 0.25; 3 once: 0.75 beside its bias; 9 unseen; 7 (end)
        // uncounted; the prompt (4, 4) counts for the repetition penalty only.
        let prompted = [[4, 4].as_slice(), &canvas].concat();
        let got = bias.step_biases(&prompted, 2..prompted.len(), mask, &[eos]);
        assert_eq!(
            adds(got.clone()),
            vec![(3, 1.5, 0.75), (5, 0.0, 1.25), (9, -100.0, 0.0)]
        );
        assert!(got.iter().all(|b| b.repetition == 1.0));
        // No penalty: the fixed list as it is, whatever the canvas.
        let fixed = LogitBias::with_ids(vec![(9, -1.0), (2, 3.0)]).unwrap();
        assert_eq!(
            adds(fixed.step_biases(&canvas, all.clone(), mask, &[])),
            vec![(2, 3.0, 0.0), (9, -1.0, 0.0)]
        );
        // The repetition penalty: each id of the canvas or around it once, ends aside.
        let repeat = LogitBias {
            ids: vec![(3, 2.0)],
            repetition_penalty: 1.25,
            ..LogitBias::default()
        };
        let around = [[4, 7].as_slice(), &canvas, &[99, 4]].concat();
        let got = repeat.step_biases(&around, 2..2 + canvas.len(), mask, &[eos]);
        let reps: Vec<(u32, f32, f32)> = got.iter().map(|b| (b.id, b.repetition, b.bias)).collect();
        assert_eq!(reps, vec![(3, 1.25, 2.0), (4, 1.25, 0.0), (5, 1.25, 0.0)]);
        // rep(l + bias) - penalty: the bias first (vLLM's order), so -2 + 2.5 is positive
        // and divided; a negative value is multiplied.
        assert_eq!(got[0].apply(0.5), 2.5 * (1.0 / 1.25));
        assert_eq!(got[1].apply(-2.0), -2.5);
        let all_three = IdBias {
            penalty: 0.5,
            ..got[0]
        };
        assert_eq!(all_three.apply(-4.0), -2.0 * 1.25 - 0.5);
    }

    #[test]
    fn out_of_range_biases_and_penalties_are_refused_by_name() {
        let err = |b: LogitBias, vocab| b.check(vocab).unwrap_err().to_string();
        assert!(LogitBias::with_ids(vec![(4, 1.0), (4, 2.0)]).is_err());
        let ids = |ids| LogitBias {
            ids,
            ..LogitBias::default()
        };
        assert!(err(ids(vec![(1, 100.5)]), None).contains("-100 to 100"));
        assert!(err(ids(vec![(1, f32::NAN)]), None).contains("NaN for id 1"));
        assert!(err(ids(vec![(12, 1.0)]), Some(12)).contains("vocabulary size 12"));
        assert!(err(ids(vec![(3, 1.0), (2, 1.0)]), None).contains("sorted"));
        let many = (0..=MOST_LOGIT_BIAS as u32).map(|i| (i, 1.0)).collect();
        assert!(err(ids(many), None).contains("at most 1024"));
        let presence = LogitBias {
            presence_penalty: 2.5,
            ..LogitBias::default()
        };
        assert!(err(presence, None).starts_with("presence_penalty"));
        for r in [0.0, -1.0, f32::INFINITY, 101.0, 1e-40, 0.0099] {
            let repeat = LogitBias {
                repetition_penalty: r,
                ..LogitBias::default()
            };
            assert!(err(repeat, None).starts_with("repetition_penalty"), "{r}");
        }
        assert!(ids(vec![(11, -100.0)]).check(Some(12)).is_ok());
    }
}
