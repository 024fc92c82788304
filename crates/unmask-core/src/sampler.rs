//! The reference LLaDA sampler (`generate` of the official repository) as a state machine
//! over the canvas. Each step the GPU predicts a (token, confidence) pair for the rows this
//! sampler asks for; the sampler decides which predictions to commit. Committed tokens are
//! final; the rest stay masked and are predicted again at the next step.
//!
//! Two schedules decide how many positions a step unmasks: LLaDA's (each block's masks
//! split evenly over its steps) and Dream's timestep schedule (`dream`).

mod dream;
pub mod entropy_bound;
mod params;

pub use params::{GenerationParams, Remasking, Schedule};

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

/// Which confidence of its prediction a row reports (the value positions are ranked by).
/// All are computed on the CFG-combined logits after `suppress_token` and the top-p/top-k
/// cut, untempered unless `SelectParams::tempered`; the chosen token is the same for every
/// kind.
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConfidenceKind {
    /// The softmax probability of the chosen token (LLaDA `low_confidence`; Dream
    /// `maskgit_plus`), with `SelectParams::conf_exclude` left out of the softmax.
    #[default]
    Probability,
    /// Top-1 minus top-2 softmax probability of the row (Dream `topk_margin`): 0 when the
    /// two largest logits tie, 1/Z with one column.
    Margin,
    /// Negative entropy `sum p log p` of the row's softmax (Dream `entropy`), at most 0.
    /// Dream adds 1e-10 inside the log; this does not (the sum changes by less than
    /// `vocab * 1e-10`, under 2e-5 at 152k ids).
    NegEntropy,
}

/// How one row's token and confidence are chosen (LLaDA `generate`, one denoising step):
/// what the GPU's selection kernel is given, and the CPU oracle reproduces.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectParams {
    /// Gumbel-noise temperature; 0 is a plain argmax.
    pub temperature: f32,
    /// Classifier-free guidance weight `w`: `l = u + (w + 1)(c - u)` when unconditional
    /// logits are given.
    pub cfg_scale: f32,
    pub seed: u64,
    /// Denoising step index: a counter of the noise, so every step draws fresh noise.
    pub step: u32,
    /// `logits_eos_inf`: this id's logit is -inf before anything else.
    pub suppress_token: Option<u32>,
    /// Ids left out of the confidence softmax after the token was chosen
    /// (`confidence_eos_eot_inf`); a chosen excluded id has confidence 0. Only
    /// `ConfidenceKind::Probability` uses them; the other kinds see the whole row.
    pub conf_exclude: [Option<u32>; 2],
    /// Which confidence the row reports.
    pub confidence: ConfidenceKind,
    /// The confidence softmax is over `l / T` when T > 0 (Dream's `sample_tokens`) instead
    /// of `l` (LLaDA's `generate`). The token is the same either way.
    pub tempered: bool,
    /// Nucleus cut before the token choice (Dream's `top_p_logits`): over the ids sorted by
    /// logit, an id stays when the probability of the ids strictly above it is at most
    /// `top_p` (so the most probable id always stays). The probabilities are `softmax(l / T)`
    /// at T > 0 and `softmax(l)` at T = 0. Ids with equal logits stay or go together.
    /// Cut ids are out of the token choice and of every confidence. `None` or 1 keeps all.
    pub top_p: Option<f32>,
    /// Keeps the ids whose logit is at least the k-th largest (Dream's `top_k_logits`, ties
    /// included); with `top_p`, an id must pass both.
    pub top_k: Option<u32>,
}

impl SelectParams {
    /// Whether some ids may be cut from a row.
    pub fn cuts(&self) -> bool {
        self.top_p.is_some_and(|p| p < 1.0) || self.top_k.is_some()
    }
}

impl Default for SelectParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            cfg_scale: 0.0,
            seed: 0,
            step: 0,
            suppress_token: None,
            conf_exclude: [None; 2],
            confidence: ConfidenceKind::Probability,
            tempered: false,
            top_p: None,
            top_k: None,
        }
    }
}

