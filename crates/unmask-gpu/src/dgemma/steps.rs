//! The passes' entry points: encoder (commit), decoder and the denoising step, each with
//! its read-back awaited (`*_async`, what a browser needs) or, natively, blocked on.

use super::pass::{Pass, Scratch, SelfConditioning};
use super::{DgemmaCache, DgemmaModel};
use crate::context::GpuContext;
use crate::model::ModelError;
use crate::ops::denoise::{DrawStream, RowStats, STATS_WORDS, denoise_rows, parse_stats};
use crate::step::StepEncoder;
use crate::tensor::{DType, Tensor};

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
        let out = self.submit(ctx, cache, ids, Pass::Encode, logits)?;
        cache.len += ids.len();
        Ok(match out {
            Some(t) => Some(t.read_f32_async(ctx).await?),
            None => None,
        })
    }

    /// The encoder pass without logits: submitted, nothing read back, so it never waits.
    pub fn append(
        &self,
        ctx: &GpuContext,
        cache: &mut DgemmaCache,
        ids: &[u32],
    ) -> Result<(), ModelError> {
        self.submit(ctx, cache, ids, Pass::Encode, false)?;
        cache.len += ids.len();
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
    /// the next step. Reads back 4 words per row.
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
        let t = canvas.len();
        let v = self.cfg.vocab_size;
        let self_conditioning = if self_conditioned {
            SelfConditioning::Probs(probs)
        } else {
            SelfConditioning::None
        };
        let pass = Pass::Decode { self_conditioning };
        self.check_pass(cache, canvas, pass)?;
        let s = Scratch::new(ctx, self, canvas, cache.len)?;
        let mut step = StepEncoder::new(ctx, "diffusion gemma denoising step");
        self.record_pass(ctx, &mut step, &s, cache, pass)?;
        let logits = self.record_logits(ctx, &mut step, &s)?;
        let stats = Tensor::zeros(ctx, DType::U32, &[t, STATS_WORDS], "dgemma row stats")?;
        denoise_rows(
            &mut step,
            &logits,
            probs,
            true,
            &stats,
            (t, v),
            temperature,
            draws,
        )?;
        step.submit()?;
        Ok(parse_stats(&stats.read_u32_async(ctx).await?))
    }
}
