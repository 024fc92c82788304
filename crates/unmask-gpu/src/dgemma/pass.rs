//! One pass of the DiffusionGemma stack over `T` rows (§4 of the spec, op by op): embedding,
//! the decoder's self-conditioning input, every layer (attention, dense MLP and experts in
//! parallel, layer scalar), the final norm, the tied LM head and the soft-cap.

use std::ops::Range;

use unmask_core::config::LayerAttention;

use super::{DgemmaCache, DgemmaLayer, DgemmaModel};
use crate::context::GpuContext;
use crate::model::ModelError;
use crate::ops::activation::{gelu_tanh_gate, scale_in_place, softcap};
use crate::ops::attention::{AttentionShape, model_split_floats};
use crate::ops::elementwise::{add_in_place, embed, rms_norm};
use crate::ops::heads::{HeadLayout, Rotation, head_norm_rope};
use crate::ops::matmul::{Fusion, matmul, matmul_fused};
use crate::ops::moe::{ExpertScratch, ExpertShape, ExpertWeights, Route, moe_experts, moe_route};
use crate::ops::soft_embed::soft_embed;
use crate::step::StepEncoder;
use crate::tensor::{DType, Tensor};

/// Which pass runs.
#[derive(Clone, Copy, Debug)]
pub enum Pass<'a> {
    /// Encoder or commit: causal, appends the rows' K/V to the cache.
    Encode,
    /// Decoder: bidirectional over the rows, reads the cache, self-conditioned on the
    /// previous step when given.
    Decode {
        self_conditioning: SelfConditioning<'a>,
    },
}

/// The decoder's self-conditioning input.
#[derive(Clone, Copy, Debug)]
pub enum SelfConditioning<'a> {
    /// The first step of a canvas: none.
    None,
    /// The previous step's temperature-scaled logits `[T, V]` on the host.
    Logits(&'a [f32]),
    /// Their softmax `[T, V]` already on the GPU (`denoise_rows` writes it).
    Probs(&'a Tensor),
}

/// The buffers of one pass of `t` rows.
pub(super) struct Scratch {
    pub(super) x: Tensor,
    pub(super) a: Tensor,
    pub(super) b: Tensor,
    pub(super) h1: Tensor,
    pub(super) q: Tensor,
    pub(super) k: Tensor,
    pub(super) v: Tensor,
    /// The canvas's K and V rounded to f16, for a cache of f16 rows (attention reads one
    /// storage for both segments).
    pub(super) kv16: Option<(Tensor, Tensor)>,
    pub(super) attn: Tensor,
    /// Partial results of the split attention kernels (`None` where no split runs).
    pub(super) attn_parts: Option<Tensor>,
    pub(super) gate_up: Tensor,
    pub(super) act: Tensor,
    pub(super) router_logits: Tensor,
    pub(super) expert_ids: Tensor,
    pub(super) expert_weights: Tensor,
    pub(super) experts: ExpertScratch,
    pub(super) ids: Tensor,
    pub(super) positions: Tensor,
}

/// The rows of one sequence in a pass: its cache and which rows of the pass are its. An
/// encoder pass has one; a decoder step has one per canvas it denoises.
#[derive(Clone)]
pub(super) struct Span<'a> {
    pub cache: &'a DgemmaCache,
    pub rows: Range<usize>,
}

