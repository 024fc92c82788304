//! DiffusionGemma's generation loop (§6 of the spec): encode the prompt, then canvas after
//! canvas — denoise from random tokens until the step limit or the stopping rule, keep the
//! last argmax canvas, stop at an eos, else commit the canvas and go on.

use std::ops::ControlFlow;

use unmask_core::sampler::entropy_bound::{
    Canvas, CanvasDraws, EntropyBoundParams, EntropyBoundStep, pad_after_eos, step_from_rows,
};

mod shared_turn;

use shared_turn::SharedPart;
pub use shared_turn::{RoundStore, SharedPrefix};

use super::pass_limit::{PassLimit, is_capacity};
use super::steps::DecodeCanvas;
use super::{DgemmaCache, DgemmaModel, PrefixUse};
use crate::context::GpuContext;
use crate::model::ModelError;
use crate::ops::denoise::{DrawStream, RowStats};
use crate::tensor::{DType, Tensor};
use unmask_core::sampler::IdBias;

/// One canvas: every step (without its scaled logits) and its output, the last step's
/// argmax canvas (the sequence holds it with pad after its first eos).
#[derive(Clone, Debug)]
pub struct GeneratedCanvas {
    pub init: Vec<u32>,
    pub steps: Vec<EntropyBoundStep>,
    pub output: Vec<u32>,
    /// Each output token's log-probability under the model's untempered softmax at the
    /// last step (`RowStats::logprob`).
    pub logprobs: Vec<f32>,
}

/// One finished denoising step, as `generate_async` reports it.
pub struct StepReport<'a> {
    /// Which canvas (0 for the first 256 tokens).
    pub canvas: usize,
    pub step: &'a EntropyBoundStep,
    /// Each row's entropy (nats) of the step's tempered distribution.
    pub entropies: &'a [f32],
    /// Each row's argmax's log-probability under the model's untempered softmax.
    pub logprobs: &'a [f32],
    /// Canvases in the decoder pass that ran this step (this one's included).
    pub pass_canvases: usize,
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// The prompt and every canvas (pad after the first eos of the last one).
    pub sequence: Vec<u32>,
    pub canvases: Vec<GeneratedCanvas>,
}

/// One request's generation in progress (`DgemmaModel::start`): its cache, the canvas being
/// denoised and every canvas done. `step_runs_async` advances several of them by one
/// denoising step in one decoder pass; `finish` hands the generation back.
pub struct DgemmaRun<'d> {
    cache: DgemmaCache,
    /// The softmax of the last step's scaled logits, read by the next step's decoder.
    probs: Tensor,
    params: EntropyBoundParams,
    draws: Box<dyn CanvasDraws + 'd>,
    seed: u64,
    n_canvases: usize,
    sequence: Vec<u32>,
    canvases: Vec<GeneratedCanvas>,
    /// The canvas being denoised: its index, initial tokens, state and steps so far.
    index: usize,
    init: Vec<u32>,
    canvas: Canvas,
    steps: Vec<EntropyBoundStep>,
    /// The last step's argmax log-probabilities (the output's, once the canvas ends).
    logprobs: Vec<f32>,
    /// Steps left for this canvas (the schedule's t, counting down to 1).
    t: usize,
    /// Denoising steps run over all canvases (each step's draw stream).
    step_counter: u32,
    /// Prompt tokens (the end of `sequence`) not encoded yet: the run denoises once they are.
    prompt_left: usize,
    /// Where the prompt's shared part (its system turn) is to come from.
    shared: SharedPart,
    /// The whole prompt's length when it goes through the store too (`whole_prompt`): its
    /// part once the system turn is settled.
    whole: Option<usize>,
    prefix_use: Option<PrefixUse>,
    state: RunState,
    /// Added to every canvas row's logits (`DecodeCanvas::bias`).
    bias: Vec<IdBias>,
}

#[derive(Debug)]
enum RunState {
    Running,
    Done,
    /// `on_step` broke after this many steps.
    Cancelled(usize),
    /// Its step or its commit failed (alone: the other runs of the step went on).
    Failed(ModelError),
}

