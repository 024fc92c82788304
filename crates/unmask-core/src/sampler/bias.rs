//! Additive logit biases of a request: OpenAI's `logit_bias` (a fixed bias per id) and its
//! presence and frequency penalties. An autoregressive model counts the tokens it has
//! emitted; a diffusion canvas has no order of emission, so the penalties count the tokens
//! committed anywhere in the generated canvas so far, and each step's rows see the counts
//! of the canvas as that step starts. End tokens are not counted: a canvas pads its tail
//! with them, and penalising them would push text into the padding.

use std::collections::BTreeMap;

use crate::error::SamplerError;

/// Most ids `LogitBias::ids` may list (each costs every sampled row a read per step).
pub const MOST_LOGIT_BIAS: usize = 1024;
/// A bias lies in `[-BIAS_LIMIT, BIAS_LIMIT]` (OpenAI's range: -100 bans an id in
/// practice, 100 forces it).
pub const BIAS_LIMIT: f32 = 100.0;
/// A penalty lies in `[-PENALTY_LIMIT, PENALTY_LIMIT]` (OpenAI's range).
pub const PENALTY_LIMIT: f32 = 2.0;

/// What a request adds to its logits before the token choice (and before its
/// log-probabilities, which are taken under the distribution the token is drawn from).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitBias {
    /// (vocabulary id, bias), sorted by id, one entry per id.
    pub ids: Vec<(u32, f32)>,
    /// Subtracted once from the logit of every id committed at least once in the canvas.
    pub presence_penalty: f32,
    /// Subtracted from an id's logit once per committed occurrence in the canvas.
    pub frequency_penalty: f32,
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
        self.ids.is_empty() && self.presence_penalty == 0.0 && self.frequency_penalty == 0.0
    }

    /// Whether the biases depend on the canvas (and so change from step to step).
    pub fn penalises(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
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
        Ok(())
    }

    /// The (id, bias) list of one step's rows: the fixed biases plus the penalties of the
    /// ids committed in `canvas` (masked positions and `uncounted` ids aside), sorted by id
    /// and without zero entries.
    pub fn step_biases(&self, canvas: &[u32], mask: u32, uncounted: &[u32]) -> Vec<(u32, f32)> {
        if !self.penalises() {
            return self
                .ids
                .iter()
                .copied()
                .filter(|&(_, b)| b != 0.0)
                .collect();
        }
        let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
        for &t in canvas {
            if t != mask && !uncounted.contains(&t) {
                *counts.entry(t).or_default() += 1;
            }
        }
        let mut out: BTreeMap<u32, f32> = self.ids.iter().copied().collect();
        for (id, c) in counts {
            *out.entry(id).or_default() -=
                self.presence_penalty + self.frequency_penalty * c as f32;
        }
        out.into_iter().filter(|&(_, b)| b != 0.0).collect()
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
        };
        let (mask, eos) = (99, 7);
        let canvas = [5, 5, 99, 3, 5, 7, 7, 7, 99];
        // 5 three times: 0.5 + 3 * 0.25; 3 once: 1.5 - 0.75; 9 unseen; 7 (end) uncounted.
        assert_eq!(
            bias.step_biases(&canvas, mask, &[eos]),
            vec![(3, 0.75), (5, -1.25), (9, -100.0)]
        );
        // No penalty: the fixed list as it is, whatever the canvas.
        let fixed = LogitBias::with_ids(vec![(9, -1.0), (2, 3.0)]).unwrap();
        assert_eq!(
            fixed.step_biases(&canvas, mask, &[]),
            vec![(2, 3.0), (9, -1.0)]
        );
        // A penalty that cancels a fixed bias leaves no entry.
        let cancel = LogitBias {
            ids: vec![(5, 1.0)],
            presence_penalty: 1.0,
            frequency_penalty: 0.0,
        };
        assert_eq!(cancel.step_biases(&[5], mask, &[]), Vec::new());
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
        assert!(ids(vec![(11, -100.0)]).check(Some(12)).is_ok());
    }
}