impl Scratch {
    /// For the pass of `ids` at `positions` (one per id), K/V kept in `kv_dtype`.
    pub(super) fn new(
        ctx: &GpuContext,
        m: &DgemmaModel,
        ids: &[u32],
        positions: &[u32],
        kv_dtype: DType,
    ) -> Result<Self, ModelError> {
        let c = &m.cfg;
        let t = ids.len();
        let d = c.hidden_size;
        let q_w = c
            .layers
            .iter()
            .map(|l| c.heads * l.head_dim)
            .max()
            .unwrap_or(1);
        let kv_w = c
            .layers
            .iter()
            .map(|l| l.kv_heads * l.head_dim)
            .max()
            .unwrap_or(1);
        let inter = c.intermediate_size;
        let f = |shape: &[usize], label: &str| Tensor::zeros(ctx, DType::F32, shape, label);
        let shape = ExpertShape {
            rows: t,
            experts: c.num_experts,
            top_k: c.top_k_experts,
            hidden: d,
            inter: c.moe_intermediate_size,
        };
        Ok(Self {
            x: f(&[t, d], "dgemma x")?,
            a: f(&[t, d], "dgemma a")?,
            b: f(&[t, d], "dgemma b")?,
            h1: f(&[t, d], "dgemma h1")?,
            q: f(&[t, q_w], "dgemma q")?,
            k: f(&[t, kv_w], "dgemma k")?,
            v: f(&[t, kv_w], "dgemma v")?,
            kv16: match kv_dtype {
                DType::F16 => Some((
                    Tensor::zeros(ctx, DType::F16, &[t, kv_w], "dgemma k f16")?,
                    Tensor::zeros(ctx, DType::F16, &[t, kv_w], "dgemma v f16")?,
                )),
                _ => None,
            },
            attn: f(&[t, q_w], "dgemma attention")?,
            attn_parts: match m.split_scratch_floats(ctx, t) {
                0 => None,
                n => Some(f(&[n], "dgemma attention split parts")?),
            },
            gate_up: f(&[t, 2 * inter], "dgemma gate|up")?,
            act: f(&[t, inter], "dgemma act")?,
            router_logits: f(&[t, c.num_experts], "dgemma router logits")?,
            expert_ids: Tensor::zeros(ctx, DType::U32, &[t, c.top_k_experts], "dgemma expert ids")?,
            expert_weights: f(&[t, c.top_k_experts], "dgemma expert weights")?,
            experts: ExpertScratch::new(ctx, shape)?,
            ids: Tensor::from_u32(ctx, &[t], ids, "dgemma ids")?,
            positions: Tensor::from_u32(ctx, &[t], positions, "dgemma positions")?,
        })
    }
}

impl DgemmaModel {
    /// f32 of the split attention's scratch for a pass of `rows` rows over any layer
    /// (`attention::model_split_floats`).
    fn split_scratch_floats(&self, ctx: &GpuContext, rows: usize) -> usize {
        let shapes: Vec<AttentionShape> = self
            .cfg
            .layers
            .iter()
            .map(|l| AttentionShape {
                n_heads: self.cfg.heads,
                n_kv_heads: l.kv_heads,
                head_dim: l.head_dim,
            })
            .collect();
        model_split_floats(ctx, self.kernels.attention, &shapes, rows)
    }

