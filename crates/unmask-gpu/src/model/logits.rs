//! Logits read back whole, for parity checks and likelihood scoring: one forward pass over
//! one or more sequences (each attending to itself alone), then the final norm and the LM
//! head on the asked rows only, gathered on the GPU. The generation path never comes here:
//! it reads back one (token, confidence) per sampled row (`select.rs`). The read-backs are
//! awaited (`*_async`, the browser's way); native callers have blocking wrappers.

use unmask_core::step_plan::{SeqStep, StepPlan};

use super::ModelError;
use super::forward::{ForwardState, Model};

use crate::ops::matmul;
use crate::step::StepEncoder;
use crate::tensor::{DType, Tensor};

/// The buffers of `Model::logits_batch`: activations and K/V arenas for passes of up to
/// `capacity` rows in all. Made once and used by every pass that fits, as each pass
/// rewrites every row it reads.
pub struct LogitsState {
    forward: ForwardState,
}

impl LogitsState {
    /// Rows (the positions of all of a pass's sequences together) one pass may hold.
    pub fn capacity(&self) -> usize {
        self.forward.capacity
    }
}

/// One sequence of a scoring pass, and the rows whose logits are read back (in that order).
#[derive(Clone, Copy, Debug)]
pub struct ScoredSeq<'a> {
    pub ids: &'a [u32],
    pub rows: &'a [usize],
}

impl Model {
    /// The full logits `[ids.len(), embedding_size]` of one forward pass over `ids`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn logits(&self, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        let rows: Vec<usize> = (0..ids.len()).collect();
        self.logits_at(ids, &rows)
    }

    /// The full logits `[rows.len(), embedding_size]` of the positions `rows` (in that
    /// order) after one forward pass over `ids`: scoring a few positions of a long sequence
    /// reads back a few vocabulary rows.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn logits_at(&self, ids: &[u32], rows: &[usize]) -> Result<Vec<f32>, ModelError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let state = self.logits_state(ids.len())?;
        let mut out = self.logits_batch(&state, &[ScoredSeq { ids, rows }])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Buffers for passes of up to `rows` rows (refused whole when over the memory budget).
    pub fn logits_state(&self, rows: usize) -> Result<LogitsState, ModelError> {
        Ok(LogitsState {
            forward: self.new_batch_state(rows, rows)?,
        })
    }

    /// One forward pass over every sequence of `seqs` (their K/V arenas one after the
    /// other in `state`), and per sequence the logits `[rows.len(), embedding_size]` of its
    /// `rows`. The sequences' lengths may differ; together they must fit `state`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn logits_batch(
        &self,
        state: &LogitsState,
        seqs: &[ScoredSeq<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        pollster::block_on(self.logits_batch_async(state, seqs))
    }

    /// `logits_batch`, awaiting the read-backs.
    pub async fn logits_batch_async(
        &self,
        state: &LogitsState,
        seqs: &[ScoredSeq<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let st = &state.forward;
        let total: usize = seqs.iter().map(|s| s.ids.len()).sum();
        if total > st.capacity {
            return Err(ModelError::Input(format!(
                "a scoring pass of {total} rows in buffers made for {}",
                st.capacity
            )));
        }
        let mut steps = Vec::with_capacity(seqs.len());
        let mut ids = Vec::with_capacity(total);
        // Row of the pass's output for every asked row: the plan lays the sequences' rows
        // one after the other, each sequence's in position order.
        let mut index: Vec<u32> = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let t = s.ids.len();
            if t == 0 || t > self.cfg.max_sequence_length {
                return Err(ModelError::Input(format!(
                    "scored sequence {i} of {t} positions: expected 1 to max_sequence_length {}",
                    self.cfg.max_sequence_length
                )));
            }
            if let Some(&r) = s.rows.iter().find(|&&r| r >= t) {
                return Err(ModelError::Input(format!(
                    "logits at row {r} of scored sequence {i}: expected rows below its {t} \
                     positions"
                )));
            }
            let base = ids.len();
            index.extend(s.rows.iter().map(|&r| (base + r) as u32));
            steps.push(SeqStep {
                kv_base: base,
                ..SeqStep::whole(t)
            });
            ids.extend_from_slice(s.ids);
        }
        let mut out: Vec<Vec<f32>> = Vec::with_capacity(seqs.len());
        if index.is_empty() {
            out.resize(seqs.len(), Vec::new());
            return Ok(out);
        }
        let plan = StepPlan::alone(&steps, self.cfg.n_layers, false)
            .map_err(|e| ModelError::Input(e.to_string()))?;
        let mut step = StepEncoder::new(&self.ctx, "scoring pass");
        let hidden = self.encode_plan(&mut step, st, None, &plan, &ids, Default::default())?;
        step.submit()?;
        let logits = self.head_rows(hidden, &index).await?;
        let vocab = self.cfg.embedding_size;
        let mut rest = logits.as_slice();
        for s in seqs {
            let (mine, tail) = rest.split_at(s.rows.len() * vocab);
            out.push(mine.to_vec());
            rest = tail;
        }
        Ok(out)
    }

    /// The final norm and LM head of rows `index` of `hidden`: `[index.len(), vocab]`, in
    /// groups of rows whose logits chunk fits one binding.
    async fn head_rows(&self, hidden: &Tensor, index: &[u32]) -> Result<Vec<f32>, ModelError> {
        let d = self.cfg.d_model;
        let vocab = self.cfg.embedding_size;
        let head = &self.weights.lm_head;
        let widest = head.chunks.iter().map(|c| c.rows).max().unwrap_or(1).max(1);
        let group = ((self.ctx.features.max_binding_bytes / (4 * widest as u64)) as usize).max(1);
        let mut out = vec![0f32; index.len() * vocab];
        for (g, rows) in index.chunks(group).enumerate() {
            let n = rows.len();
            let row_index = Tensor::from_u32(&self.ctx, &[n], rows, "scored rows")?;
            let picked = Tensor::zeros(&self.ctx, DType::F32, &[n, d], "scored hidden")?;
            let normed = Tensor::zeros(&self.ctx, DType::F32, &[n, d], "final norm rows")?;
            let mut step = StepEncoder::new(&self.ctx, "final norm");
            self.encode_final_norm_rows(&mut step, hidden, &row_index, &picked, &normed, n)?;
            step.submit()?;
            let first = g * group;
            for (ci, chunk) in head.chunks.iter().enumerate() {
                let logits =
                    Tensor::zeros(&self.ctx, DType::F32, &[n, chunk.rows], "logits chunk")?;
                let mut step = StepEncoder::new(&self.ctx, "lm head");
                let view = head.chunk_view(ci);
                matmul::matmul(&mut step, &normed, &view, &logits, n, &self.kernels)?;
                step.submit()?;
                let part = logits.read_f32_async(&self.ctx).await?;
                for r in 0..n {
                    let at = (first + r) * vocab + chunk.row_start;
                    out[at..at + chunk.rows]
                        .copy_from_slice(&part[r * chunk.rows..(r + 1) * chunk.rows]);
                }
            }
        }
        Ok(out)
    }
}
