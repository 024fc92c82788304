//! The token choice of a step, recorded after the layers: gather the rows to sample →
//! final norm → LM head per vocabulary chunk → streaming argmax/confidence (with the
//! unconditional pass for classifier-free guidance). Only (token, confidence) per sampled
//! row is read back. (Logits read back whole, for parity and scoring: `logits.rs`.)

use std::sync::OnceLock;

use super::ModelError;
use super::forward::{ForwardState, Model};
use crate::ops::alternatives::{self, Chunk, MOST_ALTERNATIVES, TOP_STATE_WORDS};
use crate::ops::elementwise::{self as ew, RowWindow};
use crate::ops::logit_bias::{self, RowBiases};
use crate::ops::matmul;
use crate::ops::sampling::{self, SelectParams};
use crate::step::StepEncoder;
use crate::tensor::{DType, Tensor};

/// Buffers for the LM head and token choice over up to `capacity` sampled rows.
pub struct SelectBuffers {
    pub capacity: usize,
    /// Index of each sampled row within the step's computed rows.
    pub row_index: Tensor,
    /// Absolute position of each sampled row (the noise counter).
    pub positions: Tensor,
    hidden: Tensor,
    normed: Tensor,
    hidden_uncond: Tensor,
    normed_uncond: Tensor,
    logits: Tensor,
    logits_uncond: Tensor,
    state: Tensor,
    /// The best `SelectParams::top_logprobs` ids per row so far.
    top_state: Tensor,
    /// The choices (`OUT_WORDS` per row), then each row's alternatives (2 words each).
    pub out: Tensor,
    /// Whole logits rows for a top-p / top-k cut, made on first use.
    full: OnceLock<FullLogits>,
    max_group_rows: usize,
    /// The sampled rows' logit biases (`RowBiases::words`) and their rows, when the next
    /// select has any (`Model::write_logit_bias`); grown as lists grow.
    bias: Option<Tensor>,
    bias_rows: usize,
}

impl SelectBuffers {
    /// Caps the rows of one group of whole logits rows below what the binding limit
    /// allows (tests use it to run several groups); takes effect before the first cut.
    pub fn set_max_group_rows(&mut self, rows: usize) {
        self.max_group_rows = rows.max(1);
    }
}

/// The sampled rows' whole logits, in groups of rows that each fit one binding, and each
/// row's cut.
struct FullLogits {
    groups: Vec<RowGroup>,
    cut: Tensor,
}

struct RowGroup {
    first: usize,
    rows: usize,
    /// f32 `[rows, vocab]`.
    logits: Tensor,
    /// u32 `[rows]`: `first..first + rows`, the chunk rows this group copies.
    index: Tensor,
}

/// The token chosen for one row, its confidence (`SelectParams::confidence`) and, when
/// `SelectParams::logprob` asked for it, its log-probability under the model's softmax,
/// with the `SelectParams::top_logprobs` most likely ids and theirs.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenChoice {
    pub token: u32,
    pub confidence: f32,
    pub logprob: Option<f32>,
    pub alternatives: Vec<(u32, f32)>,
}

impl Model {
    pub fn new_select(&self, capacity: usize) -> Result<SelectBuffers, ModelError> {
        let ctx = &self.ctx;
        let cap = capacity.max(1);
        let d = self.cfg.d_model;
        let chunk_cols = self
            .weights
            .lm_head
            .chunks
            .iter()
            .map(|c| c.rows)
            .max()
            .unwrap_or(1);
        let f32t = |shape: &[usize], label: &str| Tensor::zeros(ctx, DType::F32, shape, label);
        Ok(SelectBuffers {
            capacity: cap,
            row_index: Tensor::zeros(ctx, DType::U32, &[cap], "select rows")?,
            positions: Tensor::zeros(ctx, DType::U32, &[cap], "select positions")?,
            hidden: f32t(&[cap, d], "select hidden")?,
            normed: f32t(&[cap, d], "select normed")?,
            hidden_uncond: f32t(&[cap, d], "select hidden uncond")?,
            normed_uncond: f32t(&[cap, d], "select normed uncond")?,
            logits: f32t(&[cap, chunk_cols], "logits")?,
            logits_uncond: f32t(&[cap, chunk_cols], "logits uncond")?,
            state: Tensor::zeros(ctx, DType::U32, &[sampling::state_len(cap)], "select state")?,
            top_state: Tensor::zeros(ctx, DType::U32, &[cap, TOP_STATE_WORDS], "top state")?,
            out: Tensor::zeros(
                ctx,
                DType::U32,
                &[cap, sampling::OUT_WORDS + TOP_STATE_WORDS],
                "select out",
            )?,
            full: OnceLock::new(),
            max_group_rows: usize::MAX,
            bias: None,
            bias_rows: 0,
        })
    }

