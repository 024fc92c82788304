//! Dream's timestep schedule (`Schedule::Dream`): Dream's own `diffusion_generate` for one
//! block, Fast-dLLM's Dream port for several blocks or a threshold.

use super::{Remasking, Sampler, Schedule, StepRecord};

impl Sampler {
    fn dream_eps(&self) -> Option<f64> {
        match self.params.schedule {
            Schedule::Dream { eps } => Some(eps),
            Schedule::Llada | Schedule::Auto => None,
        }
    }

    /// Fast-dLLM's port: blocks (or a threshold), each opened by a step that commits the
    /// block's first position.
    fn dream_blockwise(&self) -> bool {
        self.num_blocks > 1 || self.params.threshold.is_some()
    }

    /// This step commits the current block's first position and nothing else.
    pub(super) fn dream_first_step(&self) -> bool {
        self.dream_eps().is_some()
            && self.dream_blockwise()
            && self.step_in_block == 0
            && !self.is_done()
    }

    /// The masked positions that compete this step: the block's (Fast-dLLM), or every
    /// masked position of the sequence, prompt included (Dream).
    fn dream_scope(&self) -> Vec<u32> {
        let range = if self.dream_blockwise() {
            self.block()
        } else {
            0..self.tokens.len()
        };
        range
            .filter(|&p| self.tokens[p] == self.mask_id)
            .map(|p| p as u32)
            .collect()
    }

    pub(super) fn dream_rows(&self) -> Vec<u32> {
        if self.dream_first_step() {
            vec![self.block().start as u32]
        } else {
            self.dream_scope()
        }
    }

    /// `linspace(1, eps, steps + 1)[i]` as numpy computes it (the last value exact).
    fn timestep(&self, i: usize) -> f64 {
        let eps = self.dream_eps().unwrap_or(1e-3);
        let steps = self.steps_per_block.unwrap_or(1);
        if i >= steps {
            eps
        } else {
            i as f64 * ((eps - 1.0) / steps as f64) + 1.0
        }
    }

    /// The fraction of the masked positions this step unmasks: `1 - t[i+1]/t[i]`, all of
    /// them at the block's last step.
    fn dream_fraction(&self) -> f64 {
        let steps = self.steps_per_block.unwrap_or(1);
        let i = self.step_in_block;
        if i + 1 >= steps {
            1.0
        } else {
            1.0 - self.timestep(i + 1) / self.timestep(i)
        }
    }

    /// Commits of the current step: `int(#masked · fraction)`.
    pub(super) fn dream_quota(&self) -> usize {
        if self.dream_first_step() {
            return 1;
        }
        let masked = self.dream_scope().len();
        if self.dream_fraction() >= 1.0 {
            return masked;
        }
        (masked as f64 * self.dream_fraction()).floor() as usize
    }

    /// The steps that commit without ranking: a block's first step (its first position),
    /// and `origin`, where each competing position is unmasked with probability
    /// `1 - t[i+1]/t[i]` (one draw per position, in order).
    pub(super) fn dream_commit_unranked(&mut self, rows: &[u32], tokens: &[u32]) -> StepRecord {
        let committed = if self.dream_first_step() {
            vec![(rows[0], tokens[0])]
        } else {
            debug_assert_eq!(self.params.remasking, Remasking::Random);
            let p = self.dream_fraction();
            let mut committed = Vec::new();
            for (&row, &token) in rows.iter().zip(tokens) {
                if f64::from(self.draw()) < p {
                    committed.push((row, token));
                }
            }
            committed
        };
        self.finish_step(committed)
    }

