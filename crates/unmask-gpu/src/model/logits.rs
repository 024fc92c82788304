//! Logits for parity checks and likelihood scoring: one forward pass over one or more
//! sequences (each attending to itself alone), then the final norm and the LM head on the
//! asked rows only, gathered on the GPU, in groups of rows whose logits chunk fits one
//! binding. Either the logits come back whole (`logits_batch`), or each row's
//! cross-entropy at a given target is taken on the GPU and three floats a row come back
//! (`cross_entropy_batch`: at LLaDA-8B's vocabulary, 12 bytes where the row is 506 KB).
//! The generation path never comes here: it reads back one (token, confidence) per sampled
//! row (`select.rs`). The read-backs are awaited (`*_async`, the browser's way); native
//! callers have blocking wrappers.

use unmask_core::step_plan::{SeqStep, StepPlan};

use super::ModelError;
use super::forward::{ForwardState, Model};

use crate::context::GpuContext;
use crate::ops::cross_entropy::{self as ce, ChunkRows};
use crate::ops::matmul;
use crate::step::StepEncoder;
use crate::tensor::{DType, Tensor};

/// Logits of one LM-head group of rows (one vocabulary chunk's): at LLaDA-8B's vocabulary
/// about 530 rows, where the head's matmul is compute-bound on a large GPU, and a bound on
/// the head's buffers however many rows a pass scores.
const HEAD_GROUP_LOGITS_BYTES: u64 = 256 << 20;

/// The buffers of `Model::logits_batch` and `Model::cross_entropy_batch`: activations and
/// K/V arenas for passes of up to `capacity` rows in all, and the LM head's, grown to the
/// largest group of rows a pass has asked for. Made once and used by every pass that fits,
/// as each pass rewrites every row it reads.
pub struct LogitsState {
    forward: ForwardState,
    head: HeadBuffers,
}

impl LogitsState {
    /// Rows (the positions of all of a pass's sequences together) one pass may hold.
    pub fn capacity(&self) -> usize {
        self.forward.capacity
    }

    /// Runs the LM head on at most `rows` rows at a time (at least one), below what one
    /// binding allows: smaller head buffers for more submits.
    pub fn limit_head_rows(&mut self, rows: usize) {
        self.head.max_rows = Some(rows.max(1));
    }
}

/// One sequence of a scoring pass, and the rows whose logits are read back (in that order).
#[derive(Clone, Copy, Debug)]
pub struct ScoredSeq<'a> {
    pub ids: &'a [u32],
    pub rows: &'a [usize],
}

/// One sequence of a cross-entropy pass: the loss of `targets[k]` at row `rows[k]`. Under
/// guidance `uncond` is its unconditioned twin (as long as `ids`), whose same rows guide
/// the logits.
#[derive(Clone, Copy, Debug)]
pub struct TargetSeq<'a> {
    pub ids: &'a [u32],
    pub rows: &'a [usize],
    pub targets: &'a [u32],
    pub uncond: Option<&'a [u32]>,
}

/// The LM head's buffers for one group of rows: which rows of the hidden states, the rows
/// themselves, their final norm and one vocabulary chunk of their logits.
struct HeadRows {
    index: Tensor,
    picked: Tensor,
    normed: Tensor,
    logits: Tensor,
}

/// The LM head's buffers, each grown when a pass needs more (`grown`).
#[derive(Default)]
struct HeadBuffers {
    /// The caller's cap on rows a group (`LogitsState::limit_head_rows`).
    max_rows: Option<usize>,
    cond: Option<HeadRows>,
    uncond: Option<HeadRows>,
    /// Every scored row's target id and cross-entropy state (`ce::STATE_WORDS` f32 a row).
    targets: Option<Tensor>,
    stats: Option<Tensor>,
}

/// `slot`'s tensor when it holds at least `elems` elements, else a new one of `elems`.
fn grown<'s>(
    ctx: &GpuContext,
    slot: &'s mut Option<Tensor>,
    dtype: DType,
    elems: usize,
    label: &str,
) -> Result<&'s Tensor, ModelError> {
    if slot.as_ref().is_none_or(|t| t.numel() < elems) {
        *slot = None;
        *slot = Some(Tensor::zeros(ctx, dtype, &[elems.max(1)], label)?);
    }
    Ok(slot.as_ref().expect("just filled"))
}