    /// Vocabulary ids the LM head produces.
    pub(super) fn head_vocab(&self) -> usize {
        let head = &self.weights.lm_head;
        head.chunks.last().map_or(0, |c| c.row_start + c.rows)
    }

    /// Whole-row logits buffers for `sel` (allocated on the first cut: `capacity` rows of
    /// the whole vocabulary, in as few groups as the binding limit allows).
    fn full_logits<'a>(&self, sel: &'a SelectBuffers) -> Result<&'a FullLogits, ModelError> {
        if let Some(f) = sel.full.get() {
            return Ok(f);
        }
        let ctx = &self.ctx;
        let vocab = self.head_vocab();
        let row_bytes = 4 * vocab as u64;
        let limit = ctx.features.max_binding_bytes;
        if row_bytes > limit {
            return Err(ModelError::Input(format!(
                "top-p / top-k need one row of logits ({row_bytes} bytes) in one binding; \
                 this device binds at most {limit} bytes"
            )));
        }
        let per_group = ((limit / row_bytes) as usize)
            .min(sel.capacity)
            .min(sel.max_group_rows);
        let mut groups = Vec::new();
        for first in (0..sel.capacity).step_by(per_group) {
            let rows = per_group.min(sel.capacity - first);
            let index = Tensor::zeros(ctx, DType::U32, &[rows], "cut row index")?;
            let ids: Vec<u32> = (first as u32..(first + rows) as u32).collect();
            index.write_u32(ctx, &ids)?;
            groups.push(RowGroup {
                first,
                rows,
                logits: Tensor::zeros(ctx, DType::F32, &[rows, vocab], "whole logits")?,
                index,
            });
        }
        let cut = Tensor::zeros(ctx, DType::U32, &[sel.capacity], "cut")?;
        // Another caller may have filled it meanwhile; either value is equivalent.
        Ok(sel.full.get_or_init(|| FullLogits { groups, cut }))
    }

    /// Writes which computed rows are sampled and their absolute positions.
    pub fn write_select(
        &self,
        sel: &SelectBuffers,
        row_index: &[u32],
        positions: &[u32],
    ) -> Result<(), ModelError> {
        if row_index.len() != positions.len() || row_index.len() > sel.capacity {
            return Err(ModelError::Input(format!(
                "{} sampled rows for select buffers of {}",
                row_index.len(),
                sel.capacity
            )));
        }
        sel.row_index.write_u32(&self.ctx, row_index)?;
        sel.positions.write_u32(&self.ctx, positions)?;
        Ok(())
    }

    /// Sets the logit biases of the sampled rows (in `write_select`'s order) that the next
    /// selections add to their logits; a table without entries turns them off.
    pub fn write_logit_bias(
        &self,
        sel: &mut SelectBuffers,
        biases: &RowBiases,
    ) -> Result<(), ModelError> {
        // Penalty lists lengthen as the canvas fills: the table grows with them.
        let uploaded = logit_bias::upload_biases(&self.ctx, biases, &mut sel.bias, "logit bias")?;
        sel.bias_rows = if uploaded.is_some() { biases.rows() } else { 0 };
        Ok(())
    }

    /// The bias table when the next selection of `n` rows has one.
    fn bias_table<'a>(
        &self,
        sel: &'a SelectBuffers,
        n: usize,
    ) -> Result<Option<&'a Tensor>, ModelError> {
        match &sel.bias {
            Some(t) if sel.bias_rows > 0 => {
                if sel.bias_rows != n {
                    return Err(ModelError::Input(format!(
                        "logit biases for {} rows, selecting {n}",
                        sel.bias_rows
                    )));
                }
                Ok(Some(t))
            }
            _ => Ok(None),
        }
    }

    /// Records the final norm and LM head of the sampled rows and the token choice,
    /// combining with the unconditional pass for classifier-free guidance when given.
    pub fn encode_select(
        &self,
        step: &mut StepEncoder,
        cond: &ForwardState,
        uncond: Option<&ForwardState>,
        sel: &SelectBuffers,
        n: usize,
        params: &SelectParams,
    ) -> Result<(), ModelError> {
        self.encode_select_from(step, &cond.x, uncond.map(|u| &u.x), sel, n, params)
    }

    /// Rows `row_index` (`n` of them) of the hidden states `x`, gathered into `picked`,
    /// and their final RMSNorm into `normed`: what the LM head reads.
    pub(crate) fn encode_final_norm_rows(
        &self,
        step: &mut StepEncoder,
        x: &Tensor,
        row_index: &Tensor,
        picked: &Tensor,
        normed: &Tensor,
        n: usize,
    ) -> Result<(), ModelError> {
        let d = self.cfg.d_model;
        let full = RowWindow { stride: d, col: 0 };
        ew::gather_rows(step, x, full, row_index, picked, full, n, d)?;
        ew::rms_norm(
            step,
            picked,
            &self.weights.ln_f,
            normed,
            n,
            d,
            self.cfg.rms_norm_eps as f32,
        )?;
        Ok(())
    }

    /// `encode_select` over explicit hidden-state tensors (sampled rows index into them).
    pub fn encode_select_from(
        &self,
        step: &mut StepEncoder,
        cond_x: &Tensor,
        uncond_x: Option<&Tensor>,
        sel: &SelectBuffers,
        n: usize,
        params: &SelectParams,
    ) -> Result<(), ModelError> {
        let uncond = uncond_x;
        // Gather first: the final norm and LM head only run on the rows being sampled.
        self.encode_final_norm_rows(step, cond_x, &sel.row_index, &sel.hidden, &sel.normed, n)?;
        if let Some(u) = uncond {
            self.encode_final_norm_rows(
                step,
                u,
                &sel.row_index,
                &sel.hidden_uncond,
                &sel.normed_uncond,
                n,
            )?;
        }
        sampling::select_reset(step, &sel.state, n)?;
        let top = Self::alternatives(params);
        if top > 0 {
            alternatives::top_reset(step, &sel.top_state, n)?;
        }
        // A top-p / top-k cut needs whole rows: each chunk's logits are gathered into them,
        // then per group of rows the cut and one selection pass.
        let full = if params.cuts() {
            if uncond.is_some() {
                return Err(ModelError::Input(
                    "top-p / top-k with classifier-free guidance".into(),
                ));
            }
            Some(self.full_logits(sel)?)
        } else {
            None
        };
        let vocab = self.head_vocab();
        let bias = self.bias_table(sel, n)?;
        let groups: Vec<(&RowGroup, usize)> = full.map_or(Vec::new(), |f| {
            f.groups
                .iter()
                .filter(|g| g.first < n)
                .map(|g| (g, g.rows.min(n - g.first)))
                .collect()
        });
        let head = &self.weights.lm_head;
        for (ci, chunk) in head.chunks.iter().enumerate() {
            let part = head.chunk_view(ci);
            matmul::matmul(step, &sel.normed, &part, &sel.logits, n, &self.kernels)?;
            if let Some(table) = bias {
                logit_bias::add_logit_bias(
                    step,
                    &sel.logits,
                    n,
                    chunk.rows,
                    chunk.row_start,
                    table,
                )?;
            }
            if full.is_some() {
                for &(g, rows) in &groups {
                    let src = RowWindow {
                        stride: chunk.rows,
                        col: 0,
                    };
                    let dst = RowWindow {
                        stride: vocab,
                        col: chunk.row_start,
                    };
                    ew::gather_rows(
                        step,
                        &sel.logits,
                        src,
                        &g.index,
                        &g.logits,
                        dst,
                        rows,
                        chunk.rows,
                    )?;
                }
                continue;
            }
            let uncond_logits = if uncond.is_some() {
                matmul::matmul(
                    step,
                    &sel.normed_uncond,
                    &part,
                    &sel.logits_uncond,
                    n,
                    &self.kernels,
                )?;
                // Both passes take the bias, so guidance's combination carries it as it is.
                if let Some(table) = bias {
                    let (rows, at) = (chunk.rows, chunk.row_start);
                    logit_bias::add_logit_bias(step, &sel.logits_uncond, n, rows, at, table)?;
                }
                Some(&sel.logits_uncond)
            } else {
                None
            };
            sampling::select_accumulate(
                step,
                &sel.logits,
                uncond_logits,
                n,
                chunk.rows,
                chunk.row_start,
                &sel.positions,
                &sel.state,
                params,
            )?;
            if top > 0 {
                let at = Chunk {
                    rows: n,
                    n: chunk.rows,
                    vocab_offset: chunk.row_start,
                    row_base: 0,
                };
                let (logits, cfg) = (&sel.logits, params.cfg_scale);
                alternatives::top_accumulate(
                    step,
                    logits,
                    uncond_logits,
                    cfg,
                    at,
                    &sel.top_state,
                    top,
                )?;
            }
        }
        if let Some(f) = full {
            for &(g, rows) in &groups {
                let at = sampling::FullRows {
                    row_base: g.first,
                    cut: &f.cut,
                };
                sampling::select_threshold(step, &g.logits, rows, vocab, at, params)?;
                sampling::select_accumulate_cut(
                    step,
                    &g.logits,
                    rows,
                    vocab,
                    at,
                    &sel.positions,
                    &sel.state,
                    params,
                )?;
                if top > 0 {
                    let at = Chunk {
                        rows,
                        n: vocab,
                        vocab_offset: 0,
                        row_base: g.first,
                    };
                    alternatives::top_accumulate(
                        step,
                        &g.logits,
                        None,
                        0.0,
                        at,
                        &sel.top_state,
                        top,
                    )?;
                }
            }
        }
        sampling::select_finalize(step, &sel.state, &sel.out, n, params)?;
        if top > 0 {
            let base = n * sampling::OUT_WORDS;
            alternatives::top_finalize(step, &sel.top_state, &sel.state, &sel.out, base, n, top)?;
        }
        Ok(())
    }

    /// Asks the step to read back the choices of `n` sampled rows (12 bytes per row, and
    /// 8 per alternative of `params.top_logprobs`) in its own submit; `decode_choices`
    /// turns the bytes at the returned index into choices.
    pub fn read_back_choices(
        &self,
        step: &mut StepEncoder,
        sel: &SelectBuffers,
        n: usize,
        params: &SelectParams,
    ) -> usize {
        let words = n * (sampling::OUT_WORDS + 2 * Self::alternatives(params));
        step.read_back(&sel.out.buffer, 0, (4 * words) as u64)
    }

    fn alternatives(params: &SelectParams) -> usize {
        (params.top_logprobs as usize).min(MOST_ALTERNATIVES)
    }

    /// The choices in bytes read back by `read_back_choices` with the same `params`.
    pub fn decode_choices(bytes: &[u8], params: &SelectParams) -> Vec<TokenChoice> {
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(bytes);
        let top = Self::alternatives(params);
        let n = words.len() / (sampling::OUT_WORDS + 2 * top);
        let (choices, rest) = words.split_at(n * sampling::OUT_WORDS);
        let mut alternatives = alternatives::parse_alternatives(rest, top).into_iter();
        choices
            .chunks_exact(sampling::OUT_WORDS)
            .map(|w| TokenChoice {
                token: w[0],
                confidence: f32::from_bits(w[1]),
                logprob: Some(f32::from_bits(w[2])).filter(|l| !l.is_nan()),
                alternatives: alternatives.next().unwrap_or_default(),
            })
            .collect()
    }
}
