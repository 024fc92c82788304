//! BiCache in the engine: shared-prefix entries as persistent GPU buffers, and the
//! layer-partitioned denoising loop (DESIGN.md §3).
//!
//! Layers below the depth b compute only the non-prefix rows and read the prefix's K/V from
//! the shared entry (segment A); their own K/V go to arena row `position - P`. Layers from b
//! up compute the non-prefix rows against the request's arena, whose prefix rows hold the
//! deep-prefix K/V of the last refresh; a refresh step recomputes those prefix rows from the
//! entry's boundary state (the prefix-only hidden state after b layers).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use unmask_core::step_plan::{SeqStep, StepPlan};
use unmask_gpu::model::{ForwardState, KvLayer, Model, ModelError, PlanBuffers};
use unmask_gpu::{DType, StepEncoder, Tensor};

/// A shared prefix's K/V (after RoPE) for every layer, from a prefix-only pass, and the
/// boundary hidden states of the depths requests have used.
pub struct PrefixEntry {
    pub tokens: usize,
    pub kv: Vec<KvLayer>,
    boundaries: Mutex<HashMap<usize, Arc<Tensor>>>,
}

impl PrefixEntry {
    /// GPU bytes of the K/V; boundary states are counted by `boundary_bytes`.
    pub fn kv_bytes(&self) -> u64 {
        self.kv
            .iter()
            .map(|l| l.k.size_bytes() + l.v.size_bytes())
            .sum()
    }

    pub fn boundary_bytes(&self) -> u64 {
        self.boundaries
            .lock()
            .map(|b| b.values().map(|t| t.size_bytes()).sum())
            .unwrap_or(0)
    }

    pub fn boundary(&self, depth: usize) -> Option<Arc<Tensor>> {
        self.boundaries.lock().ok()?.get(&depth).cloned()
    }

    /// Keeps the boundary state of `depth` (its bytes already charged to the store).
    pub fn add_boundary(&self, depth: usize, boundary: Arc<Tensor>) {
        if let Ok(mut map) = self.boundaries.lock() {
            map.entry(depth).or_insert(boundary);
        }
    }

    /// A copy of the boundary state of `depth` (for tests and diagnostics).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_boundary(
        &self,
        model: &Model,
        depth: usize,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        pollster::block_on(self.read_boundary_async(model, depth))
    }

    pub async fn read_boundary_async(
        &self,
        model: &Model,
        depth: usize,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        match self.boundary(depth) {
            Some(t) => Ok(Some(t.read_f32_async(&model.ctx).await?)),
            None => Ok(None),
        }
    }
}

/// Bytes an entry of `tokens` prefix tokens takes for its K/V (in the model's K/V storage)
/// and, `with_boundary`, one f32 boundary state.
pub fn entry_bytes(model: &Model, tokens: usize, with_boundary: bool) -> u64 {
    let boundary = if with_boundary {
        tokens * model.cfg.d_model * 4
    } else {
        0
    };
    model.kv_bytes(tokens) + boundary as u64
}

/// Records a prefix-only pass over `prefix` into `step`: every row attends to the prefix
/// alone; K/V go to `arena` and the hidden rows after `depth` layers to `boundary`. Layers
/// above `depth` run only when `full` (building an entry's K/V).
#[allow(clippy::too_many_arguments)] // internal; every argument is a distinct buffer or size
fn encode_prefix_pass(
    model: &Model,
    step: &mut StepEncoder,
    st: &ForwardState,
    prefix: &[u32],
    arena: &[KvLayer],
    boundary: Option<(usize, &Tensor)>,
    full: bool,
) -> Result<(), ModelError> {
    let plan = StepPlan::alone(&[SeqStep::whole(prefix.len())], model.cfg.n_layers, false)
        .map_err(|e| ModelError::Input(e.to_string()))?;
    let buffers = PlanBuffers {
        prefix: None,
        arena: Some(arena),
        boundary,
        stop_at_boundary: !full,
        probe: None,
    };
    model.encode_plan(step, st, None, &plan, prefix, buffers)?;
    Ok(())
}

/// Builds a new entry for `prefix` (a BiCache prefix, or an ACache span): its K/V for every
/// layer from a pass over it alone, and the boundary state of `depth` when given.
pub fn build_entry(
    model: &Model,
    st: &ForwardState,
    prefix: &[u32],
    depth: Option<usize>,
) -> Result<PrefixEntry, ModelError> {
    let c = &model.cfg;
    let p = prefix.len();
    let kv = (0..c.n_layers)
        .map(|i| model.kv_layer(p, &format!("prefix layer {i}")))
        .collect::<Result<Vec<_>, _>>()?;
    let boundary = match depth {
        Some(d) => Some((
            d,
            Tensor::zeros(&model.ctx, DType::F32, &[p, c.d_model], "prefix boundary")?,
        )),
        None => None,
    };
    let mut step = StepEncoder::new(&model.ctx, "shared entry");
    let target = boundary.as_ref().map(|(d, t)| (*d, t));
    encode_prefix_pass(model, &mut step, st, prefix, &kv, target, true)?;
    step.submit()?;
    let mut boundaries = HashMap::new();
    if let Some((d, t)) = boundary {
        boundaries.insert(d, Arc::new(t));
    }
    Ok(PrefixEntry {
        tokens: p,
        kv,
        boundaries: Mutex::new(boundaries),
    })
}

/// The boundary state of `depth` for a stored prefix, computed anew; the caller decides
/// whether the entry keeps it (`PrefixEntry::add_boundary`). The pass writes its K/V into
/// the request's own arena, so the shared entry's K/V are never written after they are
/// built.
pub fn compute_boundary(
    model: &Model,
    st: &ForwardState,
    prefix: &[u32],
    depth: usize,
) -> Result<Arc<Tensor>, ModelError> {
    let p = prefix.len();
    let boundary = Tensor::zeros(
        &model.ctx,
        DType::F32,
        &[p, model.cfg.d_model],
        "prefix boundary",
    )?;
    let mut step = StepEncoder::new(&model.ctx, "bicache boundary");
    encode_prefix_pass(
        model,
        &mut step,
        st,
        prefix,
        &st.kv,
        Some((depth, &boundary)),
        false,
    )?;
    step.submit()?;
    Ok(Arc::new(boundary))
}
