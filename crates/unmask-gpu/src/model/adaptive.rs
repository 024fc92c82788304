//! dLLM-Cache's step on the GPU (`unmask_core::adaptive`): per layer, QKV of every pass
//! row; V-verify of each verifying sequence's response (cosine against the cached V, the
//! rows of lowest cosine appended to the compute list, every new V stored); the compute
//! list's rows gathered, rotated, attended and projected; their outputs scattered over the
//! cached ones of the response; the residual added for every row. The same for the MLP.
//! The list is an index buffer the GPU completes: nothing is read back inside the step.
//!
//! A pass row's delta (`AdaptiveRows::delta`) is its attention (then MLP) output of this
//! forward: fresh for the rows computed, the cache's for the response rows that are not.
//! After the scatter the response rows of the delta are the new cache.

use unmask_core::adaptive::{AdaptivePass, ResponseRefresh, ShallowLayout, VerifyPick};
use unmask_core::step_plan::{SeqWindow, StepPlan};

use super::ModelError;
use super::forward::{ForwardState, Model};
use super::plan::SharedPrefix;
use crate::ops::attention::KvSegment;
use crate::ops::elementwise::{self as ew, RowWindow};
use crate::ops::matmul::{self, Fusion};
use crate::ops::v_verify::{QkvLayout, VVerify, VerifyBuffers, VerifyRows};
use crate::step::StepEncoder;
use crate::tensor::{DType, Tensor};

/// The scratch of adaptive steps of up to `capacity` pass rows: the compute list and the
/// computed rows gathered from the pass, their outputs, and every pass row's delta.
pub struct AdaptiveRows {
    pub capacity: usize,
    list: Tensor,
    /// The shallow layers' list and arena rows under a shared prefix.
    list_shallow: Tensor,
    kv_rows_shallow: Tensor,
    positions: Tensor,
    kv_rows: Tensor,
    qkv: Tensor,
    x: Tensor,
    out: Tensor,
    delta: Tensor,
    verify: VVerify,
    /// Each layer's compute list, kept for a read-back of the rows V-verify picked.
    picks: Tensor,
}

/// What an adaptive forward hands back: the hidden rows the plan's sampled rows index
/// into, and the read-back slot of every layer's compute list when asked for.
pub struct AdaptiveOutput<'s> {
    pub hidden: &'s Tensor,
    /// `n_layers` lists of the pass's compute-list length, one after the other (u32).
    pub picks: Option<usize>,
}

/// One sequence's dLLM-Cache features: per layer, the attention output and the MLP output
/// of each response row (rows in response order).
pub struct AdaptiveCache {
    pub rows: usize,
    layers: Vec<[Tensor; 2]>,
}

/// One adaptive forward: the plan of its rows (without a shared prefix: its arena rows
/// are the deep layers'), their tokens, the adaptive layout, each sequence's cache, and the
/// shared prefix entry with the shallow layout when the sequences share one.
#[derive(Clone, Copy)]
pub struct AdaptiveInput<'a> {
    pub plan: &'a StepPlan,
    pub ids: &'a [u32],
    pub pass: &'a AdaptivePass,
    pub caches: &'a [&'a AdaptiveCache],
    pub shared: Option<AdaptiveShared<'a>>,
    pub record_picks: bool,
}

/// BiCache under dLLM-Cache: the entry the shallow layers read and their layout.
#[derive(Clone, Copy)]
pub struct AdaptiveShared<'a> {
    pub prefix: SharedPrefix<'a>,
    pub layout: &'a ShallowLayout,
}

/// What one layer runs: its compute list (on the GPU and its length), each sequence's
/// first verified slot in it, the windows of its computed rows and its arena rows.
struct Layout<'a> {
    list: &'a Tensor,
    cn: usize,
    bases: &'a [usize],
    windows: &'a [SeqWindow],
    kv_rows: &'a Tensor,
    /// The list is every pass row in order: no gathers or scatters.
    identity: bool,
}

