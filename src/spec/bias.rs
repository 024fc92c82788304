//! `logit_bias` and the penalties of a request spec, each checked and named on its own.

use std::collections::BTreeMap;

use unmask_core::error::SamplerError;
use unmask_core::sampler::LogitBias;
use unmask_core::sampler::bias::{BIAS_LIMIT, PENALTY_LIMIT, REPETITION_LIMIT};

use super::{RequestSpec, SpecError, error, single};

/// OpenAI's `logit_bias` map (token ids as decimal strings to biases) by the rules every
/// request shares, each objection naming `logit_bias`: ids below `vocab` (`usize::MAX`:
/// checked when the request runs), biases from -100 to 100, each id once ("7" and "07"
/// are one), at most `MOST_LOGIT_BIAS` ids. Sorted by id.
pub fn logit_bias_ids(
    map: &BTreeMap<String, f64>,
    vocab: usize,
) -> Result<Vec<(u32, f32)>, SpecError> {
    let mut ids = Vec::new();
    for (key, &b) in map {
        let id = key.parse::<u32>().ok().filter(|&id| (id as usize) < vocab);
        let Some(id) = id else {
            let below = if vocab == usize::MAX {
                String::new()
            } else {
                format!(" below the vocabulary size {vocab}")
            };
            let expected = format!("token ids written as decimal strings{below}");
            return Err(error("logit_bias", expected, format!("the key {key:?}")));
        };
        let range = format!("biases from -{BIAS_LIMIT} to {BIAS_LIMIT}");
        let bias =
            single("logit_bias", Some(b), &range, |b| b.abs() <= BIAS_LIMIT).map_err(|e| {
                SpecError {
                    found: format!("{} for id {id}", e.found),
                    ..e
                }
            })?;
        ids.push((id, bias.unwrap_or(0.0)));
    }
    // Keys are distinct strings, but "7" and "07" name one id; then the number of ids.
    let bias = LogitBias::with_ids(ids).map_err(bias_error)?;
    bias.check(None).map_err(bias_error)?;
    Ok(bias.ids)
}

impl RequestSpec {
    /// `logit_bias` and the penalties, each named when out of its range.
    pub(super) fn logit_bias(&self, vocab: usize) -> Result<LogitBias, SpecError> {
        let ids = match &self.logit_bias {
            Some(map) => logit_bias_ids(map, vocab)?,
            None => Vec::new(),
        };
        let penalty = |field, v| {
            let range = format!("a number from -{PENALTY_LIMIT} to {PENALTY_LIMIT}");
            Ok(single(field, v, &range, |p| p.abs() <= PENALTY_LIMIT)?.unwrap_or(0.0))
        };
        let least = 1.0 / REPETITION_LIMIT;
        let repetition = format!("a number from {least} to {REPETITION_LIMIT} (1: none)");
        Ok(LogitBias {
            ids,
            presence_penalty: penalty("presence_penalty", self.presence_penalty)?,
            frequency_penalty: penalty("frequency_penalty", self.frequency_penalty)?,
            repetition_penalty: single(
                "repetition_penalty",
                self.repetition_penalty,
                &repetition,
                |r| (least..=REPETITION_LIMIT).contains(&r),
            )?
            .unwrap_or(1.0),
        })
    }
}

/// `LogitBias`'s objection as the field error it names.
fn bias_error(e: SamplerError) -> SpecError {
    match e {
        SamplerError::BadLogitBias { expected, found } => error("logit_bias", expected, found),
        SamplerError::BadPenalty { field, value } => {
            let range = format!("a number from -{PENALTY_LIMIT} to {PENALTY_LIMIT}");
            error(field, range, value)
        }
        other => error("logit_bias", "a list the sampler takes", other),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{LIMITS, spec};

    #[test]
    fn logit_biases_and_penalties_reach_the_parameters() {
        let json = r#"{"logit_bias": {"7": -100, "2": 3.5}, "frequency_penalty": 0.5}"#;
        let bias = spec(json).check(&LIMITS).unwrap().params.bias;
        assert_eq!(bias.ids, vec![(2, 3.5), (7, -100.0)]);
        assert_eq!((bias.presence_penalty, bias.frequency_penalty), (0.0, 0.5));
        let e = spec(r#"{"logit_bias": {"99": 1, "100": 1}}"#)
            .check(&LIMITS)
            .unwrap_err();
        assert_eq!(e.found, "the key \"100\"");
        assert!(e.expected.contains("vocabulary size 100"), "{e}");
        let e = spec(r#"{"logit_bias": {"4": -250}}"#)
            .check(&LIMITS)
            .unwrap_err();
        assert_eq!(e.found, "-250 for id 4");
        assert!(spec("{}").check(&LIMITS).unwrap().params.bias.is_empty());
        let p = spec(r#"{"repetition_penalty": 1.2, "min_p": 0.05}"#)
            .check(&LIMITS)
            .unwrap()
            .params;
        assert_eq!((p.bias.repetition_penalty, p.min_p), (1.2, Some(0.05)));
        assert!(p.bias.penalises() && p.cuts());
        for (json, field) in [
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
            (r#"{"repetition_penalty": 101}"#, "repetition_penalty"),
            (r#"{"min_p": 1.5}"#, "min_p"),
            (r#"{"min_p": -0.1}"#, "min_p"),
        ] {
            assert_eq!(
                spec(json).check(&LIMITS).unwrap_err().field,
                field,
                "{json}"
            );
        }
    }
}
