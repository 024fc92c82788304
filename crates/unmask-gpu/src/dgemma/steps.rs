//! The passes' entry points: encoder (commit), decoder and the denoising step, each with
//! its read-back awaited (`*_async`, what a browser needs) or, natively, blocked on.

use super::pass::{Pass, Scratch, SelfConditioning, Span};
use super::pass_limit::is_capacity;
use super::{DgemmaCache, DgemmaModel};
use crate::context::GpuContext;
use crate::model::ModelError;
use crate::ops::denoise::{DrawStream, RowStats, STATS_WORDS, denoise_rows_at, parse_stats};
use crate::ops::logit_bias::{RowBiases, add_logit_bias, upload_biases};
use crate::step::StepEncoder;
use crate::tensor::{DType, Tensor};
use unmask_core::sampler::IdBias;

/// `ids` in pieces of at most `n` (one empty piece for no ids, so the pass reports it).
fn pieces(ids: &[u32], n: usize) -> Vec<&[u32]> {
    if ids.is_empty() {
        vec![ids]
    } else {
        ids.chunks(n.max(1)).collect()
    }
}

impl DgemmaModel {
    /// Encoder (or commit) pass: `ids` at positions `cache.len ..`, their K/V appended to the
    /// cache. With `logits`, the soft-capped logits `[T, V]` of the final normed states.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn encode(
        &self,
        ctx: &GpuContext,
        cache: &mut DgemmaCache,
        ids: &[u32],
        logits: bool,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        pollster::block_on(self.encode_async(ctx, cache, ids, logits))
    }

    /// `encode`, its logits read back without blocking (what a browser must do).
    pub async fn encode_async(
        &self,
        ctx: &GpuContext,
        cache: &mut DgemmaCache,
        ids: &[u32],
        logits: bool,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let mut outs = Vec::new();
        for piece in pieces(ids, cache.pass_rows) {
            self.make_room(ctx, cache, piece.len())?;
            outs.push(self.submit(ctx, cache, piece, Pass::Encode, logits)?);
            cache.len += piece.len();
        }
        if !logits {
            return Ok(None);
        }
        let mut all = Vec::new();
        for t in outs.into_iter().flatten() {
            all.extend(t.read_f32_async(ctx).await?);
        }
        Ok(Some(all))
    }

    /// The encoder pass without logits: submitted, nothing read back, so it never waits.
    pub fn append(
        &self,
        ctx: &GpuContext,
        cache: &mut DgemmaCache,
        ids: &[u32],
    ) -> Result<(), ModelError> {
        for piece in pieces(ids, cache.pass_rows) {
            self.make_room(ctx, cache, piece.len())?;
            // The kept decoder step buffers are the memory to give back first.
            self.retry_after_freeing(|| self.submit(ctx, cache, piece, Pass::Encode, false))?;
            cache.len += piece.len();
        }
        Ok(())
    }

    /// Before an encoder pass appends `t` positions: when the sliding layers' buffers would
    /// overflow, their last W − 1 positions (all a window still sees) move to the front,
    /// through a scratch buffer (a copy within one buffer is not allowed).
    fn make_room(
        &self,
        ctx: &GpuContext,
        cache: &mut DgemmaCache,
        t: usize,
    ) -> Result<(), ModelError> {
        let p0 = cache.len;
        if p0 + t <= cache.sliding_base + cache.sliding_rows {
            return Ok(());
        }
        let base = p0.saturating_sub(self.cfg.sliding_window.saturating_sub(1));
        let keep = p0 - base;
        let from = base - cache.sliding_base;
        let widest = self.cfg.layers.iter().filter(|a| a.sliding);
        let width = widest.map(|a| a.kv_heads * a.head_dim).max().unwrap_or(0);
        if keep > 0 && width > 0 {
            let scratch = Tensor::zeros(ctx, cache.dtype, &[keep, width], "dgemma kv move")?;
            let mut step = StepEncoder::new(ctx, "dgemma sliding cache move");
            for (l, a) in self.cfg.layers.iter().enumerate() {
                if !a.sliding {
                    continue;
                }
                let row = cache.row_bytes(a);
                let bytes = keep as u64 * row;
                for buf in [&cache.k[l].buffer, &cache.v[l].buffer] {
                    step.copy(buf, from as u64 * row, &scratch.buffer, 0, bytes);
                    step.copy(&scratch.buffer, 0, buf, 0, bytes);
                }
            }
            step.submit()?;
        }
        cache.sliding_base = base;
        Ok(())
    }

    /// Decoder pass over `canvas` at positions `cache.len ..`: the soft-capped logits `[L, V]`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode(
        &self,
        ctx: &GpuContext,
        cache: &DgemmaCache,
        canvas: &[u32],
        self_conditioning: Option<&[f32]>,
    ) -> Result<Vec<f32>, ModelError> {
        pollster::block_on(self.decode_async(ctx, cache, canvas, self_conditioning))
    }

    /// `decode`, read back without blocking.
    pub async fn decode_async(
        &self,
        ctx: &GpuContext,
        cache: &DgemmaCache,
        canvas: &[u32],
        self_conditioning: Option<&[f32]>,
    ) -> Result<Vec<f32>, ModelError> {
        let self_conditioning = match self_conditioning {
            Some(z) => SelfConditioning::Logits(z),
            None => SelfConditioning::None,
        };
        let pass = Pass::Decode { self_conditioning };
        match self.submit(ctx, cache, canvas, pass, true)? {
            Some(t) => Ok(t.read_f32_async(ctx).await?),
            None => Ok(Vec::new()),
        }
    }

    /// One denoising step on the GPU: the decoder over `canvas` (self-conditioned on `probs`
    /// when `self_conditioned`), then per row the argmax, entropy and a token drawn from
    /// `draws` of `softmax(logits / temperature)`, that softmax written into `probs` for
    /// the next step. Reads back 5 words per row.
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)] // one step's inputs
    pub fn decode_step(
        &self,
        ctx: &GpuContext,
        cache: &DgemmaCache,
        canvas: &[u32],
        probs: &Tensor,
        self_conditioned: bool,
        temperature: f32,
        draws: DrawStream,
    ) -> Result<Vec<RowStats>, ModelError> {
        pollster::block_on(self.decode_step_async(
            ctx,
            cache,
            canvas,
            probs,
            self_conditioned,
            temperature,
            draws,
        ))
    }

    /// `decode_step`, read back without blocking.
    #[allow(clippy::too_many_arguments)] // one step's inputs
    pub async fn decode_step_async(
        &self,
        ctx: &GpuContext,
        cache: &DgemmaCache,
        canvas: &[u32],
        probs: &Tensor,
        self_conditioned: bool,
        temperature: f32,
        draws: DrawStream,
    ) -> Result<Vec<RowStats>, ModelError> {
        let one = DecodeCanvas {
            cache,
            canvas,
            probs,
            self_conditioned,
            temperature,
            draws,
            bias: &[],
        };
        let mut rows = self.decode_steps_async(ctx, &[one]).await?;
        Ok(rows.pop().unwrap_or_default())
    }

    /// One denoising step of several canvases (each its own request's, with its own cache,
    /// positions, temperature and draws) in one decoder pass: every matmul, the router and
    /// the experts run once over all their rows (the weights are read once per step, and
    /// the experts get the tokens of every canvas), attention per canvas over its own cache.
    /// Each canvas's statistics are those of `decode_step` on it alone, up to the rounding
    /// of kernels chosen for the larger row count.
    pub async fn decode_steps_async(
        &self,
        ctx: &GpuContext,
        canvases: &[DecodeCanvas<'_>],
    ) -> Result<Vec<Vec<RowStats>>, ModelError> {
        let Some(first) = canvases.first() else {
            return Ok(Vec::new());
        };
        let v = self.cfg.vocab_size;
        let dtype = first.cache.dtype;
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(canvases.len());
        for c in canvases {
            let sc = if c.self_conditioned {
                SelfConditioning::Probs(c.probs)
            } else {
                SelfConditioning::None
            };
            self.check_pass(
                c.cache,
                c.canvas,
                Pass::Decode {
                    self_conditioning: sc,
                },
            )?;
            if c.cache.dtype != dtype {
                return Err(ModelError::Input(format!(
                    "batched step: expected every cache in {dtype:?}, found {:?}",
                    c.cache.dtype
                )));
            }
            let start = ids.len();
            ids.extend_from_slice(c.canvas);
            let p0 = c.cache.len;
            positions.extend((p0..p0 + c.canvas.len()).map(|p| p as u32));
            spans.push(Span {
                cache: c.cache,
                rows: start..ids.len(),
            });
        }
        let t = ids.len();
        let kept = self
            .step_buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let mut bufs = match kept {
            Some(b) if b.rows == t && b.dtype == dtype => {
                b.scratch.ids.write_u32(ctx, &ids)?;
                b.scratch.positions.write_u32(ctx, &positions)?;
                b
            }
            other => {
                // The kept set is freed before the new one is made: never both at once.
                drop(other);
                StepBuffers::new(ctx, self, &ids, &positions, dtype)?
            }
        };
        let mut step = StepEncoder::new(ctx, "diffusion gemma denoising step");
        // The decoder's self-conditioning input: a lone canvas reads its own softmax; a
        // batch gathers each self-conditioned canvas's into its rows and zeros the others'
        // (zero probabilities add exactly nothing: the soft embedding, its norm and the
        // bias-free MLP of zeros are zeros). The gathered buffer is kept with the step's.
        let self_conditioning = if !canvases.iter().any(|c| c.self_conditioned) {
            SelfConditioning::None
        } else if let [one] = canvases {
            SelfConditioning::Probs(one.probs)
        } else {
            let gathered: &Tensor = match &mut bufs.gathered {
                Some(g) => g,
                slot @ None => slot.insert(Tensor::zeros(
                    ctx,
                    DType::F32,
                    &[t, v],
                    "dgemma batch self-conditioning",
                )?),
            };
            let row = (v * 4) as u64;
            for (c, span) in canvases.iter().zip(&spans) {
                let bytes = c.canvas.len() as u64 * row;
                let at = span.rows.start as u64 * row;
                if c.self_conditioned {
                    step.copy(&c.probs.buffer, 0, &gathered.buffer, at, bytes);
                } else {
                    step.clear(&gathered.buffer, at, bytes);
                }
            }
            SelfConditioning::Probs(gathered)
        };
        let s = &bufs.scratch;
        let pass = Pass::Decode { self_conditioning };
        self.record_pass(ctx, &mut step, s, &spans, pass)?;
        self.record_logits_into(&mut step, s, &bufs.logits)?;
        // Each canvas's logit biases, on its rows, before the sampler's statistics read them.
        let mut biases = RowBiases::default();
        for c in canvases {
            biases.push(c.bias, c.canvas.len());
        }
        if let Some(table) = upload_biases(ctx, &biases, &mut bufs.bias, "dgemma logit bias")? {
            add_logit_bias(&mut step, &bufs.logits, t, v, 0, table)?;
        }
        let (logits, stats) = (&bufs.logits, &bufs.stats);
        for (c, span) in canvases.iter().zip(&spans) {
            let shape = (span.rows.start, span.rows.len(), v);
            denoise_rows_at(
                &mut step,
                logits,
                c.probs,
                true,
                stats,
                shape,
                c.temperature,
                c.draws,
            )?;
        }
        step.submit()?;
        let all = parse_stats(&stats.read_u32_async(ctx).await?);
        // Read back: the step is done with them.
        *self.step_buffers.lock().unwrap_or_else(|e| e.into_inner()) = Some(bufs);
        Ok(spans
            .iter()
            .map(|span| all[span.rows.clone()].to_vec())
            .collect())
    }
}