    pub(super) fn check_pass(
        &self,
        cache: &DgemmaCache,
        ids: &[u32],
        pass: Pass,
    ) -> Result<(), ModelError> {
        let t = ids.len();
        let v = self.cfg.vocab_size;
        if t == 0 {
            return Err(ModelError::Input(
                "tokens: expected at least one, found none".into(),
            ));
        }
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= v) {
            return Err(ModelError::Input(format!(
                "token id: expected below the vocabulary size {v}, found {bad}"
            )));
        }
        let p0 = cache.len;
        if matches!(pass, Pass::Encode) && t > cache.pass_rows {
            return Err(ModelError::Input(format!(
                "encoder pass: expected at most the cache's {} rows per pass, found {t}",
                cache.pass_rows
            )));
        }
        if p0 + t > cache.capacity {
            return Err(ModelError::Input(format!(
                "positions: {p0} cached + {t} new exceed the cache's {} positions",
                cache.capacity
            )));
        }
        let sc_len = match pass {
            Pass::Decode {
                self_conditioning: SelfConditioning::Logits(z),
            } => Some(z.len()),
            Pass::Decode {
                self_conditioning: SelfConditioning::Probs(p),
            } => Some(p.numel()),
            _ => None,
        };
        if let Some(n) = sc_len
            && n < t * v
        {
            return Err(ModelError::Input(format!(
                "self-conditioning: expected {t} x {v} values, found {n}"
            )));
        }
        Ok(())
    }

    /// Records and submits one pass; with `want_logits`, the logits tensor (not yet read).
    pub(super) fn submit(
        &self,
        ctx: &GpuContext,
        cache: &DgemmaCache,
        ids: &[u32],
        pass: Pass,
        want_logits: bool,
    ) -> Result<Option<Tensor>, ModelError> {
        self.check_pass(cache, ids, pass)?;
        let positions: Vec<u32> = (cache.len..cache.len + ids.len())
            .map(|p| p as u32)
            .collect();
        let s = Scratch::new(ctx, self, ids, &positions, cache.dtype)?;
        let mut step = StepEncoder::new(ctx, "diffusion gemma pass");
        let span = Span {
            cache,
            rows: 0..ids.len(),
        };
        self.record_pass(ctx, &mut step, &s, &[span], pass)?;
        let logits = if want_logits {
            Some(self.record_logits(ctx, &mut step, &s)?)
        } else {
            None
        };
        step.submit()?;
        Ok(logits)
    }

    /// The embedding, the decoder's input and every layer, over `s.x`.
    pub(super) fn record_pass(
        &self,
        ctx: &GpuContext,
        step: &mut StepEncoder,
        s: &Scratch,
        spans: &[Span],
        pass: Pass,
    ) -> Result<(), ModelError> {
        let t = s.x.shape[0];
        let w = &self.weights;
        embed(step, &s.ids, &w.embedding, &s.x, t)?;
        scale_in_place(step, &s.x, t * self.cfg.hidden_size, self.embed_scale())?;
        if let Pass::Decode { self_conditioning } = pass {
            self.decoder_input(ctx, step, s, self_conditioning)?;
        }
        for (l, layer) in w.layers.iter().enumerate() {
            step.set_layer(Some(l));
            self.layer(step, s, spans, l, layer, pass)?;
        }
        step.set_layer(None);
        Ok(())
    }

    /// The final norm, the tied LM head and the soft-cap: the logits `[T, V]` on the GPU.
    pub(super) fn record_logits(
        &self,
        ctx: &GpuContext,
        step: &mut StepEncoder,
        s: &Scratch,
    ) -> Result<Tensor, ModelError> {
        let (t, v) = (s.x.shape[0], self.cfg.vocab_size);
        let logits = Tensor::zeros(ctx, DType::F32, &[t, v], "dgemma logits")?;
        self.record_logits_into(step, s, &logits)?;
        Ok(logits)
    }

    /// `record_logits` into `logits` (`[T, V]` f32).
    pub(super) fn record_logits_into(
        &self,
        step: &mut StepEncoder,
        s: &Scratch,
        logits: &Tensor,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (t, d, v) = (s.x.shape[0], c.hidden_size, c.vocab_size);
        let w = &self.weights;
        rms_norm(step, &s.x, &w.final_norm, &s.a, t, d, c.rms_norm_eps as f32)?;
        matmul(step, &s.a, &w.embedding, logits, t, &self.kernels)?;
        softcap(step, logits, t * v, c.final_logit_softcapping as f32)?;
        Ok(())
    }

    /// The decoder's input (§4.1): `x = RMSNorm(e + MLP(RMSNorm_w(soft)))` with
    /// `soft = softmax(z) · E · sqrt(D)`, or `x = RMSNorm(e)` without self-conditioning (the
    /// MLP of zero is zero).
    fn decoder_input(
        &self,
        ctx: &GpuContext,
        step: &mut StepEncoder,
        s: &Scratch,
        self_conditioning: SelfConditioning,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (t, d, v, i) = (
            s.x.shape[0],
            c.hidden_size,
            c.vocab_size,
            c.intermediate_size,
        );
        let eps = c.rms_norm_eps as f32;
        let uploaded;
        let probs = match self_conditioning {
            SelfConditioning::None => None,
            SelfConditioning::Logits(z) => {
                let p = softmax_rows(&z[..t * v], v);
                uploaded = Tensor::from_f32(ctx, &[t, v], &p, "dgemma sc probs")?;
                Some(&uploaded)
            }
            SelfConditioning::Probs(p) => Some(p),
        };
        if let Some(probs) = probs {
            let sc = &self.weights.self_conditioning;
            let scale = self.embed_scale();
            soft_embed(step, probs, &self.weights.embedding, &s.a, t, scale)?;
            rms_norm(step, &s.a, &sc.pre_norm, &s.b, t, d, eps)?;
            matmul(step, &s.b, &sc.gate_up, &s.gate_up, t, &self.kernels)?;
            gelu_tanh_gate(step, &s.gate_up, &s.act, t, i)?;
            matmul(step, &s.act, &sc.down, &s.a, t, &self.kernels)?;
            add_in_place(step, &s.x, &s.a, t * d)?;
        }
        rms_norm(step, &s.x, &self.ones, &s.a, t, d, eps)?;
        copy(step, &s.a, &s.x, t * d);
        Ok(())
    }

    /// One layer (§4.5) on the residual rows `s.x`.
    fn layer(
        &self,
        step: &mut StepEncoder,
        s: &Scratch,
        spans: &[Span],
        l: usize,
        w: &DgemmaLayer,
        pass: Pass,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (t, d, i) = (s.x.shape[0], c.hidden_size, c.intermediate_size);
        let eps = c.rms_norm_eps as f32;
        let LayerAttention {
            sliding,
            head_dim: hd,
            kv_heads: kv,
        } = w.attention;
        let h = c.heads;
        let normed = |weight| Fusion {
            norm: Some((weight, eps)),
            ..Default::default()
        };
        let auto = &self.kernels;
        let (q, k, v, attn) = (
            view(&s.q, &[t, h * hd]),
            view(&s.k, &[t, kv * hd]),
            view(&s.v, &[t, kv * hd]),
            view(&s.attn, &[t, h * hd]),
        );
        // Attention (§4.4): q, k and v (full layers: v is the raw k projection).
        matmul_fused(step, &s.x, &w.q, &q, t, auto, normed(&w.input_norm))?;
        matmul_fused(step, &s.x, &w.k, &k, t, auto, normed(&w.input_norm))?;
        let v_proj = w.v.as_ref().unwrap_or(&w.k);
        matmul_fused(step, &s.x, v_proj, &v, t, auto, normed(&w.input_norm))?;
        let table = if sliding {
            &self.rope_sliding
        } else {
            &self.rope_full
        };
        let rotation = Rotation {
            positions: &s.positions,
            table,
            max_pos: self.max_positions,
        };
        let heads = |n| HeadLayout {
            rows: t,
            heads: n,
            head_dim: hd,
            row_stride: n * hd,
            col_offset: 0,
        };
        head_norm_rope(step, &q, &w.q_norm, Some(rotation), heads(h), eps)?;
        head_norm_rope(step, &k, &w.k_norm, Some(rotation), heads(kv), eps)?;
        head_norm_rope(step, &v, &self.ones, None, heads(kv), eps)?;
        self.attend(step, s, spans, l, w.attention, pass)?;
        matmul(step, &attn, &w.o, &s.a, t, auto)?;
        rms_norm(step, &s.a, &w.post_attention_norm, &s.b, t, d, eps)?;
        add_in_place(step, &s.x, &s.b, t * d)?;
        // Dense MLP and experts in parallel on differently normed copies of x (§4.5, §4.6).
        matmul_fused(
            step,
            &s.x,
            &w.mlp_gate_up,
            &s.gate_up,
            t,
            auto,
            normed(&w.pre_ff_norm),
        )?;
        gelu_tanh_gate(step, &s.gate_up, &s.act, t, i)?;
        matmul(step, &s.act, &w.mlp_down, &s.a, t, auto)?;
        rms_norm(step, &s.a, &w.post_ff_norm_1, &s.h1, t, d, eps)?;
        matmul_fused(
            step,
            &s.x,
            &w.router,
            &s.router_logits,
            t,
            auto,
            normed(&w.router_norm),
        )?;
        moe_route(
            step,
            &s.router_logits,
            &w.per_expert_scale,
            &s.expert_ids,
            &s.expert_weights,
            t,
            c.top_k_experts,
        )?;
        rms_norm(step, &s.x, &w.pre_ff_norm_2, &s.a, t, d, eps)?;
        let shape = ExpertShape {
            rows: t,
            experts: c.num_experts,
            top_k: c.top_k_experts,
            hidden: d,
            inter: c.moe_intermediate_size,
        };
        let route = Route {
            ids: &s.expert_ids,
            weights: &s.expert_weights,
        };
        let experts = ExpertWeights {
            gate_up: &w.experts_gate_up,
            down: &w.experts_down,
        };
        moe_experts(step, &s.a, route, experts, &s.b, &s.experts, shape)?;
        rms_norm(step, &s.b, &w.post_ff_norm_2, &s.a, t, d, eps)?;
        add_in_place(step, &s.h1, &s.a, t * d)?;
        rms_norm(step, &s.h1, &w.post_ff_norm, &s.a, t, d, eps)?;
        add_in_place(step, &s.x, &s.a, t * d)?;
        let scalar = match pass {
            Pass::Encode => w.encoder_scalar,
            Pass::Decode { .. } => w.decoder_scalar,
        };
        scale_in_place(step, &s.x, t * d, scalar)?;
        Ok(())
    }
}

/// The first `shape` elements of `t`'s buffer as a tensor of that shape: the q/k/v and
/// attention buffers are sized for the widest layer and read at each layer's width.
pub(super) fn view(t: &Tensor, shape: &[usize]) -> Tensor {
    Tensor {
        buffer: t.buffer.clone(),
        dtype: t.dtype,
        shape: shape.to_vec(),
    }
}

/// `dst[..n] = src[..n]` (f32).
fn copy(step: &mut StepEncoder, src: &Tensor, dst: &Tensor, n: usize) {
    step.copy(&src.buffer, 0, &dst.buffer, 0, (n * 4) as u64);
}

/// Softmax of every row of `v` values, in f32 like the reference (max subtracted).
fn softmax_rows(z: &[f32], v: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(z.len());
    for row in z.chunks_exact(v) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = row.iter().map(|&x| (x - max).exp()).collect();
        let sum: f32 = e.iter().sum();
        out.extend(e.iter().map(|x| x / sum));
    }
    out
}