/// A pass's sequences laid one after the other: their ids, their steps, and each one's
/// first row in the pass.
struct PassLayout {
    ids: Vec<u32>,
    steps: Vec<SeqStep>,
    bases: Vec<usize>,
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
        let mut state = self.logits_state(ids.len())?;
        let mut out = self.logits_batch(&mut state, &[ScoredSeq { ids, rows }])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Buffers for passes of up to `rows` rows (refused whole when over the memory budget).
    pub fn logits_state(&self, rows: usize) -> Result<LogitsState, ModelError> {
        Ok(LogitsState {
            forward: self.new_batch_state(rows, rows)?,
            head: HeadBuffers::default(),
        })
    }

    /// Makes `state`'s LM-head buffers for passes of up to `rows` scored rows (and their
    /// twins' when `guided`), so that such passes make no buffer; a pass asking for more
    /// grows them.
    pub fn reserve_scored_rows(
        &self,
        state: &mut LogitsState,
        rows: usize,
        guided: bool,
    ) -> Result<(), ModelError> {
        let head = &mut state.head;
        let group = self.head_group(head).min(rows.max(1));
        self.head_rows(&mut head.cond, group)?;
        if guided {
            self.head_rows(&mut head.uncond, group)?;
        }
        self.scored_buffers(&mut head.targets, &mut head.stats, rows)?;
        Ok(())
    }

    /// One forward pass over every sequence of `seqs` (their K/V arenas one after the
    /// other in `state`), and per sequence the logits `[rows.len(), embedding_size]` of its
    /// `rows`. The sequences' lengths may differ; together they must fit `state`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn logits_batch(
        &self,
        state: &mut LogitsState,
        seqs: &[ScoredSeq<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        pollster::block_on(self.logits_batch_async(state, seqs))
    }