/// Which cached output a merge handles.
#[derive(Clone, Copy)]
enum Feature {
    Attention = 0,
    Mlp = 1,
}

impl Model {
    /// Scratch for adaptive steps of up to `capacity` pass rows.
    pub fn new_adaptive_rows(&self, capacity: usize) -> Result<AdaptiveRows, ModelError> {
        let cap = capacity.max(1);
        let ctx = &self.ctx;
        let d = self.cfg.d_model;
        let f32t = |cols: usize, label: &str| Tensor::zeros(ctx, DType::F32, &[cap, cols], label);
        let u32t = |label: &str| Tensor::zeros(ctx, DType::U32, &[cap], label);
        Ok(AdaptiveRows {
            capacity: cap,
            list: u32t("adaptive compute list")?,
            list_shallow: u32t("adaptive shallow compute list")?,
            kv_rows_shallow: u32t("adaptive shallow kv rows")?,
            positions: u32t("adaptive positions")?,
            kv_rows: u32t("adaptive kv rows")?,
            qkv: f32t(self.qkv_width(), "adaptive qkv")?,
            x: f32t(d, "adaptive x")?,
            out: f32t(d, "adaptive out")?,
            delta: f32t(d, "adaptive delta")?,
            verify: VVerify::new(ctx, cap)?,
            picks: Tensor::zeros(
                ctx,
                DType::U32,
                &[self.cfg.n_layers * cap],
                "adaptive picks",
            )?,
        })
    }

    /// Bytes of one sequence's cache for `response_rows` response rows.
    pub fn adaptive_cache_bytes(&self, response_rows: usize) -> u64 {
        (2 * self.cfg.n_layers * response_rows.max(1) * self.cfg.d_model * 4) as u64
    }

