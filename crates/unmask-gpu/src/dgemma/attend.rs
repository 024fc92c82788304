//! Attention of a DiffusionGemma pass (§5 of the spec): the encoder's causal attention over
//! the cache it appends to, the decoder's over each canvas's cached keys and the canvas.

use unmask_core::config::LayerAttention;

use super::DgemmaModel;
use super::pass::{Pass, Scratch, Span, view};
use crate::model::ModelError;
use crate::ops::attention::{
    AttentionMask, AttentionOptions, AttentionShape, KvSegment, attention_with,
};
use crate::ops::elementwise::pack_f16_rows;
use crate::step::StepEncoder;
use crate::tensor::DType;

impl DgemmaModel {
    /// Attention of the pass's rows (§5): the encoder writes its K/V into the cache and
    /// attends causally over it (sliding layers: the last W keys); the decoder attends, per
    /// canvas, to its cached keys (sliding layers: the last W - 1) and to every key of the
    /// canvas.
    pub(super) fn attend(
        &self,
        step: &mut StepEncoder,
        s: &Scratch,
        spans: &[Span],
        l: usize,
        a: LayerAttention,
        pass: Pass,
    ) -> Result<(), ModelError> {
        let t = s.x.shape[0];
        let kv_w = a.kv_heads * a.head_dim;
        let window = self.cfg.sliding_window;
        let shape = AttentionShape {
            n_heads: self.cfg.heads,
            n_kv_heads: a.kv_heads,
            head_dim: a.head_dim,
        };
        let q_stride = self.cfg.heads * a.head_dim;
        // Keys before p0 + 1 - W are outside every row's window.
        let lowest = |p0: usize| {
            if a.sliding {
                (p0 + 1).saturating_sub(window)
            } else {
                0
            }
        };
        // Scale 1: the q/k norms carry it.
        let options = AttentionOptions {
            kernel: self.kernels.attention,
            tuner: Some(&self.kernels.tuner),
            scratch: s.attn_parts.as_ref(),
            scale: Some(1.0),
            ..Default::default()
        };
        match pass {
            Pass::Encode => {
                let [span] = spans else {
                    return Err(ModelError::Input(format!(
                        "encoder pass: expected one sequence, found {}",
                        spans.len()
                    )));
                };
                let cache = span.cache;
                let (ck, cv) = (&cache.k[l], &cache.v[l]);
                let p0 = cache.len;
                let at = cache.row(&a, p0);
                if cache.dtype == DType::F16 {
                    pack_f16_rows(step, &s.k, kv_w, ck, kv_w, at, (t, kv_w))?;
                    pack_f16_rows(step, &s.v, kv_w, cv, kv_w, at, (t, kv_w))?;
                } else {
                    let row = cache.row_bytes(&a);
                    let bytes = t as u64 * row;
                    step.copy(&s.k.buffer, 0, &ck.buffer, at as u64 * row, bytes);
                    step.copy(&s.v.buffer, 0, &cv.buffer, at as u64 * row, bytes);
                }
                let lo = lowest(p0);
                let options = AttentionOptions {
                    mask: AttentionMask {
                        causal: true,
                        window: if a.sliding { window } else { 0 },
                        query_start: p0 - lo,
                    },
                    ..options
                };
                let seg = KvSegment {
                    k: ck,
                    v: cv,
                    start: cache.row(&a, lo),
                    len: p0 + t - lo,
                };
                let out = &s.attn;
                attention_with(
                    step,
                    &s.q,
                    q_stride,
                    0,
                    0..t,
                    None,
                    seg,
                    out,
                    shape,
                    &options,
                )?;
            }
            Pass::Decode { .. } => {
                // The canvases' K and V, rounded once for caches of f16 rows (attention reads
                // one storage for both segments).
                let rounded = match &s.kv16 {
                    Some((k16, v16)) => {
                        pack_f16_rows(step, &s.k, kv_w, k16, kv_w, 0, (t, kv_w))?;
                        pack_f16_rows(step, &s.v, kv_w, v16, kv_w, 0, (t, kv_w))?;
                        Some((view(k16, &[t, kv_w]), view(v16, &[t, kv_w])))
                    }
                    None => None,
                };
                let (k_rows, v_rows) = match &rounded {
                    Some((k, v)) => (k, v),
                    None => (&s.k, &s.v),
                };
                for span in spans {
                    let cache = span.cache;
                    let p0 = cache.len;
                    let lo = lowest(p0);
                    let cached = KvSegment {
                        k: &cache.k[l],
                        v: &cache.v[l],
                        start: cache.row(&a, lo),
                        len: p0 - lo,
                    };
                    let canvas = KvSegment {
                        k: k_rows,
                        v: v_rows,
                        start: span.rows.start,
                        len: span.rows.len(),
                    };
                    attention_with(
                        step,
                        &s.q,
                        q_stride,
                        0,
                        span.rows.clone(),
                        Some(cached),
                        canvas,
                        &s.attn,
                        shape,
                        &options,
                    )?;
                }
            }
        }
        Ok(())
    }
}
