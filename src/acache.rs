//! ACache in the engine (DESIGN.md §3): a shared span anywhere in the prompt, its K/V from
//! a span-only pass kept in the shared store beside BiCache's prefixes (one store, one
//! budget, the same pins and eviction), placed at the request's offset by rotating its keys
//! on the GPU, and the request's anchors chosen by one probe pass.
//!
//! The probe runs every row but the span's (the prompt's other tokens and the masked
//! canvas) against the placed span; in every layer the masked rows' attention over the
//! span's keys (softmax over the span alone) is summed into one importance per span token,
//! and the top ⌈ratio · S⌉ are the anchors (ties to the lower position). Only the anchors
//! are read back. The cache mode then recomputes the anchors and every non-span row at
//! each block start (`cache::plan_mode`); the other span rows keep the entry's K/V at every
//! depth, the anchors' rows get the request's own.

use std::ops::Range;

use unmask_core::step_plan::{RowSet, SeqStep, StepPlan};
use unmask_gpu::StepEncoder;
use unmask_gpu::model::{ForwardState, PlanBuffers};
use unmask_gpu::ops::acache::AnchorProbe;

use crate::bicache::PrefixEntry;
use crate::{Engine, EngineError, Request, Span, Timings};

/// The fewest tokens of a stored span found in a prompt that does not name one: shorter
/// matches are too likely to be chance.
pub const MIN_FOUND_SPAN: usize = 16;

/// Anchors for a span of `len` tokens at `ratio`: ⌈ratio · len⌉, computed so that a ratio
/// written in decimal (0.1, 0.3) is not pushed up by its binary rounding.
pub fn anchor_count(ratio: f32, len: usize) -> usize {
    let exact = f64::from(ratio) * len as f64;
    ((exact - 1e-6).ceil().max(0.0) as usize).min(len)
}

/// Checks an anchor ratio.
pub(crate) fn check_ratio(ratio: f32) -> Result<(), EngineError> {
    if ratio.is_finite() && (0.0..=1.0).contains(&ratio) {
        return Ok(());
    }
    Err(EngineError::Invalid {
        field: "anchor_ratio",
        expected: "a share of the span from 0 to 1".into(),
        found: ratio.to_string(),
    })
}

impl Engine {
    /// Where the request's shared span lies in `prompt`, and whether it was found in the
    /// store rather than named; Ok(None) when it names none and no stored span is inside.
    pub(crate) fn locate_span(
        &self,
        request: &Request,
        prompt: &[u32],
    ) -> Result<Option<(Range<usize>, bool)>, EngineError> {
        let invalid = |expected: &str, found: String| EngineError::Invalid {
            field: "span",
            expected: expected.into(),
            found,
        };
        match &request.span {
            Some(Span::Tokens(r)) => {
                if r.is_empty() || r.end > prompt.len() {
                    return Err(invalid(
                        &format!(
                            "a non-empty token range inside the prompt's {} tokens",
                            prompt.len()
                        ),
                        format!("{r:?}"),
                    ));
                }
                Ok(Some((r.clone(), false)))
            }
            Some(Span::Text(text)) => {
                let ids = self.require_tokenizer()?.encode(text)?;
                if ids.is_empty() {
                    return Err(invalid("text of at least one token", "empty text".into()));
                }
                match prompt.windows(ids.len()).position(|w| w == ids) {
                    Some(at) => Ok(Some((at..at + ids.len(), false))),
                    None => Err(invalid(
                        "text that appears in the prompt and tokenizes the same there (start \
                         it at a line or word boundary)",
                        format!(
                            "{} tokens not found among the prompt's {}",
                            ids.len(),
                            prompt.len()
                        ),
                    )),
                }
            }
            None => {
                let store = self.store()?;
                Ok(store
                    .find_inside(self.model_id, prompt, MIN_FOUND_SPAN)
                    .map(|(at, len)| (at..at + len, true)))
            }
        }
    }

    /// Places `entry`'s K/V at `span` of a request's arena (from `kv_base`), runs the probe
    /// over `tokens` (prompt and canvas) and returns the anchors (positions, sorted) chosen
    /// at `ratio`. The probe's K/V of the non-span rows land in the arena too; the first
    /// step recomputes them.
    #[allow(clippy::too_many_arguments)] // one request's arena, tokens, span and entry
    pub(crate) async fn place_span_and_probe(
        &self,
        st: &ForwardState,
        kv_base: usize,
        tokens: &[u32],
        span: Range<usize>,
        entry: &PrefixEntry,
        ratio: f32,
        timings: &mut Timings,
    ) -> Result<Vec<u32>, EngineError> {
        let model = &self.model;
        let n_layers = model.cfg.n_layers;
        let len = span.len();
        if entry.tokens != len {
            return Err(EngineError::Internal(format!(
                "a span entry of {} tokens for a span of {len}",
                entry.tokens
            )));
        }
        let mut step = StepEncoder::new(&self.ctx, "acache probe");
        model.encode_span_place(
            &mut step,
            &entry.kv,
            &st.kv,
            len,
            kv_base + span.start,
            span.start,
        )?;
        let k = anchor_count(ratio, len);
        if k == 0 || k == len {
            // Nothing to choose: direct reuse, or every span row recomputed.
            step.submit()?;
            return Ok(if k == 0 {
                Vec::new()
            } else {
                span.map(|p| p as u32).collect()
            });
        }
        let t = tokens.len();
        let rows = RowSet::without_plus(0..t, span.clone(), &[]);
        let seq = SeqStep {
            rows: rows.clone(),
            prefix_len: 0,
            refresh: false,
            seq_len: t,
            kv_len: t,
            kv_base,
            predict: Vec::new(),
        };
        let shift = model.cfg.family.shifts_logits();
        let plan = StepPlan::alone(&[seq], n_layers, shift)
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        let ids: Vec<u32> = rows.iter().map(|p| tokens[p]).collect();
        let mask = self.special().mask;
        let queries: Vec<u32> = (0..ids.len() as u32)
            .filter(|&i| ids[i as usize] == mask)
            .collect();
        let probe = AnchorProbe::new(
            &self.ctx,
            &queries,
            kv_base + span.start,
            len,
            k,
            model.cfg.n_heads,
        )?;
        let buffers = PlanBuffers {
            probe: Some(&probe),
            ..PlanBuffers::default()
        };
        model.encode_plan(&mut step, st, None, &plan, &ids, buffers)?;
        let slot = step.read_back(&probe.selected.buffer, 0, (len * 4) as u64);
        let read = step.submit()?.read_async().await?;
        timings.token_layer_passes += rows.len() * n_layers;
        timings.forward_passes += 1;
        let selected = read[slot]
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
        Ok(selected
            .enumerate()
            .filter(|&(_, s)| s != 0)
            .map(|(j, _)| (span.start + j) as u32)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchor_counts_round_up_from_the_decimal_ratio() {
        assert_eq!(anchor_count(0.2, 286), 58);
        assert_eq!(anchor_count(0.1, 10), 1);
        assert_eq!(anchor_count(0.3, 10), 3);
        assert_eq!(anchor_count(0.05, 10), 1);
        assert_eq!(anchor_count(0.0, 10), 0);
        assert_eq!(anchor_count(1.0, 10), 10);
        assert!(check_ratio(1.5).is_err() && check_ratio(f32::NAN).is_err());
        assert!(check_ratio(0.0).is_ok());
    }
}
