//! DiffusionGemma's generation loop (§6 of the spec): encode the prompt, then canvas after
//! canvas — denoise from random tokens until the step limit or the stopping rule, keep the
//! last argmax canvas, stop at an eos, else commit the canvas and go on.

use unmask_core::sampler::entropy_bound::{
    Canvas, CanvasDraws, EntropyBoundParams, EntropyBoundStep, denoise_step, pad_after_eos,
};

use super::DgemmaModel;
use crate::context::GpuContext;
use crate::model::ModelError;

/// One canvas: every step (without its scaled logits) and its output, the last step's
/// argmax canvas (the sequence holds it with pad after its first eos).
#[derive(Clone, Debug)]
pub struct GeneratedCanvas {
    pub init: Vec<u32>,
    pub steps: Vec<EntropyBoundStep>,
    pub output: Vec<u32>,
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// The prompt and every canvas (pad after the first eos of the last one).
    pub sequence: Vec<u32>,
    pub canvases: Vec<GeneratedCanvas>,
}

impl DgemmaModel {
    pub fn generate(
        &self,
        ctx: &GpuContext,
        prompt: &[u32],
        params: &EntropyBoundParams,
        draws: &mut dyn CanvasDraws,
    ) -> Result<Generation, ModelError> {
        let len = self.cfg.canvas_length;
        let vocab = self.cfg.vocab_size;
        if params.max_denoising_steps == 0 {
            return Err(ModelError::Input(
                "max_denoising_steps: expected at least 1, found 0".into(),
            ));
        }
        let n_canvases = params.max_new_tokens.div_ceil(len);
        let mut cache = self.new_cache(ctx, prompt.len() + n_canvases * len)?;
        self.encode(ctx, &mut cache, prompt, false)?;
        let mut sequence = prompt.to_vec();
        let mut canvases = Vec::with_capacity(n_canvases);
        for _ in 0..n_canvases {
            let init = draws.uniform_canvas(len, vocab);
            let mut canvas = Canvas::new(init.clone(), params);
            let mut self_conditioning: Option<Vec<f32>> = None;
            let mut steps = Vec::new();
            for t in (1..=params.max_denoising_steps).rev() {
                let raw = self.decode(ctx, &cache, &canvas.tokens, self_conditioning.as_deref())?;
                let mut step = denoise_step(&raw, vocab, t, params, &mut canvas, draws);
                self_conditioning = Some(std::mem::take(&mut step.scaled));
                let stop = step.stop;
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
            self.encode(ctx, &mut cache, &appended, false)?;
        }
        Ok(Generation { sequence, canvases })
    }
}