    /// A zeroed cache for a response of `response_rows` rows (filled by its first forward,
    /// which refreshes everything).
    pub fn new_adaptive_cache(&self, response_rows: usize) -> Result<AdaptiveCache, ModelError> {
        let shape = [response_rows.max(1), self.cfg.d_model];
        let layers = (0..self.cfg.n_layers)
            .map(|li| {
                let t = |what: &str| {
                    Tensor::zeros(&self.ctx, DType::F32, &shape, &format!("layer {li} {what}"))
                };
                Ok([t("cached attention")?, t("cached mlp")?])
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(AdaptiveCache {
            rows: response_rows,
            layers,
        })
    }

    /// Writes the plan's rows and records one adaptive forward over them (`input.pass`,
    /// from the plan), sequence i reading and updating `input.caches[i]`; under a shared
    /// prefix the layers below its depth run the shallow layout against the entry. With
    /// `record_picks` every layer's verified rows are read back (in the deep list's slots).
    pub fn encode_adaptive<'s>(
        &self,
        step: &mut StepEncoder,
        st: &'s ForwardState,
        rows: &AdaptiveRows,
        input: AdaptiveInput<'_>,
    ) -> Result<AdaptiveOutput<'s>, ModelError> {
        let AdaptiveInput {
            plan,
            ids,
            pass,
            caches,
            shared,
            record_picks,
        } = input;
        let c = &self.cfg;
        let n = pass.rows;
        let fits = plan.n_layers == c.n_layers
            && !plan.shared_prefix
            && plan.shallow.len() == n
            && n <= st.capacity.min(rows.capacity)
            && caches.len() == pass.members.len()
            && caches
                .iter()
                .zip(&pass.members)
                .all(|(cache, m)| cache.rows == m.response.len())
            && shared.is_none_or(|s| {
                s.layout.kv_rows.len() == n
                    && s.layout.list_base.len() == pass.members.len()
                    && s.layout.depth <= c.n_layers
                    && s.prefix.kv.len() >= s.layout.depth
            });
        if !fits {
            return Err(ModelError::Input(format!(
                "an adaptive step of {n} rows over {} sequences (caches of {:?} rows) for a \
                 plan of {} rows over {} layers, a state of {} rows and scratch of {}",
                pass.members.len(),
                caches.iter().map(|c| c.rows).collect::<Vec<_>>(),
                plan.shallow.len(),
                plan.n_layers,
                st.capacity,
                rows.capacity
            )));
        }
        self.write_rows(st, ids, &plan.shallow.positions)?;
        st.kv_rows.write_u32(&self.ctx, &plan.shallow.kv_rows)?;
        let identity = pass.is_identity() && shared.is_none();
        let deep_bases: Vec<usize> = pass.members.iter().map(|m| m.list_base).collect();
        let deep = Layout {
            list: &rows.list,
            cn: pass.list.len(),
            bases: &deep_bases,
            windows: &pass.windows,
            kv_rows: &st.kv_rows,
            identity,
        };
        if !identity && deep.cn > 0 {
            rows.list.write_u32(&self.ctx, &pass.list)?;
        }
        let shallow = match shared {
            Some(s) => {
                rows.kv_rows_shallow
                    .write_u32(&self.ctx, &s.layout.kv_rows)?;
                if !s.layout.list.is_empty() {
                    rows.list_shallow.write_u32(&self.ctx, &s.layout.list)?;
                }
                Some(Layout {
                    list: &rows.list_shallow,
                    cn: s.layout.list.len(),
                    bases: &s.layout.list_base,
                    windows: &s.layout.windows,
                    kv_rows: &rows.kv_rows_shallow,
                    identity: false,
                })
            }
            None => None,
        };
        self.encode_embed(step, st, n)?;
        let done = |picks| AdaptiveOutput {
            hidden: &st.x,
            picks,
        };
        if n == 0 {
            return Ok(done(None));
        }
        let (d, qkv_w) = (c.d_model, self.qkv_width());
        let eps = c.rms_norm_eps as f32;
        let k = &self.kernels;
        let qkv_layout = QkvLayout {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim(),
        };
        let window = |stride| RowWindow { stride, col: 0 };
        let list_bytes = (deep.cn * 4) as u64;
        let row_bytes = (d * 4) as u64;
        let verifies = pass.verifies();
        for li in 0..c.n_layers {
            step.set_layer(Some(li));
            let lw = &self.weights.layers[li];
            let arena = &st.kv[li];
            let (lay, seg_a) = match (shared, &shallow) {
                (Some(s), Some(sh)) if li < s.layout.depth => {
                    let kv = &s.prefix.kv[li];
                    (sh, Some(KvSegment::first(&kv.k, &kv.v, s.prefix.tokens)))
                }
                _ => (&deep, None),
            };
            // The prefix rows of sequences that refresh their prompt enter the deep layers
            // from the entry's boundary state.
            if let Some(s) = shared.filter(|s| li == s.layout.depth) {
                let bytes = s.layout.prefix_len as u64 * row_bytes;
                for &row in &s.layout.boundary {
                    let at = row as u64 * row_bytes;
                    step.copy(&s.prefix.boundary.buffer, 0, &st.x.buffer, at, bytes);
                }
            }
            let cn = lay.cn;
            let gather = |step: &mut StepEncoder, src: &Tensor, dst: &Tensor, cols: usize| {
                ew::gather_rows(
                    step,
                    src,
                    window(cols),
                    lay.list,
                    dst,
                    window(cols),
                    cn,
                    cols,
                )
            };
            if cn > 0 || verifies {
                let norm = Fusion {
                    norm: Some((&lw.attn_norm, eps)),
                    ..Fusion::default()
                };
                matmul::matmul_fused(step, &st.x, &lw.qkv, &st.qkv, n, k, norm)?;
            }
            for (m, &list_base) in pass.members.iter().zip(lay.bases) {
                if let ResponseRefresh::Verify { recompute } = m.refresh {
                    let buffers = VerifyBuffers {
                        qkv: &st.qkv,
                        bias: lw.qkv_bias.as_ref(),
                        v: &arena.v,
                        arena_rows: lay.kv_rows,
                        list: lay.list,
                    };
                    let checked = VerifyRows {
                        row0: m.response.start,
                        rows: m.response.len(),
                        k: recompute,
                        list_base,
                        most_similar: m.pick == VerifyPick::HighestCosine,
                        skip: m.skip.clone(),
                    };
                    rows.verify.encode(step, buffers, checked, qkv_layout)?;
                    if record_picks {
                        // Into the deep list's slots, whichever list the layer used.
                        let (at, from) = (li as u64 * list_bytes, m.list_base as u64 * 4);
                        let to = at + from;
                        step.copy(
                            &lay.list.buffer,
                            list_base as u64 * 4,
                            &rows.picks.buffer,
                            to,
                            recompute as u64 * 4,
                        );
                    }
                }
            }
            let out = if lay.identity { &rows.delta } else { &rows.out };
            if cn > 0 {
                let (qkv, positions, kv_rows) = if lay.identity {
                    (&st.qkv, &st.positions, &st.kv_rows)
                } else {
                    gather(step, &st.qkv, &rows.qkv, qkv_w)?;
                    gather(step, &st.positions, &rows.positions, 1)?;
                    gather(step, lay.kv_rows, &rows.kv_rows, 1)?;
                    (&rows.qkv, &rows.positions, &rows.kv_rows)
                };
                self.encode_rope_qkv(step, li, qkv, positions, kv_rows, arena, cn)?;
                self.encode_attention(step, st, qkv, lay.windows, seg_a, arena)?;
                matmul::matmul(step, &st.attn, &lw.attn_out, out, cn, k)?;
            }
            self.merge(step, rows, pass, caches, (li, Feature::Attention), lay)?;
            ew::add_in_place(step, &st.x, &rows.delta, n * d)?;
            if cn > 0 {
                let x = if lay.identity {
                    &st.x
                } else {
                    gather(step, &st.x, &rows.x, d)?;
                    &rows.x
                };
                let mlp_in = Fusion {
                    norm: Some((&lw.ff_norm, eps)),
                    swiglu: true,
                    ..Fusion::default()
                };
                matmul::matmul_fused(step, x, &lw.gate_up, &st.act, cn, k, mlp_in)?;
                matmul::matmul(step, &st.act, &lw.down, out, cn, k)?;
            }
            self.merge(step, rows, pass, caches, (li, Feature::Mlp), lay)?;
            ew::add_in_place(step, &st.x, &rows.delta, n * d)?;
        }
        step.set_layer(None);
        let picks = (record_picks && verifies)
            .then(|| step.read_back(&rows.picks.buffer, 0, c.n_layers as u64 * list_bytes));
        Ok(done(picks))
    }

