//! Which keys each query row sees (`AttentionMask`) and the scale of the scores: checked
//! once per call, then handed to every kernel as uniform fields.

use super::*;

/// Which keys a query row sees. Keys are numbered through segment A's rows, then segment
/// B's (`0 .. len_a + len_b`); query row `i` of a call (counted from `rows.start`) sits at
/// key index `query_start + i`.
///
/// - Default (`causal: false`): every row sees every key (LLaDA; DiffusionGemma's decoder,
///   whose cached prompt keys are a row range of segment A).
/// - `causal`: row `i` sees key `j` iff `j <= query_start + i`, and with `window > 0` also
///   `j > query_start + i - window` (`window` keys including its own). DiffusionGemma's
///   encoder (`query_start` 0, all keys in B) and commit pass (cached keys in A, the new
///   rows' keys in B, `query_start = len_a`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionMask {
    pub causal: bool,
    /// Keys a causal row sees, its own included; 0: no window. Needs `causal`.
    pub window: usize,
    /// Key index of the first query row. Needs `causal` (without it no key index matters).
    pub query_start: usize,
}

impl AttentionMask {
    /// Causal, no window, the first query row at key index `query_start`.
    pub fn causal(query_start: usize) -> Self {
        Self {
            causal: true,
            window: 0,
            query_start,
        }
    }

    /// Causal within a window of `window` keys (0: none).
    pub fn sliding(window: usize, query_start: usize) -> Self {
        Self {
            window,
            ..Self::causal(query_start)
        }
    }

    /// What the mask allows whatever the call: a window and a query start only on a
    /// causal mask.
    pub(super) fn check_form(&self) -> Result<()> {
        if self.causal {
            return Ok(());
        }
        if self.window != 0 {
            return Err(shape_error(
                "mask.window 0 without mask.causal (a window bounds what a causal row sees)".into(),
                format!("mask.window {} with mask.causal false", self.window),
            ));
        }
        if self.query_start != 0 {
            return Err(shape_error(
                "mask.query_start 0 without mask.causal (every row sees every key)".into(),
                format!(
                    "mask.query_start {} with mask.causal false",
                    self.query_start
                ),
            ));
        }
        Ok(())
    }

    /// The mask against a call of `m` query rows over `n_keys` keys: every causal row's own
    /// key exists, so every row sees at least one key (a row seeing none has no softmax).
    pub(super) fn check(&self, m: usize, n_keys: usize) -> Result<()> {
        self.check_form()?;
        if self.causal && m > 0 && self.query_start.saturating_add(m) > n_keys {
            return Err(shape_error(
                format!(
                    "mask.query_start + query rows <= keys ({n_keys}): each causal row's own \
                     key present"
                ),
                format!("mask.query_start {} + {m} rows", self.query_start),
            ));
        }
        Ok(())
    }

    /// The uniform fields: (causal, window, query_start). A window wider than u32 is as
    /// good as none; the kernels compute `max(pos + 1, window) - window` and
    /// `pos - key < window`, which cannot overflow.
    pub(super) fn uniforms(&self) -> Result<(u32, u32, u32)> {
        Ok((
            u32::from(self.causal),
            u32::try_from(self.window).unwrap_or(u32::MAX),
            to_u32("mask.query_start", self.query_start)?,
        ))
    }
}

/// A scale the kernels can fold into `log2(e) * scale`: finite and positive.
pub(super) fn check_scale(scale: Option<f32>) -> Result<()> {
    match scale {
        Some(s) if !(s.is_finite() && s > 0.0) => Err(shape_error(
            "scale: finite and positive (None: 1/sqrt(head_dim))".into(),
            format!("scale {s}"),
        )),
        _ => Ok(()),
    }
}

/// The scores' factor in the log2 domain the kernels work in (they use exp2).
pub(super) fn scale_log2(scale: Option<f32>, head_dim: usize) -> f32 {
    match scale {
        // Today's expression, so LLaDA's results stay bit for bit.
        None => std::f32::consts::LOG2_E / (head_dim as f32).sqrt(),
        Some(s) => std::f32::consts::LOG2_E * s,
    }
}
