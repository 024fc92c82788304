//! The executor of a step plan (`unmask_core::step_plan`): any cache mode, any batch, the
//! same code. It writes the plan's row data, then records the embedding, the shallow pass,
//! the row copies into the deep pass and the deep pass into the step.

use unmask_core::step_plan::{Output, RowCopy, StepPlan};

use super::ModelError;
use super::forward::{ForwardState, KvLayer, LayerPass, Model};
use crate::ops::acache::{AnchorProbe, ProbeShape};
use crate::step::StepEncoder;
use crate::tensor::{DType, Tensor};

/// The deep pass's rows of a plan that reads a shared prefix: hidden rows (the prefix's
/// boundary state on a refresh, then the shallow output), their positions and arena rows.
/// Only requests that share a prefix allocate them.
pub struct DeepRows {
    pub capacity: usize,
    pub x: Tensor,
    positions: Tensor,
    kv_rows: Tensor,
}

/// The buffers a plan reads and writes beyond its state: the shared prefix entry its
/// shallow layers read as segment A; and, building an entry, the entry's own arena for
/// its K/V and the hidden rows after `depth` layers (the BiCache boundary state).
#[derive(Clone, Copy, Default)]
pub struct PlanBuffers<'a> {
    /// Segment A of the shallow layers, for a plan that reads a shared prefix.
    pub prefix: Option<SharedPrefix<'a>>,
    /// The arena the computed rows' K/V go to (default: the state's).
    pub arena: Option<&'a [KvLayer]>,
    /// After this many layers the hidden rows are copied into the tensor.
    pub boundary: Option<(usize, &'a Tensor)>,
    /// Stop at the boundary: the layers above it do not run.
    pub stop_at_boundary: bool,
    /// ACache's probe: the pass sums its masked rows' attention over a span's keys and
    /// ends by choosing the anchors (plans without deep layers only).
    pub probe: Option<&'a AnchorProbe>,
}

/// The shared prefix entry a plan's shallow layers read as segment A.
#[derive(Clone, Copy)]
pub struct SharedPrefix<'a> {
    /// K/V of every layer for the prefix's positions.
    pub kv: &'a [KvLayer],
    pub tokens: usize,
    /// Hidden state of the prefix rows after layer `depth - 1` (copied in on refresh).
    pub boundary: &'a Tensor,
}

impl Model {
    /// Deep-pass rows for plans of up to `capacity` deep rows.
    pub fn new_deep_rows(&self, capacity: usize) -> Result<DeepRows, ModelError> {
        let cap = capacity.max(1);
        let ctx = &self.ctx;
        Ok(DeepRows {
            capacity: cap,
            x: Tensor::zeros(ctx, DType::F32, &[cap, self.cfg.d_model], "x deep")?,
            positions: Tensor::zeros(ctx, DType::U32, &[cap], "positions deep")?,
            kv_rows: Tensor::zeros(ctx, DType::U32, &[cap], "kv rows deep")?,
        })
    }

    /// Writes `plan`'s rows (`ids` are the tokens of its shallow rows, in order) and records
    /// its passes into `step`, reading and writing `buffers` beyond the state. Returns the
    /// hidden rows the plan's sampled rows index into.
    pub fn encode_plan<'s>(
        &self,
        step: &mut StepEncoder,
        st: &'s ForwardState,
        deep: Option<&'s DeepRows>,
        plan: &StepPlan,
        ids: &[u32],
        buffers: PlanBuffers<'_>,
    ) -> Result<&'s Tensor, ModelError> {
        let (prefix, targets) = (buffers.prefix, buffers);
        let c = &self.cfg;
        if plan.n_layers != c.n_layers {
            return Err(ModelError::Input(format!(
                "a step plan over {} layers for a model of {}",
                plan.n_layers, c.n_layers
            )));
        }
        let rows = plan.shallow.len();
        self.write_rows(st, ids, &plan.shallow.positions)?;
        st.kv_rows.write_u32(&self.ctx, &plan.shallow.kv_rows)?;
        let seg_a = match (plan.shared_prefix, prefix) {
            (false, _) => None,
            (true, Some(p)) => Some(p),
            (true, None) => {
                return Err(ModelError::Input(
                    "a plan that reads a shared prefix, run without one".into(),
                ));
            }
        };
        if (targets.arena.is_some() || targets.boundary.is_some() || targets.probe.is_some())
            && plan.output == Output::Deep
        {
            return Err(ModelError::Input(
                "a plan with deep layers cannot send its outputs elsewhere".into(),
            ));
        }
        let arena = targets.arena.unwrap_or(&st.kv);
        let shallow = |layers: std::ops::Range<usize>| LayerPass {
            x: &st.x,
            rows,
            positions: &st.positions,
            kv_index: &st.kv_rows,
            layers,
            arena,
            seqs: &plan.shallow.windows,
            seg_a: seg_a.map(|p| (p.kv, p.tokens)),
            probe: targets.probe,
        };
        self.encode_embed(step, st, rows)?;
        match targets.boundary {
            None => self.encode_pass(step, st, &shallow(0..plan.depth))?,
            Some((b, boundary)) => {
                let b = b.min(plan.depth);
                self.encode_pass(step, st, &shallow(0..b))?;
                let bytes = (rows * c.d_model * 4) as u64;
                if bytes > boundary.size_bytes() {
                    return Err(ModelError::Input(format!(
                        "{rows} boundary rows for a boundary tensor of {} bytes",
                        boundary.size_bytes()
                    )));
                }
                step.copy(&st.x.buffer, 0, &boundary.buffer, 0, bytes);
                if !targets.stop_at_boundary {
                    self.encode_pass(step, st, &shallow(b..plan.depth))?;
                }
            }
        }
        if let Some(probe) = targets.probe {
            let shape = ProbeShape {
                n_heads: c.n_heads,
                n_kv_heads: c.n_kv_heads,
                head_dim: c.head_dim(),
            };
            probe.encode_select(step, &st.qkv, &arena[0].k, shape)?;
        }
        let Some(prefix) = seg_a.filter(|_| plan.output == Output::Deep) else {
            return Ok(&st.x);
        };
        let deep = deep.ok_or_else(|| {
            ModelError::Input("a plan with deep layers, run without deep rows".into())
        })?;
        let deep_n = plan.deep.len();
        if deep_n > deep.capacity {
            return Err(ModelError::Input(format!(
                "{deep_n} deep rows for deep buffers of {}",
                deep.capacity
            )));
        }
        deep.positions.write_u32(&self.ctx, &plan.deep.positions)?;
        deep.kv_rows.write_u32(&self.ctx, &plan.deep.kv_rows)?;
        let row_bytes = (c.d_model * 4) as u64;
        for copy in &plan.copies {
            let (src, src_row, dst, rows) = match *copy {
                RowCopy::Boundary { dst, rows } => (&prefix.boundary.buffer, 0, dst, rows),
                RowCopy::Shallow { src, dst, rows } => (&st.x.buffer, src, dst, rows),
            };
            step.copy(
                src,
                src_row as u64 * row_bytes,
                &deep.x.buffer,
                dst as u64 * row_bytes,
                rows as u64 * row_bytes,
            );
        }
        self.encode_pass(
            step,
            st,
            &LayerPass {
                x: &deep.x,
                rows: deep_n,
                positions: &deep.positions,
                kv_index: &deep.kv_rows,
                layers: plan.depth..c.n_layers,
                arena: &st.kv,
                seqs: &plan.deep.windows,
                seg_a: None,
                probe: None,
            },
        )?;
        Ok(match plan.output {
            Output::Deep => &deep.x,
            Output::Shallow => &st.x,
        })
    }
}