    /// Completes the delta of one feature of a layer: the cached outputs of the response
    /// rows not refreshed, overwritten by the computed rows' (scattered through the
    /// layer's list); the response rows of the result become the cache.
    fn merge(
        &self,
        step: &mut StepEncoder,
        rows: &AdaptiveRows,
        pass: &AdaptivePass,
        caches: &[&AdaptiveCache],
        (li, feature): (usize, Feature),
        lay: &Layout<'_>,
    ) -> Result<(), ModelError> {
        let d = self.cfg.d_model;
        let row_bytes = (d * 4) as u64;
        let delta = &rows.delta.buffer;
        for (m, cache) in pass.members.iter().zip(caches) {
            if m.refresh != ResponseRefresh::Full {
                let cached = &cache.layers[li][feature as usize].buffer;
                let at = m.response.start as u64 * row_bytes;
                step.copy(cached, 0, delta, at, m.response.len() as u64 * row_bytes);
            }
        }
        if !lay.identity && lay.cn > 0 {
            let window = RowWindow { stride: d, col: 0 };
            ew::scatter_rows(
                step,
                (&rows.out, window),
                lay.list,
                (&rows.delta, window),
                (lay.cn, d),
            )?;
        }
        for (m, cache) in pass.members.iter().zip(caches) {
            let cached = &cache.layers[li][feature as usize].buffer;
            let at = m.response.start as u64 * row_bytes;
            step.copy(delta, at, cached, 0, m.response.len() as u64 * row_bytes);
        }
        Ok(())
    }
}