/// The canvas and the schedule of one generation.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: GenerationParams,
    mask_id: u32,
    prompt_len: usize,
    tokens: Vec<u32>,
    /// Prompt positions that held a real token at the start; CFG's unconditional input
    /// masks exactly these.
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
        let mut params = params;
        if params.schedule == Schedule::Auto {
            params.schedule = Schedule::Llada;
        }
        let num_blocks = params.validate(prompt.len(), max_len)?;
        let steps_per_block = match params.threshold {
            Some(_) => None,
            None => Some(params.steps / num_blocks),
        };
        let mut tokens = Vec::with_capacity(prompt.len() + params.gen_length);
        tokens.extend_from_slice(prompt);
        tokens.resize(prompt.len() + params.gen_length, mask_id);
        let prompt_index = prompt.iter().map(|&t| t != mask_id).collect();
        let rng = SplitMix64(params.seed);
        let mut sampler = Self {
            params,
            mask_id,
            prompt_len: prompt.len(),
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

    /// Prompt followed by the canvas (committed tokens and masks).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The canvas after the prompt.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
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
            return self.tokens.len()..self.tokens.len();
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
        let canvas = &self.tokens[self.prompt_len..];
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
        Ok(self.apply(&rows, &tokens, &confidences))
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
        Ok(self.apply(&rows, tokens, confidences))
    }

    fn apply(&mut self, rows: &[u32], tokens: &[u32], confidences: &[f32]) -> StepRecord {
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
                let confident = order
                    .iter()
                    .filter(|&&i| key(confidences[i]) >= threshold)
                    .count();
                order[..confident.max(1).min(rows.len())].to_vec()
            }
        };
        let committed = chosen.iter().map(|&i| (rows[i], tokens[i])).collect();
        self.finish_step(committed)
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
mod tests {
    use super::*;

    const MASK: u32 = 99;

    fn params(gen_length: usize, steps: usize, block_length: usize) -> GenerationParams {
        GenerationParams {
            gen_length,
            steps,
            block_length,
            round_confidence_bf16: false,
            ..GenerationParams::default()
        }
    }

    /// Runs to the end, predicting token `1000 + position` with confidence `conf(position)`.
    pub(super) fn run(sampler: &mut Sampler, conf: impl Fn(u32) -> f32) -> Vec<StepRecord> {
        let mut records = Vec::new();
        while !sampler.is_done() {
            let rows = sampler.rows_to_predict();
            assert!(!rows.is_empty());
            let predictions: Vec<(u32, f32)> = rows.iter().map(|&p| (1000 + p, conf(p))).collect();
            records.push(sampler.commit(&predictions).unwrap());
        }
        records
    }

    pub(super) fn counts(records: &[StepRecord]) -> Vec<usize> {
        records.iter().map(|r| r.committed.len()).collect()
    }

    #[test]
    fn defaults_are_the_reference_ones() {
        let p = GenerationParams::default();
        assert_eq!((p.gen_length, p.steps, p.block_length), (128, 128, 32));
        assert_eq!(p.temperature, 0.0);
        assert_eq!(p.remasking, Remasking::LowConfidence);
        assert_eq!(p.cfg_scale, 0.0);
        assert_eq!(p.threshold, None);
        assert!(!p.logits_eos_inf && !p.confidence_eos_eot_inf);
        assert_eq!(p.seed, 0);
        assert!(p.round_confidence_bf16);
    }

    #[test]
    fn the_answer_is_final_once_everything_before_its_stop_is_committed() {
        const STOP: u32 = 7;
        // Prompt of 2, canvas of 6 in one block, one commit per step, lowest position
        // committed last: the stop at canvas position 2 is committed before positions 0, 1.
        let mut s = Sampler::new(&[1, 2], params(6, 6, 6), MASK, 64).unwrap();
        assert_eq!(s.steps_left(), Some(6));
        let mut finals = Vec::new();
        while !s.is_done() {
            let rows = s.rows_to_predict();
            let predictions: Vec<(u32, f32)> = rows
                .iter()
                .map(|&p| (if p == 4 { STOP } else { 1000 + p }, p as f32 / 100.0))
                .collect();
            s.commit(&predictions).unwrap();
            finals.push(s.final_answer_len(&[STOP]));
        }
        // Commits go 7, 6, 5, 4 (the stop), 3, 2: final after position 2 is committed.
        assert_eq!(finals, vec![None, None, None, None, None, Some(2)]);
        assert_eq!(s.steps_left(), Some(0));
        // Left to right: final after the third step, with three steps of the schedule left.
        let mut s = Sampler::new(&[1, 2], params(6, 6, 6), MASK, 64).unwrap();
        let mut at = None;
        while at.is_none() {
            let rows = s.rows_to_predict();
            let predictions: Vec<(u32, f32)> = rows
                .iter()
                .map(|&p| (if p == 4 { STOP } else { 1000 + p }, 1.0 - p as f32 / 100.0))
                .collect();
            s.commit(&predictions).unwrap();
            at = s.final_answer_len(&[STOP]);
        }
        assert_eq!((at, s.steps_left(), s.is_done()), (Some(2), Some(3), false));
    }