    /// `logits_batch`, awaiting the read-backs.
    pub async fn logits_batch_async(
        &self,
        state: &mut LogitsState,
        seqs: &[ScoredSeq<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let layout = self.lay_out(state.capacity(), seqs.iter().map(|s| (s.ids, s.rows)))?;
        let index = gathered(&layout.bases, seqs.iter().map(|s| s.rows));
        if index.is_empty() {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        let LogitsState { forward, head } = state;
        let hidden = self.run_pass(forward, &layout)?;
        let logits = self.head_logits(head, hidden, &index).await?;
        let vocab = self.cfg.embedding_size;
        let mut out = Vec::with_capacity(seqs.len());
        let mut rest = logits.as_slice();
        for s in seqs {
            let (mine, tail) = rest.split_at(s.rows.len() * vocab);
            out.push(mine.to_vec());
            rest = tail;
        }
        Ok(out)
    }

    /// One forward pass over every sequence of `seqs` (and their unconditioned twins), and
    /// per sequence each asked row's cross-entropy -log p(target) in nats, taken on the GPU
    /// in f32 and finished in f64. The logits are guided by the twins' (`u + (cfg_scale +
    /// 1)(c - u)`) when `cfg_scale` > 0, and then every sequence needs its twin.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn cross_entropy_batch(
        &self,
        state: &mut LogitsState,
        seqs: &[TargetSeq<'_>],
        cfg_scale: f32,
    ) -> Result<Vec<Vec<f64>>, ModelError> {
        pollster::block_on(self.cross_entropy_batch_async(state, seqs, cfg_scale))
    }

    /// `cross_entropy_batch`, awaiting the read-back.
    pub async fn cross_entropy_batch_async(
        &self,
        state: &mut LogitsState,
        seqs: &[TargetSeq<'_>],
        cfg_scale: f32,
    ) -> Result<Vec<Vec<f64>>, ModelError> {
        self.check_target_seqs(seqs, cfg_scale)?;
        let guided = cfg_scale > 0.0;
        // The pass holds each twin, then its sequence.
        let mut laid: Vec<(&[u32], &[usize])> = Vec::new();
        for s in seqs {
            if let Some(u) = s.uncond {
                laid.push((u, s.rows));
            }
            laid.push((s.ids, s.rows));
        }
        let layout = self.lay_out(state.capacity(), laid.iter().copied())?;
        let twins = 1 + usize::from(guided);
        let cond_bases: Vec<usize> = layout
            .bases
            .iter()
            .skip(twins - 1)
            .step_by(twins)
            .copied()
            .collect();
        let cond = gathered(&cond_bases, seqs.iter().map(|s| s.rows));
        if cond.is_empty() {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        let uncond = guided.then(|| {
            let bases: Vec<usize> = layout.bases.iter().step_by(2).copied().collect();
            gathered(&bases, seqs.iter().map(|s| s.rows))
        });
        let targets: Vec<u32> = seqs.iter().flat_map(|s| s.targets).copied().collect();
        let LogitsState { forward, head } = state;
        let hidden = self.run_pass(forward, &layout)?;
        let guide = uncond.as_deref().map(|u| (u, cfg_scale));
        let losses = self
            .head_cross_entropy(head, hidden, &cond, guide, &targets)
            .await?;
        let mut out = Vec::with_capacity(seqs.len());
        let mut rest = losses.as_slice();
        for s in seqs {
            let (mine, tail) = rest.split_at(s.rows.len());
            out.push(mine.to_vec());
            rest = tail;
        }
        Ok(out)
    }

    /// Each sequence has one target a row, below the LM head's vocabulary, and a twin of
    /// its length exactly when guided.
    fn check_target_seqs(&self, seqs: &[TargetSeq<'_>], cfg_scale: f32) -> Result<(), ModelError> {
        let guided = cfg_scale > 0.0;
        let vocab = self.head_vocab();
        for (i, s) in seqs.iter().enumerate() {
            if s.targets.len() != s.rows.len() {
                return Err(ModelError::Input(format!(
                    "scored sequence {i}: {} targets for {} rows; expected one a row",
                    s.targets.len(),
                    s.rows.len()
                )));
            }
            if let Some(&t) = s.targets.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::Input(format!(
                    "scored sequence {i}: target {t}; expected ids below the LM head's {vocab}"
                )));
            }
            match s.uncond {
                Some(u) if !guided || u.len() != s.ids.len() => {
                    return Err(ModelError::Input(format!(
                        "scored sequence {i}: an unconditioned twin of {} positions at \
                         cfg_scale {cfg_scale}; expected one of {} exactly when cfg_scale > 0",
                        u.len(),
                        s.ids.len()
                    )));
                }
                None if guided => {
                    return Err(ModelError::Input(format!(
                        "scored sequence {i} without an unconditioned twin at cfg_scale \
                         {cfg_scale}; expected one when cfg_scale > 0"
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Checks `seqs` (ids and asked rows) against the model and a pass of `capacity` rows
    /// and lays them one after the other.
    fn lay_out<'a>(
        &self,
        capacity: usize,
        seqs: impl Iterator<Item = (&'a [u32], &'a [usize])>,
    ) -> Result<PassLayout, ModelError> {
        let mut layout = PassLayout {
            ids: Vec::new(),
            steps: Vec::new(),
            bases: Vec::new(),
        };
        for (i, (ids, rows)) in seqs.enumerate() {
            let t = ids.len();
            if t == 0 || t > self.cfg.max_sequence_length {
                return Err(ModelError::Input(format!(
                    "scored sequence {i} of {t} positions: expected 1 to max_sequence_length {}",
                    self.cfg.max_sequence_length
                )));
            }
            if let Some(&r) = rows.iter().find(|&&r| r >= t) {
                return Err(ModelError::Input(format!(
                    "logits at row {r} of scored sequence {i}: expected rows below its {t} \
                     positions"
                )));
            }
            let base = layout.ids.len();
            layout.bases.push(base);
            layout.steps.push(SeqStep {
                kv_base: base,
                ..SeqStep::whole(t)
            });
            layout.ids.extend_from_slice(ids);
        }
        if layout.ids.len() > capacity {
            return Err(ModelError::Input(format!(
                "a scoring pass of {} rows in buffers made for {capacity}",
                layout.ids.len()
            )));
        }
        Ok(layout)
    }

    /// Runs the pass and gives its hidden states, one row per position of `layout`.
    fn run_pass<'s>(
        &self,
        st: &'s ForwardState,
        layout: &PassLayout,
    ) -> Result<&'s Tensor, ModelError> {
        let plan = StepPlan::alone(&layout.steps, self.cfg.n_layers, false)
            .map_err(|e| ModelError::Input(e.to_string()))?;
        let mut step = StepEncoder::new(&self.ctx, "scoring pass");
        let hidden =
            self.encode_plan(&mut step, st, None, &plan, &layout.ids, Default::default())?;
        step.submit()?;
        Ok(hidden)
    }

    /// Rows the LM head takes at once: as many as its widest chunk's logits fit one
    /// binding and `HEAD_GROUP_LOGITS_BYTES`, within the caller's cap.
    fn head_group(&self, head: &HeadBuffers) -> usize {
        let widest = self.widest_head_chunk().max(1) as u64;
        let bytes = self
            .ctx
            .features
            .max_binding_bytes
            .min(HEAD_GROUP_LOGITS_BYTES);
        let by_bytes = ((bytes / (4 * widest)) as usize).max(1);
        by_bytes.min(head.max_rows.unwrap_or(usize::MAX))
    }

    fn widest_head_chunk(&self) -> usize {
        let chunks = &self.weights.lm_head.chunks;
        chunks.iter().map(|c| c.rows).max().unwrap_or(1)
    }

    /// The row buffers in `slot`, grown to hold groups of `rows`.
    fn head_rows<'h>(
        &self,
        slot: &'h mut Option<HeadRows>,
        rows: usize,
    ) -> Result<&'h HeadRows, ModelError> {
        let (ctx, d) = (&self.ctx, self.cfg.d_model);
        if slot.as_ref().is_none_or(|h| h.index.numel() < rows) {
            *slot = None;
            *slot = Some(HeadRows {
                index: Tensor::zeros(ctx, DType::U32, &[rows], "scored rows")?,
                picked: Tensor::zeros(ctx, DType::F32, &[rows, d], "scored hidden")?,
                normed: Tensor::zeros(ctx, DType::F32, &[rows, d], "final norm rows")?,
                logits: Tensor::zeros(
                    ctx,
                    DType::F32,
                    &[rows, self.widest_head_chunk()],
                    "logits chunk",
                )?,
            });
        }
        Ok(slot.as_ref().expect("just filled"))
    }

    /// The targets and cross-entropy state buffers in their slots, grown to hold `rows`
    /// scored rows.
    fn scored_buffers<'h>(
        &self,
        targets: &'h mut Option<Tensor>,
        stats: &'h mut Option<Tensor>,
        rows: usize,
    ) -> Result<(&'h Tensor, &'h Tensor), ModelError> {
        let ctx = &self.ctx;
        let targets = grown(ctx, targets, DType::U32, rows, "scored targets")?;
        let stats = grown(ctx, stats, DType::F32, rows * ce::STATE_WORDS, "losses")?;
        Ok((targets, stats))
    }

    /// Writes `index` into `rows` and records the gather and final norm of those rows of
    /// `hidden`.
    fn encode_head_rows(
        &self,
        step: &mut StepEncoder,
        hidden: &Tensor,
        rows: &HeadRows,
        index: &[u32],
    ) -> Result<(), ModelError> {
        rows.index.write_u32(&self.ctx, index)?;
        let n = index.len();
        self.encode_final_norm_rows(step, hidden, &rows.index, &rows.picked, &rows.normed, n)
    }

    /// The final norm and LM head of rows `index` of `hidden`, read back:
    /// `[index.len(), vocab]`.
    async fn head_logits(
        &self,
        head: &mut HeadBuffers,
        hidden: &Tensor,
        index: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        let vocab = self.cfg.embedding_size;
        let group = self.head_group(head).min(index.len());
        let bufs = self.head_rows(&mut head.cond, group)?;
        let lm_head = &self.weights.lm_head;
        let mut out = vec![0f32; index.len() * vocab];
        for (g, rows) in index.chunks(group).enumerate() {
            let n = rows.len();
            let first = g * group;
            for (ci, chunk) in lm_head.chunks.iter().enumerate() {
                let mut step = StepEncoder::new(&self.ctx, "lm head");
                if ci == 0 {
                    self.encode_head_rows(&mut step, hidden, bufs, rows)?;
                }
                let view = lm_head.chunk_view(ci);
                matmul::matmul(
                    &mut step,
                    &bufs.normed,
                    &view,
                    &bufs.logits,
                    n,
                    &self.kernels,
                )?;
                step.submit()?;
                let part = bufs
                    .logits
                    .read_values_async(&self.ctx, n * chunk.rows)
                    .await?;
                for r in 0..n {
                    let at = (first + r) * vocab + chunk.row_start;
                    out[at..at + chunk.rows]
                        .copy_from_slice(&part[r * chunk.rows..(r + 1) * chunk.rows]);
                }
            }
        }
        Ok(out)
    }

    /// The cross-entropy of `targets[k]` at row `cond[k]` of `hidden`, guided by row
    /// `uncond[k]` at the given scale: the LM head a group of rows at a time, each chunk's
    /// logits folded into the rows' state on the GPU; one read-back of it at the end.
    async fn head_cross_entropy(
        &self,
        head: &mut HeadBuffers,
        hidden: &Tensor,
        cond: &[u32],
        uncond: Option<(&[u32], f32)>,
        targets: &[u32],
    ) -> Result<Vec<f64>, ModelError> {
        let ctx = &self.ctx;
        let total = cond.len();
        let group = self.head_group(head).min(total);
        let HeadBuffers {
            max_rows: _,
            cond: cond_slot,
            uncond: uncond_slot,
            targets: targets_slot,
            stats: stats_slot,
        } = head;
        let (target_ids, stats) = self.scored_buffers(targets_slot, stats_slot, total)?;
        target_ids.write_u32(ctx, targets)?;
        let cond_bufs = self.head_rows(cond_slot, group)?;
        let uncond_bufs = match uncond {
            Some(_) => Some(self.head_rows(uncond_slot, group)?),
            None => None,
        };
        let lm_head = &self.weights.lm_head;
        for (g, rows) in cond.chunks(group).enumerate() {
            let (first, n) = (g * group, rows.len());
            // The index buffers are rewritten for every group: one submit a group, so each
            // write lands after the previous group's reads.
            let mut step = StepEncoder::new(ctx, "scored rows");
            self.encode_head_rows(&mut step, hidden, cond_bufs, rows)?;
            let guide = match (uncond, uncond_bufs) {
                (Some((index, scale)), Some(bufs)) => {
                    self.encode_head_rows(&mut step, hidden, bufs, &index[first..first + n])?;
                    Some((bufs, scale))
                }
                _ => None,
            };
            for (ci, chunk) in lm_head.chunks.iter().enumerate() {
                let view = lm_head.chunk_view(ci);
                let k = &self.kernels;
                matmul::matmul(&mut step, &cond_bufs.normed, &view, &cond_bufs.logits, n, k)?;
                if let Some((bufs, _)) = guide {
                    matmul::matmul(&mut step, &bufs.normed, &view, &bufs.logits, n, k)?;
                }
                let at = ChunkRows {
                    rows: n,
                    n: chunk.rows,
                    vocab_offset: chunk.row_start,
                    row_base: first,
                    first: ci == 0,
                };
                let guide = guide.map(|(bufs, scale)| (&bufs.logits, scale));
                ce::cross_entropy_accumulate(
                    &mut step,
                    &cond_bufs.logits,
                    guide,
                    target_ids,
                    stats,
                    at,
                )?;
            }
            step.submit()?;
        }
        let state = stats
            .read_values_async(ctx, total * ce::STATE_WORDS)
            .await?;
        Ok(ce::cross_entropy_of(&state))
    }
}

/// The pass rows of every asked row, sequence by sequence: `bases[i] + rows[i][k]`.
fn gathered<'a>(bases: &[usize], rows: impl Iterator<Item = &'a [usize]>) -> Vec<u32> {
    bases
        .iter()
        .zip(rows)
        .flat_map(|(&b, rows)| rows.iter().map(move |&r| (b + r) as u32))
        .collect()
}
