//! The pieces of one layer that the forward pass (`encode_pass`) and dLLM-Cache's adaptive
//! step (`encode_adaptive`) both run over their own row sets: RoPE with the K/V write,
//! and attention per sequence window.

use super::ModelError;
use super::forward::{ForwardState, KvLayer, Model, SeqWindow};
use crate::ops::attention::{self, AttentionOptions, AttentionShape, KvSegment};
use crate::ops::elementwise::{self as ew, QkvShape};
use crate::step::StepEncoder;
use crate::tensor::Tensor;

impl Model {
    /// RoPE of `rows` QKV rows of layer `li`: q rotated in place, k rotated and v (each
    /// with the layer's bias) into arena rows `kv_index[r]`.
    #[allow(clippy::too_many_arguments)] // the buffers of one dispatch
    pub(crate) fn encode_rope_qkv(
        &self,
        step: &mut StepEncoder,
        li: usize,
        qkv: &Tensor,
        positions: &Tensor,
        kv_index: &Tensor,
        arena: &KvLayer,
        rows: usize,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        // Every state was made with `ensure_rope` over its positions.
        let rope = self.rope.read().unwrap_or_else(|e| e.into_inner());
        ew::rope_qkv(
            step,
            qkv,
            positions,
            &rope.table,
            kv_index,
            &arena.k,
            &arena.v,
            self.weights.layers[li].qkv_bias.as_ref(),
            QkvShape {
                rows,
                n_heads: c.n_heads,
                n_kv_heads: c.n_kv_heads,
                head_dim: c.head_dim(),
                max_pos: rope.rows,
            },
        )?;
        Ok(())
    }

    /// Attention of each window's QKV rows over segment A (when given) and the window's
    /// arena rows, into the same rows of `st`'s attention output.
    pub(crate) fn encode_attention(
        &self,
        step: &mut StepEncoder,
        st: &ForwardState,
        qkv: &Tensor,
        seqs: &[SeqWindow],
        seg_a: Option<KvSegment<'_>>,
        arena: &KvLayer,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let shape = AttentionShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim(),
        };
        let options = AttentionOptions {
            kernel: self.kernels.attention,
            tuner: Some(&self.kernels.tuner),
            scratch: st.attn_parts.as_ref(),
            ..AttentionOptions::default()
        };
        for w in seqs {
            let seg_b = KvSegment {
                k: &arena.k,
                v: &arena.v,
                start: w.kv_start,
                len: w.kv_len,
            };
            attention::attention_with(
                step,
                qkv,
                self.qkv_width(),
                0,
                w.rows.clone(),
                seg_a,
                seg_b,
                &st.attn,
                shape,
                &options,
            )?;
        }
        Ok(())
    }
}