    /// Whether the current block needs no more steps. Steps that would commit nothing are
    /// skipped here (at temperature 0 the next step sees the same canvas, so the outcome
    /// is the reference's); `origin`'s steps are not, their draws decide.
    pub(super) fn dream_block_finished(&mut self) -> bool {
        loop {
            if self.dream_scope().is_empty() {
                return true;
            }
            if self.dream_first_step() || self.params.threshold.is_some() {
                return false;
            }
            let steps = self.steps_per_block.unwrap_or(1);
            if self.step_in_block >= steps {
                return true;
            }
            if self.params.remasking == Remasking::Random || self.dream_quota() > 0 {
                return false;
            }
            self.step_in_block += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::GenerationParams;
    use super::super::tests::{counts, run};
    use super::*;
    use crate::error::SamplerError;

    const MASK: u32 = 99;

    fn dream(gen_length: usize, steps: usize, block_length: usize) -> GenerationParams {
        GenerationParams {
            gen_length,
            steps,
            block_length,
            round_confidence_bf16: false,
            schedule: Schedule::DREAM,
            ..GenerationParams::default()
        }
    }

    /// 16 masks over 4 steps of linspace(1, 1e-3, 5) = [1, .75025, .5005, .25075, .001]:
    /// int(16·.24975) = 3, int(13·.33289) = 4, int(9·.49900) = 4, then the last 5.
    #[test]
    fn timestep_schedule_counts() {
        let mut s = Sampler::new(&[1, 2], dream(16, 4, 16), MASK, 64).unwrap();
        assert_eq!(s.quota(), Some(3));
        let records = run(&mut s, |p| p as f32);
        assert_eq!(counts(&records), vec![3, 4, 4, 5]);
        assert_eq!(records[0].committed[0], (15, 1015));
        assert!(!s.tokens().contains(&MASK));
    }

    /// More steps than masks: the steps that would unmask nothing are skipped but keep
    /// their index, and the last step takes whatever remains.
    #[test]
    fn empty_steps_are_skipped_with_their_index() {
        let mut s = Sampler::new(&[1], dream(3, 8, 3), MASK, 64).unwrap();
        let records = run(&mut s, |p| p as f32);
        assert_eq!(counts(&records).iter().sum::<usize>(), 3);
        assert!(records.iter().all(|r| !r.committed.is_empty()));
        assert_eq!(records.last().unwrap().step, 7);
    }

    /// Every masked position competes in Dream's own schedule, the prompt's included.
    #[test]
    fn masked_prompt_positions_compete() {
        let mut s = Sampler::new(&[1, MASK, 3], dream(2, 1, 2), MASK, 64).unwrap();
        assert_eq!(s.rows_to_predict(), vec![1, 3, 4]);
        run(&mut s, |_| 0.5);
        assert!(!s.tokens().contains(&MASK));
    }

    /// Fast-dLLM's blocks: each block's first step commits its first position whatever
    /// the confidences; the schedule restarts per block.
    #[test]
    fn blocks_open_with_their_first_position() {
        let mut s = Sampler::new(&[1, 2], dream(8, 4, 4), MASK, 64).unwrap();
        assert_eq!(s.rows_to_predict(), vec![2]);
        let records = run(&mut s, |p| -(p as f32));
        assert_eq!(counts(&records), vec![1, 3, 1, 3]);
        assert_eq!(records[0].committed, vec![(2, 1002)]);
        assert_eq!(records[2].committed, vec![(6, 1006)]);
        assert_eq!(records[2].block, 1);
        let too_few = Sampler::new(&[1], dream(8, 2, 4), MASK, 64).unwrap_err();
        assert!(matches!(too_few, SamplerError::TooFewDreamSteps { .. }));
    }

    /// Threshold decoding: the first position, then the best prediction and every one at
    /// or above the threshold.
    #[test]
    fn threshold_after_the_first_position() {
        let mut p = dream(4, 4, 4);
        p.threshold = Some(0.5);
        let mut s = Sampler::new(&[1], p, MASK, 64).unwrap();
        let conf = |p: u32| [0.0, 0.9, 0.6, 0.7, 0.2][p as usize];
        let records = run(&mut s, conf);
        assert_eq!(counts(&records), vec![1, 2, 1]);
        assert_eq!(records[1].committed, vec![(2, 1002), (3, 1003)]);
        let mut p = dream(4, 4, 4);
        p.threshold = Some(0.5);
        p.remasking = Remasking::Entropy;
        assert!(matches!(
            Sampler::new(&[1], p, MASK, 64),
            Err(SamplerError::ThresholdNeedsProbability { .. })
        ));
    }

    /// `origin`: one draw per competing position, unmasked when below 1 - s/t (all at the
    /// last step); a step may unmask nothing.
    #[test]
    fn origin_draws_per_position() {
        let mut p = dream(4, 2, 4);
        p.remasking = Remasking::Random;
        // Step 0: p = 1 - .5005 = .4995; positions 1..5 draw .1, .9, .4, .6.
        let mut s = Sampler::new(&[7], p, MASK, 64)
            .unwrap()
            .with_draws([0.1, 0.9, 0.4, 0.6]);
        let records = run(&mut s, |_| 0.0);
        assert_eq!(records[0].committed, vec![(1, 1001), (3, 1003)]);
        assert_eq!(records[1].committed, vec![(2, 1002), (4, 1004)]);
    }

    /// `alg_temp`: positions drawn without replacement by softmax(confidence / alg_temp).
    #[test]
    fn alg_temp_draws_by_weight() {
        let mut p = dream(3, 2, 3);
        p.alg_temp = 1.0;
        // Step 0 unmasks int(3 · .4995) = 1. Weights e^0, e^ln2, e^ln5 ∝ 1, 2, 5 (total 8):
        // u = .3 → target 2.4, running 1, 3 → position 2 (the second row).
        let conf = |p: u32| [0.0, 0.0, 2f32.ln(), 5f32.ln()][p as usize];
        let mut s = Sampler::new(&[7], p, MASK, 64).unwrap().with_draws([0.3]);
        let rows = s.rows_to_predict();
        let preds: Vec<(u32, f32)> = rows.iter().map(|&r| (1000 + r, conf(r))).collect();
        let record = s.commit(&preds).unwrap();
        assert_eq!(record.committed, vec![(2, 1002)]);
    }
}
