//! The reference LLaDA sampler (`generate` of the official repository) as a state machine
//! over the canvas. Each step the GPU predicts a (token, confidence) pair for the rows this
//! sampler asks for; the sampler decides which predictions to commit. Committed tokens are
//! final; the rest stay masked and are predicted again at the next step.
//!
//! Two schedules decide how many positions a step unmasks: LLaDA's (each block's masks
//! split evenly over its steps) and Dream's timestep schedule (`dream`).

pub mod bias;
mod dream;
pub mod entropy_bound;
mod params;
mod select;

pub use bias::{IdBias, LogitBias};
pub use params::{GenerationParams, Remasking, Schedule};
pub use select::{ConfidenceKind, SelectParams};

use std::collections::VecDeque;
use std::ops::Range;

use half::bf16;

use crate::error::SamplerError;
use crate::rng::SplitMix64;

/// What one step committed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRecord {
    /// Step index within the block (the reference's `i`).
    pub step: usize,
    pub block: usize,
    /// (position, token) pairs, positions ascending.
    pub committed: Vec<(u32, u32)>,
}

/// The canvas and the schedule of one generation.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: GenerationParams,
    mask_id: u32,
    prompt_len: usize,
    /// End of the generated canvas: a suffix (infilling) follows it up to the end.
    canvas_end: usize,
    tokens: Vec<u32>,
    /// Positions of the prompt and the suffix that held a real token at the start; CFG's
    /// unconditional input masks exactly these.
    prompt_index: Vec<bool>,
    num_blocks: usize,
    /// `None` in threshold mode.
    steps_per_block: Option<usize>,
    /// Commits per step of the current block (quota mode).
    quotas: Vec<usize>,
    block: usize,
    step_in_block: usize,
    global_step: usize,
    rng: SplitMix64,
    /// Uniform numbers to use before `rng`'s, in order (`with_draws`).
    draws: VecDeque<f32>,
}

impl Sampler {
    /// Starts a generation of `params.gen_length` masked tokens after `prompt`. The prompt
    /// may itself contain `mask_id` (infilling); those positions are predicted too.
    pub fn new(
        prompt: &[u32],
        params: GenerationParams,
        mask_id: u32,
        max_len: usize,
    ) -> Result<Self, SamplerError> {
        Self::with_suffix(prompt, &[], params, mask_id, max_len)
    }

    /// Starts a generation of `params.gen_length` masked tokens between `prompt` and
    /// `suffix` (infilling): the suffix is context every step sees, never predicted, and
    /// the generation is the canvas between the two.
    pub fn with_suffix(
        prompt: &[u32],
        suffix: &[u32],
        params: GenerationParams,
        mask_id: u32,
        max_len: usize,
    ) -> Result<Self, SamplerError> {
        let mut params = params;
        if params.schedule == Schedule::Auto {
            params.schedule = Schedule::Llada;
        }
        let num_blocks = params.validate(prompt.len(), suffix.len(), max_len)?;
        if let Some(position) = suffix.iter().position(|&t| t == mask_id) {
            return Err(SamplerError::MaskInSuffix { position });
        }
        let steps_per_block = match params.threshold {
            Some(_) => None,
            None => Some(params.steps / num_blocks),
        };
        let canvas_end = prompt.len() + params.gen_length;
        let mut tokens = Vec::with_capacity(canvas_end + suffix.len());
        tokens.extend_from_slice(prompt);
        tokens.resize(canvas_end, mask_id);
        tokens.extend_from_slice(suffix);
        let prompt_index = tokens.iter().map(|&t| t != mask_id).collect();
        let rng = SplitMix64(params.seed);
        let mut sampler = Self {
            params,
            mask_id,
            prompt_len: prompt.len(),
            canvas_end,
            tokens,
            prompt_index,
            num_blocks,
            steps_per_block,
            quotas: Vec::new(),
            block: 0,
            step_in_block: 0,
            global_step: 0,
            rng,
            draws: VecDeque::new(),
        };
        sampler.enter_block();
        sampler.settle();
        Ok(sampler)
    }

    /// Uses `draws` as the next uniform numbers in [0, 1) (random remasking and
    /// `alg_temp` draw them) before the seeded generator's: to replay a reference's draws.
    pub fn with_draws(mut self, draws: impl IntoIterator<Item = f32>) -> Self {
        self.draws.extend(draws);
        self
    }