    #[test]
    fn quotas_with_remainders() {
        // 12 masks in 5 steps: 3, 3, 2, 2, 2.
        let mut s = Sampler::new(&[1, 2, 3], params(12, 5, 12), MASK, 64).unwrap();
        assert_eq!(s.quota(), Some(3));
        let records = run(&mut s, |p| p as f32 / 100.0);
        assert_eq!(counts(&records), vec![3, 3, 2, 2, 2]);
        assert_eq!(
            records.iter().map(|r| r.step).collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 4]
        );
        // Highest confidence first: the last positions are committed first.
        assert_eq!(
            records[0].committed,
            vec![(12, 1012), (13, 1013), (14, 1014)]
        );
        assert!(s.tokens()[3..].iter().all(|&t| t != MASK));
        assert_eq!(s.generated().len(), 12);
    }

    #[test]
    fn more_steps_than_masks_skips_empty_steps() {
        // 2 masks in 4 steps: quotas 1, 1, 0, 0; the empty steps are not requested.
        let mut s = Sampler::new(&[1], params(2, 4, 2), MASK, 64).unwrap();
        let records = run(&mut s, |_| 0.5);
        assert_eq!(counts(&records), vec![1, 1]);
        assert_eq!(s.global_step(), 2);
        assert!(s.is_done());
        assert!(s.rows_to_predict().is_empty());
        assert_eq!(s.commit(&[]), Err(SamplerError::Finished));

        // 1e12 steps: the same schedule, and no table sized by the step count.
        let mut s = Sampler::new(&[1], params(4, 1_000_000_000_000, 2), MASK, 64).unwrap();
        let records = run(&mut s, |_| 0.5);
        assert_eq!(counts(&records), vec![1, 1, 1, 1]);
        assert!(s.quotas.len() <= 2);
    }

    #[test]
    fn block_transitions() {
        // 4 blocks of 4, 2 steps per block, 2 tokens per step.
        let prompt = [5, 6, 7];
        let mut s = Sampler::new(&prompt, params(16, 8, 4), MASK, 64).unwrap();
        assert_eq!(s.num_blocks(), 4);
        assert_eq!(s.steps_per_block(), Some(2));
        for block in 0..4 {
            for step in 0..2 {
                assert_eq!(s.block_index(), block);
                assert_eq!(s.block(), 3 + 4 * block..7 + 4 * block);
                assert_eq!(s.step_in_block(), step);
                assert_eq!(s.global_step(), 2 * block + step);
                let rows = s.rows_to_predict();
                // Only the current block is predicted; earlier blocks are complete.
                assert!(rows.iter().all(|&p| s.block().contains(&(p as usize))));
                assert_eq!(rows.len(), 4 - 2 * step);
                let preds: Vec<(u32, f32)> = rows.iter().map(|&p| (p, 0.5)).collect();
                let r = s.commit(&preds).unwrap();
                assert_eq!((r.block, r.step), (block, step));
                assert_eq!(r.committed.len(), 2);
            }
        }
        assert!(s.is_done());
        assert_eq!(s.block(), 19..19);
        assert_eq!(&s.tokens()[..3], &prompt);
        assert_eq!(s.generated(), (3..19).collect::<Vec<u32>>().as_slice());
    }

    #[test]
    fn ties_go_to_the_lowest_position() {
        let mut s = Sampler::new(&[1], params(6, 3, 6), MASK, 64).unwrap();
        let r = s
            .commit(&[
                (10, 0.5),
                (11, 0.5),
                (12, 0.5),
                (13, 0.5),
                (14, 0.5),
                (15, 0.5),
            ])
            .unwrap();
        assert_eq!(r.committed, vec![(1, 10), (2, 11)]);
        // The tie only matters at the boundary: a higher one still wins.
        let r = s
            .commit(&[(12, 0.5), (13, 0.5), (14, 0.5), (15, 0.75)])
            .unwrap();
        assert_eq!(r.committed, vec![(3, 12), (6, 15)]);
    }

    #[test]
    fn bf16_rounding_creates_ties() {
        // 0.5 and 0.5 + 2^-12 are distinct in f32 but equal in bf16.
        let high = 0.5 + 1.0 / 4096.0;
        let preds = [(10, 0.5), (11, high)];
        let mut p = params(2, 2, 2);
        let mut exact = Sampler::new(&[1], p.clone(), MASK, 64).unwrap();
        assert_eq!(exact.commit(&preds).unwrap().committed, vec![(2, 11)]);
        p.round_confidence_bf16 = true;
        let mut rounded = Sampler::new(&[1], p, MASK, 64).unwrap();
        assert_eq!(rounded.commit(&preds).unwrap().committed, vec![(1, 10)]);
    }

    #[test]
    fn nan_and_negative_zero_confidences() {
        let mut s = Sampler::new(&[1], params(3, 3, 3), MASK, 64).unwrap();
        let r = s.commit(&[(10, f32::NAN), (11, -0.0), (12, 0.0)]).unwrap();
        assert_eq!(r.committed, vec![(2, 11)]);
        let r = s.commit(&[(10, f32::NAN), (12, -1.0)]).unwrap();
        assert_eq!(r.committed, vec![(3, 12)]);
    }

    #[test]
    fn threshold_mode() {
        let mut p = params(8, 1, 4);
        p.threshold = Some(0.9);
        let mut s = Sampler::new(&[1, 2], p, MASK, 64).unwrap();
        assert_eq!(s.steps_per_block(), None);
        assert_eq!(s.quota(), None);
        // Every prediction at or above the threshold is committed.
        let r = s
            .commit(&[(10, 0.95), (11, 0.2), (12, 0.9), (13, 0.3)])
            .unwrap();
        assert_eq!(r.committed, vec![(2, 10), (4, 12)]);
        // None above: only the most confident one.
        let r = s.commit(&[(11, 0.2), (13, 0.3)]).unwrap();
        assert_eq!(r.committed, vec![(5, 13)]);
        assert_eq!(s.block(), 2..6);
        let r = s.commit(&[(11, 0.1)]).unwrap();
        assert_eq!((r.block, r.step), (0, 2));
        // The block has no masks left: the next block starts.
        assert_eq!(s.block(), 6..10);
        assert_eq!(s.step_in_block(), 0);
        let r = s
            .commit(&[(20, 1.0), (21, 1.0), (22, 1.0), (23, 1.0)])
            .unwrap();
        assert_eq!(r.committed.len(), 4);
        assert!(s.is_done());
        assert_eq!(s.global_step(), 4);
        assert_eq!(s.tokens(), &[1, 2, 10, 11, 12, 13, 20, 21, 22, 23]);
    }

    #[test]
    fn masked_prompt_positions_compete_for_the_quota() {
        // Prompt [7, MASK, 8]: the masked prompt position is predicted in every block and
        // takes a commit from the block's quota when it is the most confident.
        let prompt = [7, MASK, 8];
        let mut s = Sampler::new(&prompt, params(4, 4, 2), MASK, 64).unwrap();
        assert_eq!(s.rows_to_predict(), vec![1, 3, 4]);
        assert_eq!(
            s.unconditional_tokens(),
            vec![MASK, MASK, MASK, MASK, MASK, MASK, MASK]
        );
        let r = s.commit(&[(50, 0.9), (51, 0.1), (52, 0.2)]).unwrap();
        assert_eq!(r.committed, vec![(1, 50)]);
        assert_eq!(s.rows_to_predict(), vec![3, 4]);
        let r = s.commit(&[(51, 0.1), (52, 0.2)]).unwrap();
        assert_eq!(r.committed, vec![(4, 52)]);
        // Block 0's two steps are used up with position 3 still masked: it is predicted
        // again in block 1 and competes there.
        assert_eq!(s.block(), 5..7);
        assert_eq!(s.rows_to_predict(), vec![3, 5, 6]);
        // The unconditional input masks only the original prompt tokens.
        let unconditional = s.unconditional_tokens();
        assert_eq!(&unconditional[..3], &[MASK, 50, MASK]);
        assert_eq!(unconditional[4], 52);
        let r = s.commit(&[(60, 0.9), (61, 0.1), (62, 0.2)]).unwrap();
        assert_eq!(r.committed, vec![(3, 60)]);
        let r = s.commit(&[(61, 0.1), (62, 0.2)]).unwrap();
        assert_eq!(r.committed, vec![(6, 62)]);
        // As in the reference, quotas are spent and a mask is left in the output.
        assert!(s.is_done());
        assert_eq!(s.tokens(), &[7, 50, 8, 60, 52, MASK, 62]);
    }

    #[test]
    fn random_remasking_is_seeded() {
        let mut p = params(16, 16, 16);
        p.remasking = Remasking::Random;
        let positions = |seed: u64| {
            let mut p = p.clone();
            p.seed = seed;
            let mut s = Sampler::new(&[1, 2], p, MASK, 64).unwrap();
            // The model's confidences are ignored: a constant changes nothing.
            let records = run(&mut s, |_| 1.0);
            records
                .iter()
                .map(|r| r.committed[0].0)
                .collect::<Vec<u32>>()
        };
        let a = positions(7);
        assert_eq!(a, positions(7));
        assert_ne!(a, positions(8));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (2..18).collect::<Vec<u32>>());
        assert_ne!(a, sorted, "a random order is not left to right");
    }

    #[test]
    fn commit_with_confidences_uses_them_as_given() {
        let mut p = params(4, 4, 4);
        p.remasking = Remasking::Random;
        p.round_confidence_bf16 = true;
        let mut s = Sampler::new(&[1], p, MASK, 64).unwrap();
        let high = 0.5 + 1.0 / 4096.0;
        let r = s
            .commit_with_confidences(&[10, 11, 12, 13], &[0.5, 0.1, high, 0.2])
            .unwrap();
        // Rounded to bf16, 0.5 at position 1 would have tied and won.
        assert_eq!(r.committed, vec![(3, 12)]);
        assert_eq!(
            s.commit_with_confidences(&[10, 11, 13], &[0.1]),
            Err(SamplerError::ConfidenceCount {
                tokens: 3,
                confidences: 1
            })
        );
        assert_eq!(
            s.commit_with_confidences(&[11], &[0.1]),
            Err(SamplerError::PredictionCount {
                expected: 3,
                found: 1
            })
        );
    }

    #[test]
    fn wrong_prediction_count_is_an_error() {
        let mut s = Sampler::new(&[1], params(4, 4, 4), MASK, 64).unwrap();
        assert_eq!(
            s.commit(&[(1, 0.5)]),
            Err(SamplerError::PredictionCount {
                expected: 4,
                found: 1
            })
        );
        // Nothing changed.
        assert_eq!(s.rows_to_predict().len(), 4);
        assert_eq!(s.global_step(), 0);
    }

    #[test]
    fn validation_errors() {
        let ok = params(8, 4, 4);
        let err = |p: GenerationParams, prompt: &[u32], max_len: usize| {
            Sampler::new(prompt, p, MASK, max_len).unwrap_err()
        };
        assert!(Sampler::new(&[1], ok.clone(), MASK, 9).is_ok());
        assert_eq!(err(params(0, 4, 4), &[1], 64), SamplerError::ZeroGenLength);
        assert_eq!(
            err(params(8, 4, 0), &[1], 64),
            SamplerError::ZeroBlockLength
        );
        assert_eq!(
            err(params(10, 4, 4), &[1], 64),
            SamplerError::GenNotMultipleOfBlock {
                gen_length: 10,
                block_length: 4
            }
        );
        assert_eq!(
            err(params(8, 3, 4), &[1], 64),
            SamplerError::StepsNotMultipleOfBlocks {
                steps: 3,
                num_blocks: 2
            }
        );
        assert_eq!(
            err(params(8, 1, 4), &[1], 64),
            SamplerError::TooFewSteps {
                steps: 1,
                num_blocks: 2
            }
        );
        assert_eq!(
            err(params(8, 0, 4), &[1], 64),
            SamplerError::TooFewSteps {
                steps: 0,
                num_blocks: 2
            }
        );
        for threshold in [0.0, -0.5, 1.5, f32::NAN] {
            let mut p = ok.clone();
            p.threshold = Some(threshold);
            assert!(matches!(
                err(p, &[1], 64),
                SamplerError::ThresholdOutOfRange { .. }
            ));
        }
        // Threshold mode does not use steps.
        let mut p = params(8, 1, 4);
        p.threshold = Some(1.0);
        assert!(Sampler::new(&[1], p, MASK, 64).is_ok());
        for temperature in [-0.1, f32::INFINITY, f32::NAN] {
            let mut p = ok.clone();
            p.temperature = temperature;
            assert!(matches!(
                err(p, &[1], 64),
                SamplerError::BadTemperature { .. }
            ));
        }
        for cfg_scale in [-1.0, f32::NAN] {
            let mut p = ok.clone();
            p.cfg_scale = cfg_scale;
            assert!(matches!(err(p, &[1], 64), SamplerError::BadCfgScale { .. }));
        }
        assert_eq!(err(ok.clone(), &[], 64), SamplerError::EmptyPrompt);
        assert_eq!(
            err(ok.clone(), &[1, 2], 9),
            SamplerError::TooLong {
                prompt_len: 2,
                gen_length: 8,
                total: 10,
                max_len: 9
            }
        );
        let text = err(ok, &[1, 2], 9).to_string();
        assert!(text.contains("10") && text.contains('9'), "{text}");
    }
}