impl DgemmaRun<'_> {
    /// Whether it has ended (finished, stopped by its caller, or failed): `finish` it.
    pub fn is_done(&self) -> bool {
        !matches!(self.state, RunState::Running)
    }

    /// Denoising steps run so far (over every canvas).
    pub fn steps_run(&self) -> usize {
        self.step_counter as usize
    }

    /// Prompt tokens not encoded yet (its first denoising step waits for them).
    pub fn prompt_left(&self) -> usize {
        self.prompt_left
    }

    /// The generation and what the prompt's shared prefix did; `ModelError::Cancelled`
    /// when `on_step` stopped it, its own error when it failed.
    pub fn finish(self) -> Result<(Generation, Option<PrefixUse>), ModelError> {
        match self.state {
            RunState::Cancelled(steps) => Err(ModelError::Cancelled { steps }),
            RunState::Failed(e) => Err(e),
            RunState::Running | RunState::Done => Ok((
                Generation {
                    sequence: self.sequence,
                    canvases: self.canvases,
                },
                self.prefix_use,
            )),
        }
    }

    /// Biases every step's logits from now on (`DecodeCanvas::bias`): OpenAI's
    /// `logit_bias`, (id, bias) pairs the caller has checked.
    pub fn set_logit_bias(&mut self, ids: &[(u32, f32)]) {
        self.bias = ids.iter().map(|&pair| IdBias::from(pair)).collect();
    }

    /// Its canvas as the next decoder pass reads it.
    fn decode_canvas(&self) -> DecodeCanvas<'_> {
        DecodeCanvas {
            cache: &self.cache,
            canvas: &self.canvas.tokens,
            probs: &self.probs,
            self_conditioned: !self.steps.is_empty(),
            temperature: self.params.temperature(self.t),
            draws: DrawStream {
                seed: self.seed,
                step: self.step_counter,
            },
            bias: &self.bias,
        }
    }

    /// Starts the next canvas from fresh uniform tokens.
    fn next_canvas(&mut self, vocab: usize) {
        let len = self.canvas.tokens.len();
        self.init = self.draws.uniform_canvas(len, vocab);
        self.canvas = Canvas::new(self.init.clone(), &self.params);
        self.steps = Vec::new();
        self.t = self.params.max_denoising_steps;
    }
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
        let (shared, whole_prompt, mut store) = match prefix {
            Some(p) => (p.shared, p.whole_prompt, Some(p.store)),
            None => (0, false, None),
        };
        let prefix = store.as_deref_mut().map(|store| SharedPrefix {
            shared,
            whole_prompt,
            store,
        });
        let mut run = self.start(ctx, prompt, prefix, params, Box::new(draws), seed)?;
        while !run.is_done() {
            let round_store = store.as_deref_mut().map(RoundStore::Held);
            self.step_runs_async(ctx, &mut [&mut run], round_store, &mut |_, r| on_step(r))
                .await?;
        }
        run.finish()
    }

    /// Starts a run for `step_runs_async`: its cache, its first canvas, and its prompt's
    /// shared part copied from `prefix`'s store when stored there. The prompt (an unstored
    /// shared part too) is encoded by `step_runs_async`, a piece per round. A run started
    /// with a store takes an unstored shared part through the store given to each round (a
    /// round without it has the run encode the part as its own).
    pub fn start<'d>(
        &self,
        ctx: &GpuContext,
        prompt: &[u32],
        prefix: Option<SharedPrefix<'_>>,
        params: &EntropyBoundParams,
        mut draws: Box<dyn CanvasDraws + 'd>,
        seed: u64,
    ) -> Result<DgemmaRun<'d>, ModelError> {
        let len = self.cfg.canvas_length;
        let vocab = self.cfg.vocab_size;
        if params.max_denoising_steps == 0 {
            return Err(ModelError::Input(
                "max_denoising_steps: expected at least 1, found 0".into(),
            ));
        }
        let n_canvases = params.max_new_tokens.div_ceil(len);
        // A run's own memory comes before the kept step buffers of runs that ended.
        let mut cache =
            self.retry_after_freeing(|| self.new_cache(ctx, prompt.len() + n_canvases * len))?;
        // A stored shared part is copied now; an unstored one is encoded a piece per round
        // like the rest (`step_runs_async`), by one run of those that want it, and stored
        // (`settle_shared_prefixes`).
        let (shared, whole, prefix_use) = self.start_shared(ctx, &mut cache, prompt, prefix)?;
        let prompt_left = prompt.len() - cache.len;
        let probs = self.retry_after_freeing(|| {
            Ok(Tensor::zeros(
                ctx,
                DType::F32,
                &[len, vocab],
                "dgemma self-conditioning",
            )?)
        })?;
        let init = draws.uniform_canvas(len, vocab);
        Ok(DgemmaRun {
            cache,
            probs,
            canvas: Canvas::new(init.clone(), params),
            init,
            params: params.clone(),
            draws,
            seed,
            n_canvases,
            sequence: prompt.to_vec(),
            canvases: Vec::with_capacity(n_canvases),
            index: 0,
            steps: Vec::new(),
            logprobs: Vec::new(),
            t: params.max_denoising_steps,
            step_counter: 0,
            prompt_left,
            shared,
            whole,
            prefix_use,
            state: if n_canvases == 0 {
                RunState::Done
            } else {
                RunState::Running
            },
            bias: Vec::new(),
        })
    }

    /// One round of `runs`: a piece of each prompt still being encoded, then one denoising
    /// step of every run whose prompt is in, in one decoder pass (`decode_steps_async`),
    /// then each run's acceptance and renoising; a run whose canvas ends commits it (an
    /// encoder pass) and starts the next, or is done. `on_step` gets each run's index in
    /// `runs` and its step; breaking stops that run (its `finish` says `Cancelled`).
    ///
    /// A run still encoding its prompt encodes one piece of it (an encoder pass of
    /// `pass_rows` tokens), so a long prompt that arrives does not hold the running
    /// requests' steps back; a prompt whose last piece runs denoises in the same round. The
    /// pieces are the ones a whole-prompt encode makes, so its K/V and its generation are the
    /// same. With `store`, shared prompt parts go through the prefix store before the pieces
    /// and after them (`settle_shared_prefixes`): a request whose system turn is stored by
    /// another, or by its own piece, encodes a piece of its own turn in that round too.
    /// Without it, a run started with a store whose shared part was not stored encodes its
    /// whole prompt itself.
    ///
    /// A pass that does not fit in memory is split in halves until its parts do (nothing of
    /// a run changes before its pass has run, so a part runs as the whole would have); a
    /// run that does not fit alone, or whose commit or prompt piece fails, fails alone (its
    /// `finish` gives the error; a failed commit's step was already given to `on_step`) and
    /// the others go on. Any other error of a decoder pass is every run's.
    pub async fn step_runs_async(
        &self,
        ctx: &GpuContext,
        runs: &mut [&mut DgemmaRun<'_>],
        mut store: Option<RoundStore<'_>>,
        on_step: &mut dyn FnMut(usize, StepReport<'_>) -> ControlFlow<()>,
    ) -> Result<(), ModelError> {
        // Pieces before the step: a request that arrives with a prompt of one piece takes
        // its first step in this round, not the next, and the round's work is the same.
        match store.as_mut() {
            Some(store) => {
                store.settle(self, ctx, runs);
            }
            // Without the store a run waiting for its shared part would wait forever: it
            // encodes its whole prompt itself.
            None => {
                for run in runs.iter_mut() {
                    if matches!(run.shared, SharedPart::Waiting(_)) {
                        run.shared = SharedPart::Settled;
                        run.prefix_use = Some(PrefixUse::Uncached);
                    }
                }
            }
        }
        let encoding: Vec<usize> = (0..runs.len())
            .filter(|&i| {
                let r = &runs[i];
                !r.is_done() && r.prompt_left > 0 && !matches!(r.shared, SharedPart::Waiting(_))
            })
            .collect();
        for i in encoding {
            let run = &mut *runs[i];
            if let Err(e) = self.encode_prompt_piece(ctx, run) {
                run.state = RunState::Failed(e);
            }
        }
        if let Some(store) = store.as_mut() {
            let settled = store.settle(self, ctx, runs);
            self.encode_settled_pieces(ctx, runs, &settled);
        }
        let live: Vec<usize> = (0..runs.len())
            .filter(|&i| !runs[i].is_done() && runs[i].prompt_left == 0)
            .collect();
        self.denoise_runs(ctx, runs, &live, on_step).await
    }

    /// The next piece of `run`'s prompt into its cache.
    fn encode_prompt_piece(
        &self,
        ctx: &GpuContext,
        run: &mut DgemmaRun<'_>,
    ) -> Result<(), ModelError> {
        let from = run.sequence.len() - run.prompt_left;
        let mut n = run.prompt_left.min(run.cache.pass_rows.max(1));
        // A shared part to store ends a piece: the store copies its rows before the rest
        // is encoded (a sliding layer's rows are then still the part's own).
        if let SharedPart::Encoding(end) = run.shared
            && from < end
        {
            n = n.min(end - from);
        }
        self.append(ctx, &mut run.cache, &run.sequence[from..from + n])?;
        run.prompt_left -= n;
        Ok(())
    }

    /// The denoising step of the runs `live` (ready to denoise), in passes that fit.
    async fn denoise_runs(
        &self,
        ctx: &GpuContext,
        runs: &mut [&mut DgemmaRun<'_>],
        live: &[usize],
        on_step: &mut dyn FnMut(usize, StepReport<'_>) -> ControlFlow<()>,
    ) -> Result<(), ModelError> {
        let vocab = self.cfg.vocab_size;
        if live.is_empty() {
            return Ok(());
        }
        let mut pending = self.limit().passes(live);
        // Under a limit the passes differ in size; the one the kept step buffers fit runs
        // first, so a step reallocates them once, not once per pass.
        let canvas = self.cfg.canvas_length;
        if let Some(k) = self
            .kept_step_rows()
            .and_then(|rows| pending.iter().position(|p| p.len() * canvas == rows))
        {
            let fits = pending.remove(k);
            pending.insert(0, fits);
        }
        pending.reverse();
        let mut ran: Vec<(usize, usize, Vec<RowStats>)> = Vec::with_capacity(live.len());
        let (mut widest, mut split) = (0, false);
        while let Some(pass) = pending.pop() {
            let canvases: Vec<DecodeCanvas<'_>> =
                pass.iter().map(|&i| runs[i].decode_canvas()).collect();
            match self.decode_steps_async(ctx, &canvases).await {
                Ok(stats) => {
                    widest = widest.max(pass.len());
                    ran.extend(pass.iter().zip(stats).map(|(&i, s)| (i, pass.len(), s)));
                }
                Err(e) if is_capacity(&e) && pass.len() > 1 => {
                    split = true;
                    let (first, second) = pass.split_at(pass.len() / 2);
                    pending.push(second.to_vec());
                    pending.push(first.to_vec());
                }
                Err(e) if is_capacity(&e) => {
                    split = true;
                    runs[pass[0]].state = RunState::Failed(e);
                }
                Err(e) => return Err(e),
            }
        }
        self.limit().after_step(widest, split);
        ran.sort_by_key(|r| r.0);
        for (i, pass_canvases, stats) in ran {
            let run = &mut *runs[i];
            run.step_counter = run.step_counter.wrapping_add(1);
            let len = run.canvas.tokens.len();
            let rows: Vec<(u32, f32)> = stats.iter().map(|r| (r.argmax, r.entropy)).collect();
            let sampled = run
                .draws
                .replayed_categorical(len)
                .unwrap_or_else(|| stats.iter().map(|r| r.sampled).collect());
            let step = step_from_rows(
                &rows,
                sampled,
                vocab,
                run.t,
                &run.params,
                &mut run.canvas,
                &mut *run.draws,
            );
            let entropies: Vec<f32> = rows.iter().map(|r| r.1).collect();
            run.logprobs = stats.iter().map(|r| r.logprob).collect();
            let flow = on_step(
                i,
                StepReport {
                    canvas: run.index,
                    step: &step,
                    entropies: &entropies,
                    logprobs: &run.logprobs,
                    pass_canvases,
                },
            );
            if flow.is_break() {
                run.state = RunState::Cancelled(run.step_counter as usize);
                continue;
            }
            let stop = step.stop;
            run.steps.push(step);
            run.t -= 1;
            if (stop || run.t == 0)
                && let Err(e) = self.end_canvas(ctx, run, vocab)
            {
                run.state = RunState::Failed(e);
            }
        }
        Ok(())
    }

    /// Most canvases one decoder pass takes now (`None`: no limit): lowered when a batched
    /// step did not fit in memory, raised again after `PROBE_AFTER` steps that did.
    pub fn pass_limit(&self) -> Option<usize> {
        self.limit().get()
    }

    fn limit(&self) -> std::sync::MutexGuard<'_, PassLimit> {
        self.pass_limit.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The canvas's output (its last argmax) joins the sequence; at an eos or the last
    /// canvas the run is done, else the output is committed to the cache and the next
    /// canvas starts.
    fn end_canvas(
        &self,
        ctx: &GpuContext,
        run: &mut DgemmaRun<'_>,
        vocab: usize,
    ) -> Result<(), ModelError> {
        let steps = std::mem::take(&mut run.steps);
        let output = steps.last().map(|s| s.argmax.clone()).unwrap_or_default();
        let mut appended = output.clone();
        let eos = pad_after_eos(&mut appended, &run.params);
        run.sequence.extend_from_slice(&appended);
        run.canvases.push(GeneratedCanvas {
            init: std::mem::take(&mut run.init),
            steps,
            output,
            logprobs: std::mem::take(&mut run.logprobs),
        });
        if eos || run.index + 1 == run.n_canvases {
            run.state = RunState::Done;
            return Ok(());
        }
        self.append(ctx, &mut run.cache, &appended)?;
        run.index += 1;
        run.next_canvas(vocab);
        Ok(())
    }
}