    /// The next uniform number in [0, 1).
    fn draw(&mut self) -> f32 {
        match self.draws.pop_front() {
            Some(u) => u,
            None => uniform_f32(&mut self.rng),
        }
    }

    /// The whole sequence: the prompt, the canvas (committed tokens and masks), then the
    /// suffix when infilling.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The canvas: after the prompt, before the suffix.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.canvas()]
    }

    /// Positions of the canvas in the sequence.
    pub fn canvas(&self) -> Range<usize> {
        self.prompt_len..self.canvas_end
    }

    /// Tokens after the canvas (infilling's suffix; 0 without one).
    pub fn suffix_len(&self) -> usize {
        self.tokens.len() - self.canvas_end
    }

    /// The input of CFG's unconditional pass: the prompt's tokens masked, the canvas kept.
    pub fn unconditional_tokens(&self) -> Vec<u32> {
        let mut tokens = self.tokens.clone();
        for (token, &is_prompt) in tokens.iter_mut().zip(&self.prompt_index) {
            if is_prompt {
                *token = self.mask_id;
            }
        }
        tokens
    }

    pub fn is_done(&self) -> bool {
        self.block >= self.num_blocks
    }

    /// Absolute positions of the current block; empty (at the end) once done.
    pub fn block(&self) -> Range<usize> {
        if self.is_done() {
            return self.canvas_end..self.canvas_end;
        }
        let start = self.prompt_len + self.block * self.params.block_length;
        start..start + self.params.block_length
    }

    /// Index of the current block.
    pub fn block_index(&self) -> usize {
        self.block
    }

    /// Step within the current block, counted as the reference does (steps with nothing
    /// to commit are skipped but keep their index).
    pub fn step_in_block(&self) -> usize {
        self.step_in_block
    }

    /// Steps committed so far over the whole generation.
    pub fn global_step(&self) -> usize {
        self.global_step
    }

    /// Commits this step will make, in quota mode (under Dream's `origin`, the most it may
    /// make).
    pub fn quota(&self) -> Option<usize> {
        if self.is_done() {
            return None;
        }
        if self.dream_first_step() {
            return Some(1);
        }
        self.steps_per_block.map(|_| self.step_quota())
    }

    /// Commits of the current step in quota mode.
    fn step_quota(&self) -> usize {
        match self.params.schedule {
            Schedule::Dream { .. } => self.dream_quota(),
            Schedule::Llada | Schedule::Auto => self.quotas[self.step_in_block],
        }
    }

    pub fn params(&self) -> &GenerationParams {
        &self.params
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    pub fn mask_id(&self) -> u32 {
        self.mask_id
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// `None` in threshold mode, where a block takes as many steps as it needs.
    pub fn steps_per_block(&self) -> Option<usize> {
        self.steps_per_block
    }

    /// Steps of the quota schedule not reached yet (`None` in threshold mode).
    pub fn steps_left(&self) -> Option<usize> {
        let spb = self.steps_per_block?;
        let blocks_left = self.num_blocks.saturating_sub(self.block);
        Some((blocks_left * spb).saturating_sub(self.step_in_block.min(spb)))
    }

    /// Canvas tokens of the answer once it can no longer change: a token of `stops`
    /// committed at canvas position q with every position before it committed (masks of
    /// the prompt included). Committed tokens never change, so the text up to the first
    /// stop is then that of the whole canvas. `None` while it can still change.
    pub fn final_answer_len(&self, stops: &[u32]) -> Option<usize> {
        let canvas = self.generated();
        let q = canvas.iter().position(|t| stops.contains(t))?;
        let end = self.prompt_len + q;
        (!self.tokens[..end].contains(&self.mask_id)).then_some(q)
    }

    /// Positions that need a prediction this step: every masked position before the end
    /// of the current block, masked prompt positions included. Ascending; empty once done.
    pub fn rows_to_predict(&self) -> Vec<u32> {
        if self.is_done() {
            return Vec::new();
        }
        if let Schedule::Dream { .. } = self.params.schedule {
            return self.dream_rows();
        }
        let end = self.block().end;
        (0..end)
            .filter(|&p| self.tokens[p] == self.mask_id)
            .map(|p| p as u32)
            .collect()
    }

    /// Commits one step from the GPU's (token, confidence) per row of `rows_to_predict`,
    /// in the same order. With `Remasking::Random` the confidences are replaced by this
    /// sampler's random numbers.
    pub fn commit(&mut self, predictions: &[(u32, f32)]) -> Result<StepRecord, SamplerError> {
        if self.is_done() {
            return Err(SamplerError::Finished);
        }
        let rows = self.rows_to_predict();
        if predictions.len() != rows.len() {
            return Err(SamplerError::PredictionCount {
                expected: rows.len(),
                found: predictions.len(),
            });
        }
        let tokens: Vec<u32> = predictions.iter().map(|&(t, _)| t).collect();
        if let Schedule::Dream { .. } = self.params.schedule
            && (self.dream_first_step() || self.params.remasking == Remasking::Random)
        {
            return Ok(self.dream_commit_unranked(&rows, &tokens));
        }
        let confidences: Vec<f32> = match self.params.remasking {
            Remasking::Random => {
                // One number per position of the whole sequence, as `torch.rand((B, T))`
                // draws.
                let uniforms: Vec<f32> = (0..self.tokens.len()).map(|_| self.draw()).collect();
                rows.iter().map(|&p| uniforms[p as usize]).collect()
            }
            _ if self.params.round_confidence_bf16 => predictions
                .iter()
                .map(|&(_, c)| bf16::from_f32(c).to_f32())
                .collect(),
            _ => predictions.iter().map(|&(_, c)| c).collect(),
        };
        self.apply(&rows, &tokens, &confidences)
    }

    /// Commits one step with the given ranking numbers (one per row of `rows_to_predict`)
    /// used exactly as given: no bf16 rounding and no random draw.
    pub fn commit_with_confidences(
        &mut self,
        tokens: &[u32],
        confidences: &[f32],
    ) -> Result<StepRecord, SamplerError> {
        if self.is_done() {
            return Err(SamplerError::Finished);
        }
        let rows = self.rows_to_predict();
        if tokens.len() != rows.len() {
            return Err(SamplerError::PredictionCount {
                expected: rows.len(),
                found: tokens.len(),
            });
        }
        if confidences.len() != tokens.len() {
            return Err(SamplerError::ConfidenceCount {
                tokens: tokens.len(),
                confidences: confidences.len(),
            });
        }
        self.apply(&rows, tokens, confidences)
    }

    fn apply(
        &mut self,
        rows: &[u32],
        tokens: &[u32],
        confidences: &[f32],
    ) -> Result<StepRecord, SamplerError> {
        // NaN never wins; -0.0 ties with 0.0 as it does in torch.topk.
        let key = |c: f32| {
            if c.is_nan() {
                f32::NEG_INFINITY
            } else {
                c + 0.0
            }
        };
        let mut order: Vec<usize> = (0..rows.len()).collect();
        // Highest confidence first; ties go to the lowest position.
        order.sort_by(|&a, &b| {
            key(confidences[b])
                .total_cmp(&key(confidences[a]))
                .then(rows[a].cmp(&rows[b]))
        });
        let chosen: Vec<usize> = match self.params.threshold {
            None => {
                let take = self.step_quota().min(rows.len());
                if self.params.alg_temp > 0.0 {
                    let weights = tempered_weights(confidences, self.params.alg_temp);
                    self.draw_without_replacement(&weights, take)
                } else {
                    order[..take].to_vec()
                }
            }
            Some(threshold) => {
                // A predicted mask commits nothing and threshold decoding ends only when no
                // mask is left: such rows are passed over, so every step unmasks a position.
                let live: Vec<usize> = order
                    .into_iter()
                    .filter(|&i| tokens[i] != self.mask_id)
                    .collect();
                if live.is_empty() {
                    return Err(SamplerError::OnlyMaskPredicted { rows: rows.len() });
                }
                let confident = live
                    .iter()
                    .filter(|&&i| key(confidences[i]) >= threshold)
                    .count();
                live[..confident.max(1)].to_vec()
            }
        };
        let committed = chosen.iter().map(|&i| (rows[i], tokens[i])).collect();
        Ok(self.finish_step(committed))
    }

    /// Writes a step's commits into the canvas and moves to the next step.
    fn finish_step(&mut self, mut committed: Vec<(u32, u32)>) -> StepRecord {
        committed.sort_unstable();
        for &(position, token) in &committed {
            self.tokens[position as usize] = token;
        }
        let record = StepRecord {
            step: self.step_in_block,
            block: self.block,
            committed,
        };
        self.step_in_block += 1;
        self.global_step += 1;
        self.settle();
        record
    }

    /// `n` of the rows with the given weights (any scale, >= 0), drawn one at a time
    /// without replacement: each draw u picks, among the rows not yet drawn in order, the
    /// first whose running weight exceeds u times their total (the last one when rounding
    /// leaves none).
    fn draw_without_replacement(&mut self, weights: &[f64], n: usize) -> Vec<usize> {
        let mut left: Vec<usize> = (0..weights.len()).collect();
        let mut chosen = Vec::with_capacity(n);
        for _ in 0..n.min(weights.len()) {
            let total: f64 = left.iter().map(|&i| weights[i]).sum();
            let target = f64::from(self.draw()) * total;
            let mut running = 0.0;
            let mut pick = left.len() - 1;
            for (k, &i) in left.iter().enumerate() {
                running += weights[i];
                if running > target {
                    pick = k;
                    break;
                }
            }
            chosen.push(left.remove(pick));
        }
        chosen
    }

    /// Schedules the current block: the reference splits the block's masks over its steps,
    /// the first `n % steps` steps taking one more.
    fn enter_block(&mut self) {
        self.step_in_block = 0;
        self.quotas.clear();
        if let Schedule::Dream { .. } = self.params.schedule {
            return;
        }
        if let Some(steps) = self.steps_per_block {
            let range = self.block();
            let n = self.tokens[range]
                .iter()
                .filter(|&&t| t == self.mask_id)
                .count();
            // Past one step per mask the reference's quotas are 0 and its steps commit
            // nothing: the schedule is the same with those steps left out, so a huge
            // `steps` costs nothing here.
            let steps = steps.min(n).max(1);
            let (base, rem) = (n / steps, n % steps);
            self.quotas = (0..steps).map(|i| base + usize::from(i < rem)).collect();
        }
    }

    /// Moves past steps and blocks with nothing to commit, so that whenever the sampler is
    /// not done the next step commits at least one token.
    fn settle(&mut self) {
        while !self.is_done() {
            if let Schedule::Dream { .. } = self.params.schedule {
                if !self.dream_block_finished() {
                    return;
                }
                self.block += 1;
                if !self.is_done() {
                    self.enter_block();
                }
                continue;
            }
            let finished = match self.steps_per_block {
                Some(_) => {
                    let steps = self.quotas.len();
                    while self.step_in_block < steps && self.quotas[self.step_in_block] == 0 {
                        self.step_in_block += 1;
                    }
                    self.step_in_block >= steps
                }
                None => {
                    let range = self.block();
                    !self.tokens[range].contains(&self.mask_id)
                }
            };
            // Unreachable through the quota arithmetic, but an empty step must never be
            // requested.
            if !finished && !self.rows_to_predict().is_empty() {
                return;
            }
            self.block += 1;
            if !self.is_done() {
                self.enter_block();
            }
        }
    }
}

/// `softmax(confidence / temperature)` in f64: the weights of `alg_temp` sampling (NaN
/// weighs nothing).
fn tempered_weights(confidences: &[f32], temperature: f32) -> Vec<f64> {
    let scaled: Vec<f64> = confidences
        .iter()
        .map(|&c| f64::from(c) / f64::from(temperature))
        .map(|x| if x.is_nan() { f64::NEG_INFINITY } else { x })
        .collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return vec![1.0; scaled.len()];
    }
    scaled.iter().map(|&x| (x - max).exp()).collect()
}

/// Uniform f32 in [0, 1) from the top 24 bits, exactly representable.
fn uniform_f32(rng: &mut SplitMix64) -> f32 {
    (rng.next_u64() >> 40) as f32 * (1.0 / 16_777_216.0)
}

#[cfg(test)]
mod tests;
