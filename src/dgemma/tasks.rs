//! Requests run together: `start` checks one, copies its system turn from the prefix store
//! when stored and draws its first canvas, `step_async` denoises every running one by a step
//! in one decoder pass (and encodes a piece of each newer one's prompt, an unstored system
//! turn included, which is then stored), `finish` gives the output back. `generate_async` is
//! one request run so.

use std::ops::ControlFlow;

use unmask_core::sampler::LogitBias;
use unmask_core::sampler::entropy_bound::SeededDraws;
use unmask_core::tokenizer::DecodeMode;
use unmask_gpu::dgemma::{DgemmaRun, RoundStore, SharedPrefix, StepReport};

use super::{DgemmaEngine, DgemmaOutput, DgemmaRequest, refused};
use crate::EngineError;
use crate::clock::Stopwatch;

/// A request started by `DgemmaEngine::start`: its generation in progress.
pub struct DgemmaTask {
    run: DgemmaRun<'static>,
    prompt_ids: Vec<u32>,
    start: Stopwatch,
}

impl DgemmaTask {
    /// Whether it has ended (its last canvas, an eos, or a stop): `finish` it.
    pub fn is_done(&self) -> bool {
        self.run.is_done()
    }

    /// Denoising steps run so far, over every canvas.
    pub fn steps_run(&self) -> usize {
        self.run.steps_run()
    }

    pub fn prompt_ids(&self) -> &[u32] {
        &self.prompt_ids
    }
}

impl DgemmaEngine {
    /// Checks `request`, copies its system turn from the prefix store when stored and draws
    /// its first canvas; the rest of the prompt is encoded by the next steps, a piece each
    /// (an unstored system turn too, then stored; requests that arrive with the same one
    /// wait for that one encoding). A request the model cannot run is refused here, by name.
    pub fn start(&self, request: &DgemmaRequest) -> Result<DgemmaTask, EngineError> {
        let (ids, shared) = self.encode_prompt(&request.prompt)?;
        let cfg = &self.model.cfg;
        if ids.is_empty() {
            return Err(refused("prompt: expected at least one token, found none"));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(refused(&format!(
                "prompt ids: expected ids below the vocabulary size {}, found {bad}",
                cfg.vocab_size
            )));
        }
        let bias = LogitBias::with_ids(request.logit_bias.clone())
            .and_then(|b| b.check(Some(cfg.vocab_size)).map(|()| b))
            .map_err(|e| refused(&e.to_string()))?;
        let mut params = self.params.clone();
        params.max_new_tokens = request.max_new_tokens.unwrap_or(params.max_new_tokens);
        params.max_denoising_steps = request
            .max_denoising_steps
            .unwrap_or(params.max_denoising_steps);
        if params.max_new_tokens == 0 {
            return Err(refused("max_new_tokens: expected at least 1, found 0"));
        }
        let len = cfg.canvas_length;
        let positions = ids.len() + params.max_new_tokens.div_ceil(len) * len;
        if positions > self.model.max_positions {
            return Err(refused(&format!(
                "prompt and answer: {} prompt tokens + {} canvas positions exceed the model's \
                 {} positions",
                ids.len(),
                positions - ids.len(),
                self.model.max_positions
            )));
        }
        let start = Stopwatch::start();
        let draws = Box::new(SeededDraws::new(request.seed));
        // Locked for the copy of a stored system turn alone (its passes are submitted, not
        // awaited).
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let wanted = (request.share_system && shared > 0) || request.share_prompt;
        let prefix = wanted.then_some(SharedPrefix {
            shared: if request.share_system { shared } else { 0 },
            whole_prompt: request.share_prompt,
            store: &mut store,
        });
        let mut run = self
            .model
            .start(&self.ctx, &ids, prefix, &params, draws, request.seed)?;
        drop(store);
        run.set_logit_bias(&bias.ids);
        Ok(DgemmaTask {
            run,
            prompt_ids: ids,
            start,
        })
    }

    /// One round of the tasks: a piece of each prompt still being encoded, then one
    /// denoising step of every task whose prompt is in, in one decoder pass (rows of all
    /// their canvases through each matmul and the experts, attention per task over its own
    /// cache). `on_step` gets each task's index in `tasks` and its step; breaking stops that
    /// task (its `finish` says `Cancelled`). A batch that does not fit in memory runs in
    /// smaller passes, and a task that fails alone (no memory for its own pass, its commit)
    /// is done with its `finish` giving the error; any other error is every task's.
    pub async fn step_async(
        &self,
        tasks: &mut [&mut DgemmaTask],
        on_step: &mut dyn FnMut(usize, StepReport<'_>) -> ControlFlow<()>,
    ) -> Result<(), EngineError> {
        let mut runs: Vec<&mut DgemmaRun<'static>> = tasks.iter_mut().map(|t| &mut t.run).collect();
        // The store is locked for each of the round's uses alone (a request that arrived
        // gets its encoder or copies its system turn; a turn whose last piece ran is
        // stored), never across its passes.
        let store = Some(RoundStore::Locked(&self.store));
        self.model
            .step_runs_async(&self.ctx, &mut runs, store, on_step)
            .await?;
        Ok(())
    }

    /// `step_async` without step events, blocking (natively).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&self, tasks: &mut [&mut DgemmaTask]) -> Result<(), EngineError> {
        pollster::block_on(self.step_async(tasks, &mut |_, _| ControlFlow::Continue(())))
    }

    /// The output of a task that is done (`is_done`); a stopped one gives
    /// `ModelError::Cancelled`.
    pub fn finish(&self, task: DgemmaTask) -> Result<DgemmaOutput, EngineError> {
        if !task.is_done() {
            return Err(EngineError::Internal(
                "a DiffusionGemma task was finished while it still runs".into(),
            ));
        }
        let (g, prefix) = task.run.finish()?;
        let ids = task.prompt_ids;
        let answer = g.sequence[ids.len()..].to_vec();
        let text = match &self.tokenizer {
            Some(t) => Some(t.decode(&answer, DecodeMode::Clean)?),
            None => None,
        };
        Ok(DgemmaOutput {
            prompt_ids: ids,
            ids: answer,
            text,
            canvases: g.canvases,
            prefix,
            seconds: task.start.elapsed_s(),
        })
    }
}
