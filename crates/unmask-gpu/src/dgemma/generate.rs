//! DiffusionGemma's generation loop (§6 of the spec): encode the prompt, then canvas after
//! canvas — denoise from random tokens until the step limit or the stopping rule, keep the
//! last argmax canvas, stop at an eos, else commit the canvas and go on.

use std::ops::ControlFlow;

use unmask_core::sampler::entropy_bound::{
    Canvas, CanvasDraws, EntropyBoundParams, EntropyBoundStep, pad_after_eos, step_from_rows,
};

use super::{DgemmaModel, DgemmaPrefixStore, PrefixUse};
use crate::context::GpuContext;
use crate::model::ModelError;
use crate::ops::denoise::DrawStream;
use crate::tensor::{DType, Tensor};

/// One canvas: every step (without its scaled logits) and its output, the last step's
/// argmax canvas (the sequence holds it with pad after its first eos).
#[derive(Clone, Debug)]
pub struct GeneratedCanvas {
    pub init: Vec<u32>,
    pub steps: Vec<EntropyBoundStep>,
    pub output: Vec<u32>,
}

/// One finished denoising step, as `generate_async` reports it.
pub struct StepReport<'a> {
    /// Which canvas (0 for the first 256 tokens).
    pub canvas: usize,
    pub step: &'a EntropyBoundStep,
    /// Each row's entropy (nats) of the step's tempered distribution.
    pub entropies: &'a [f32],
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// The prompt and every canvas (pad after the first eos of the last one).
    pub sequence: Vec<u32>,
    pub canvases: Vec<GeneratedCanvas>,
}

/// The prompt's first `shared` tokens (a system turn many requests share) through a prefix
/// store: their K/V copied when stored, else encoded and stored.
pub struct SharedPrefix<'a> {
    pub shared: usize,
    pub store: &'a mut DgemmaPrefixStore,
}

impl DgemmaModel {
    /// Generates after `prompt`: each step's decoder, statistics and draws on the GPU (the
    /// draws from `seed`'s stream unless `draws` replays recorded ones), the acceptance and
    /// renoising on the host from 4 words per canvas row.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate(
        &self,
        ctx: &GpuContext,
        prompt: &[u32],
        params: &EntropyBoundParams,
        draws: &mut dyn CanvasDraws,
        seed: u64,
    ) -> Result<Generation, ModelError> {
        let mut quiet = |_: StepReport<'_>| ControlFlow::Continue(());
        let run = self.generate_async(ctx, prompt, None, params, draws, seed, &mut quiet);
        Ok(pollster::block_on(run)?.0)
    }

    /// `generate`, awaiting each step's read-back (a browser's event loop delivers it), the
    /// prompt's shared part through `prefix` when given, `on_step` told of every step
    /// (its canvas index and the step); `on_step` breaking ends the generation with
    /// `ModelError::Cancelled` (a client gone, a cancel button).
    #[allow(clippy::too_many_arguments)] // one request's inputs
    pub async fn generate_async(
        &self,
        ctx: &GpuContext,
        prompt: &[u32],
        prefix: Option<SharedPrefix<'_>>,
        params: &EntropyBoundParams,
        draws: &mut dyn CanvasDraws,
        seed: u64,
        on_step: &mut dyn FnMut(StepReport<'_>) -> ControlFlow<()>,
    ) -> Result<(Generation, Option<PrefixUse>), ModelError> {
        let len = self.cfg.canvas_length;
        let vocab = self.cfg.vocab_size;
        if params.max_denoising_steps == 0 {
            return Err(ModelError::Input(
                "max_denoising_steps: expected at least 1, found 0".into(),
            ));
        }
        let n_canvases = params.max_new_tokens.div_ceil(len);
        let mut cache = self.new_cache(ctx, prompt.len() + n_canvases * len)?;
        let prefix_use = match prefix {
            Some(p) => Some(self.encode_prompt(ctx, &mut cache, prompt, p.shared, p.store)?),
            None => {
                self.append(ctx, &mut cache, prompt)?;
                None
            }
        };
        // The softmax of the last step's scaled logits, read by the next step's decoder.
        let probs = Tensor::zeros(ctx, DType::F32, &[len, vocab], "dgemma self-conditioning")?;
        let mut sequence = prompt.to_vec();
        let mut canvases = Vec::with_capacity(n_canvases);
        let mut step_counter = 0u32;
        for index in 0..n_canvases {
            let init = draws.uniform_canvas(len, vocab);
            let mut canvas = Canvas::new(init.clone(), params);
            let mut steps: Vec<EntropyBoundStep> = Vec::new();
            for t in (1..=params.max_denoising_steps).rev() {
                let temperature = params.temperature(t);
                let stream = DrawStream {
                    seed,
                    step: step_counter,
                };
                step_counter = step_counter.wrapping_add(1);
                let stats = self
                    .decode_step_async(
                        ctx,
                        &cache,
                        &canvas.tokens,
                        &probs,
                        !steps.is_empty(),
                        temperature,
                        stream,
                    )
                    .await?;
                let rows: Vec<(u32, f32)> = stats.iter().map(|r| (r.argmax, r.entropy)).collect();
                let sampled = draws
                    .replayed_categorical(len)
                    .unwrap_or_else(|| stats.iter().map(|r| r.sampled).collect());
                let step = step_from_rows(&rows, sampled, vocab, t, params, &mut canvas, draws);
                let stop = step.stop;
                let entropies: Vec<f32> = rows.iter().map(|r| r.1).collect();
                let flow = on_step(StepReport {
                    canvas: index,
                    step: &step,
                    entropies: &entropies,
                });
                if flow.is_break() {
                    return Err(ModelError::Cancelled {
                        steps: step_counter as usize,
                    });
                }
                steps.push(step);
                if stop {
                    break;
                }
            }
            let output = steps.last().map(|s| s.argmax.clone()).unwrap_or_default();
            let mut appended = output.clone();
            let eos = pad_after_eos(&mut appended, params);
            sequence.extend_from_slice(&appended);
            canvases.push(GeneratedCanvas {
                init,
                steps,
                output,
            });
            if eos {
                break;
            }
            self.append(ctx, &mut cache, &appended)?;
        }
        Ok((Generation { sequence, canvases }, prefix_use))
    }
}