impl DgemmaModel {
    /// Frees the kept decoder step buffers (memory for a pass that did not fit); whether
    /// there were any.
    pub(super) fn free_step_buffers(&self) -> bool {
        let kept = self
            .step_buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        kept.is_some()
    }

    /// Rows of the kept decoder step buffers, when there are any.
    pub(super) fn kept_step_rows(&self) -> Option<usize> {
        let kept = self.step_buffers.lock().unwrap_or_else(|e| e.into_inner());
        kept.as_ref().map(|b| b.rows)
    }

    /// `alloc()`, once more after freeing the kept step buffers when it did not fit.
    pub(super) fn retry_after_freeing<T>(
        &self,
        mut alloc: impl FnMut() -> Result<T, ModelError>,
    ) -> Result<T, ModelError> {
        match alloc() {
            Err(e) if is_capacity(&e) && self.free_step_buffers() => alloc(),
            result => result,
        }
    }
}

/// A decoder step's buffers (`DgemmaModel::step_buffers`): the pass's scratch, the logits
/// and the rows' statistics, for `rows` rows with K/V in `dtype`, and a batch's gathered
/// self-conditioning input once one needed it.
pub(super) struct StepBuffers {
    rows: usize,
    dtype: DType,
    scratch: Scratch,
    logits: Tensor,
    stats: Tensor,
    gathered: Option<Tensor>,
    /// The canvases' logit biases (`RowBiases::words`), once a step had any.
    bias: Option<Tensor>,
}

impl StepBuffers {
    fn new(
        ctx: &GpuContext,
        m: &DgemmaModel,
        ids: &[u32],
        positions: &[u32],
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let t = ids.len();
        Ok(Self {
            rows: t,
            dtype,
            scratch: Scratch::new(ctx, m, ids, positions, dtype)?,
            logits: Tensor::zeros(ctx, DType::F32, &[t, m.cfg.vocab_size], "dgemma logits")?,
            stats: Tensor::zeros(ctx, DType::U32, &[t, STATS_WORDS], "dgemma row stats")?,
            gathered: None,
            bias: None,
        })
    }
}

/// One canvas of a denoising step (`decode_steps_async`).
pub struct DecodeCanvas<'a> {
    pub cache: &'a DgemmaCache,
    pub canvas: &'a [u32],
    /// Its softmax of the previous step (read when `self_conditioned`), then this step's.
    pub probs: &'a Tensor,
    pub self_conditioned: bool,
    pub temperature: f32,
    pub draws: DrawStream,
    /// Added to its rows' soft-capped logits before the sampler reads them (its request's
    /// `logit_bias`): the draws, the argmax, the entropies and the next step's
    /// self-conditioning all see the biased distribution. Empty: none.
    pub bias: &'a [IdBias],
}
