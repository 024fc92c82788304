//! A continuation's log-likelihood under a masked diffusion model, by LLaDA's Monte Carlo
//! estimate (`get_log_likelihood.py`, llada.md §3.3): each sample masks k of the answer's
//! L tokens (k stratified over a batch), the model predicts the masked tokens from the
//! rest, and the sample's loss is the masked tokens' cross-entropy divided by k / L. The
//! estimate is minus the mean loss: a lower bound on log p(answer | prompt) whose mean
//! over samples is what multiple-choice evaluations compare.
//!
//! This module draws the masks and checks the settings; the engine runs the forward
//! passes (`unmask::Engine::log_likelihood`).

use crate::rng::SplitMix64;

/// The reference's defaults: 128 samples in batches of 16.
pub const DEFAULT_MC_NUM: usize = 128;
pub const DEFAULT_MC_BATCH: usize = 16;

/// How many samples, in which batches, with what guidance and seed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LikelihoodParams {
    /// Monte Carlo samples in all (`mc_num`).
    pub mc_num: usize,
    /// Samples whose mask counts are stratified together (`batch_size`).
    pub batch: usize,
    /// Classifier-free guidance weight (0: none), as in generation.
    pub cfg_scale: f32,
    pub seed: u64,
    /// Samples one forward pass carries, as sequences side by side (None: as many as fit
    /// the engine's row target, one storage binding and the memory budget). It changes the
    /// speed, not the estimate.
    pub pass_samples: Option<usize>,
}

impl Default for LikelihoodParams {
    fn default() -> Self {
        Self {
            mc_num: DEFAULT_MC_NUM,
            batch: DEFAULT_MC_BATCH,
            cfg_scale: 0.0,
            seed: 0,
            pass_samples: None,
        }
    }
}

/// A setting outside the estimate's rules, named.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: expected {expected}, found {found}")]
pub struct LikelihoodError {
    pub field: &'static str,
    pub expected: String,
    pub found: String,
}

impl LikelihoodParams {
    pub fn check(&self) -> Result<(), LikelihoodError> {
        let error = |field, expected: &str, found: String| LikelihoodError {
            field,
            expected: expected.to_string(),
            found,
        };
        if self.batch == 0 {
            return Err(error("mc_batch", "at least 1", "0".into()));
        }
        if self.mc_num == 0 || !self.mc_num.is_multiple_of(self.batch) {
            return Err(error(
                "mc_num",
                &format!("a positive multiple of mc_batch {}", self.batch),
                self.mc_num.to_string(),
            ));
        }
        if self.pass_samples == Some(0) {
            return Err(error("pass_samples", "at least 1", "0".into()));
        }
        if !(self.cfg_scale.is_finite() && self.cfg_scale >= 0.0) {
            return Err(error(
                "cfg_scale",
                "a finite value >= 0",
                self.cfg_scale.to_string(),
            ));
        }
        Ok(())
    }
}

/// One Monte Carlo sample: the answer positions it masks (from 0, ascending) and the
/// weight of its losses, 1 / p_mask = L / k.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskSample {
    pub masked: Vec<usize>,
    pub p_mask: f64,
}

/// The reference's masks for an answer of `answer_len` tokens: `mc_num / batch` batches;
/// in each, k ~ U{1..L} and row i masks `((round(k + i·L/b) − 1) mod L) + 1` positions
/// chosen uniformly (a random permutation), so a batch's mask counts cover 1..L evenly.
pub fn draw_masks(answer_len: usize, params: &LikelihoodParams) -> Vec<MaskSample> {
    let mut rng = SplitMix64(params.seed);
    let l = answer_len;
    let b = params.batch;
    let mut samples = Vec::with_capacity(params.mc_num);
    if l == 0 {
        return samples;
    }
    for _ in 0..params.mc_num / b.max(1) {
        let k = 1 + below(&mut rng, l);
        for i in 0..b {
            // torch.round(torch.linspace(k, k + (b - 1) * (L / b), b)): ties to even.
            let x = (k as f64 + i as f64 * (l as f64 / b as f64)).round_ties_even() as usize;
            let count = (x - 1) % l + 1;
            let mut order: Vec<usize> = (0..l).collect();
            for j in (1..l).rev() {
                order.swap(j, below(&mut rng, j + 1));
            }
            let mut masked = order[..count].to_vec();
            masked.sort_unstable();
            samples.push(MaskSample {
                masked,
                p_mask: count as f64 / l as f64,
            });
        }
    }
    samples
}

/// Uniform in 0..n (n ≥ 1), without modulo bias.
fn below(rng: &mut SplitMix64, n: usize) -> usize {
    let n = n as u64;
    let zone = u64::MAX - u64::MAX % n;
    loop {
        let v = rng.next_u64();
        if v < zone {
            return (v % n) as usize;
        }
    }
}

/// One sample's loss: the masked tokens' cross-entropies (natural log) over `p_mask`.
pub fn sample_loss(cross_entropies: &[f64], p_mask: f64) -> f64 {
    cross_entropies.iter().sum::<f64>() / p_mask
}

/// The estimate from every sample's loss: minus their mean (the reference's mean of batch
/// means, the batches being equal).
pub fn estimate(sample_losses: &[f64]) -> f64 {
    if sample_losses.is_empty() {
        return 0.0;
    }
    -sample_losses.iter().sum::<f64>() / sample_losses.len() as f64
}

/// `-log softmax(row)[target]` in f64.
pub fn cross_entropy(row: &[f32], target: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln() - row[target] as f64
}

/// The seed of window `index` of a rolling estimate: the request's own for the first (a
/// text in one window is scored exactly as without rolling), a stream of it for the others,
/// so each window's masks are drawn apart and the windows' errors add as independent ones.
pub fn window_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        seed
    } else {
        SplitMix64::nth(seed, index as u64)
    }
}

/// One window of a rolling estimate: the text's tokens `answer` scored after `context`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub context: Vec<u32>,
    pub answer: std::ops::Range<usize>,
}

/// A text to score after `prompt` in sequences of at most `max_len` positions: whole when
/// both fit (one window), else in windows of `max_len / 2` tokens, each after the
/// `max_len - max_len / 2` tokens before it that exist (the text's, then the prompt's
/// tail). Every token is scored once, with as much of what precedes it as fits; the text's
/// estimate is the windows' summed, as a left-to-right model's rolling windows sum theirs
/// (perplexity over long documents).
pub fn rolling_windows(prompt: &[u32], text: &[u32], max_len: usize) -> Vec<Window> {
    if prompt.len() + text.len() <= max_len {
        return vec![Window {
            context: prompt.to_vec(),
            answer: 0..text.len(),
        }];
    }
    let width = (max_len / 2).max(1);
    let reach = max_len.saturating_sub(width);
    let mut windows = Vec::with_capacity(text.len().div_ceil(width));
    let mut start = 0;
    while start < text.len() {
        let end = (start + width).min(text.len());
        let from_text = start.min(reach);
        let from_prompt = (reach - from_text).min(prompt.len());
        let mut context = prompt[prompt.len() - from_prompt..].to_vec();
        context.extend_from_slice(&text[start - from_text..start]);
        windows.push(Window {
            context,
            answer: start..end,
        });
        start = end;
    }
    windows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_after_the_first_draw_with_seeds_of_their_own() {
        assert_eq!(window_seed(7, 0), 7);
        let seeds: Vec<u64> = (0..4).map(|i| window_seed(7, i)).collect();
        for (i, a) in seeds.iter().enumerate() {
            assert!(seeds[i + 1..].iter().all(|b| b != a), "{seeds:?}");
        }
        assert_ne!(window_seed(8, 1), window_seed(7, 1));
    }

    #[test]
    fn rolling_windows_cover_the_text_once_with_what_precedes_them() {
        let prompt: Vec<u32> = (100..106).collect();
        let text: Vec<u32> = (0..25).collect();
        // Both fit: one window after the whole prompt.
        let one = rolling_windows(&prompt, &text, 31);
        assert_eq!(
            one,
            [Window {
                context: prompt.clone(),
                answer: 0..25
            }]
        );
        // 16 positions: windows of 8 after up to 8 tokens before them.
        let w = rolling_windows(&prompt, &text, 16);
        let answers: Vec<_> = w.iter().map(|w| w.answer.clone()).collect();
        assert_eq!(answers, [0..8, 8..16, 16..24, 24..25]);
        assert_eq!(w[0].context, prompt[..].to_vec());
        assert_eq!(w[1].context, (0..8).collect::<Vec<u32>>());
        assert_eq!(w[2].context, (8..16).collect::<Vec<u32>>());
        assert_eq!(w[3].context, (16..24).collect::<Vec<u32>>());
        for w in &w {
            assert!(w.context.len() + w.answer.len() <= 16, "{w:?}");
        }
        // A window nearer the start than its reach takes the prompt's tail: windows of 6
        // after up to 7 tokens.
        let w = rolling_windows(&prompt, &text, 13);
        assert_eq!(w[1].context, [105, 0, 1, 2, 3, 4, 5]);
        // No prompt: the first window has no context.
        let w = rolling_windows(&[], &text, 10);
        assert!(w[0].context.is_empty() && w[0].answer == (0..5));
        assert_eq!(w.len(), 5);
    }

    #[test]
    fn a_batch_covers_the_mask_counts_evenly() {
        let p = LikelihoodParams {
            mc_num: 8,
            batch: 4,
            ..LikelihoodParams::default()
        };
        let samples = draw_masks(8, &p);
        assert_eq!(samples.len(), 8);
        for batch in samples.chunks(4) {
            let counts: Vec<usize> = batch.iter().map(|s| s.masked.len()).collect();
            // k, k+2, k+4, k+6 wrapped into 1..=8: one of each residue mod 2 pair.
            let k = counts[0];
            let want: Vec<usize> = (0..4).map(|i| (k + 2 * i - 1) % 8 + 1).collect();
            assert_eq!(counts, want);
            for s in batch {
                assert!(s.masked.windows(2).all(|w| w[0] < w[1]));
                assert!(s.masked.iter().all(|&m| m < 8));
                assert_eq!(s.p_mask, s.masked.len() as f64 / 8.0);
            }
        }
        // Seeded: the same draws again, others with another seed.
        assert_eq!(draw_masks(8, &p), samples);
        let other = LikelihoodParams { seed: 1, ..p };
        assert_ne!(draw_masks(8, &other), samples);
        // One token: every sample masks it.
        assert!(
            draw_masks(1, &p)
                .iter()
                .all(|s| s.masked == [0] && s.p_mask == 1.0)
        );
    }

    #[test]
    fn every_position_and_count_is_drawn() {
        let p = LikelihoodParams::default();
        let samples = draw_masks(5, &p);
        let mut seen = [0usize; 5];
        let mut counts = [0usize; 6];
        for s in &samples {
            counts[s.masked.len()] += 1;
            for &m in &s.masked {
                seen[m] += 1;
            }
        }
        assert_eq!(counts[0], 0);
        // 16 rows over 5 counts: each count 3 or 4 times per batch.
        assert!(
            counts[1..].iter().all(|&c| (24..=32).contains(&c)),
            "{counts:?}"
        );
        // Each position is masked in about 3/5 of the samples.
        assert!(seen.iter().all(|&n| (55..=100).contains(&n)), "{seen:?}");
    }

    #[test]
    fn losses_and_settings() {
        // ln(e^0 + e^1 + e^2) - 1
        let ce = cross_entropy(&[0.0, 1.0, 2.0], 1);
        assert!((ce - (1f64 + 1f64.exp() + 2f64.exp()).ln() + 1.0).abs() < 1e-12);
        assert_eq!(sample_loss(&[1.0, 2.0], 0.5), 6.0);
        assert_eq!(estimate(&[6.0, 2.0]), -4.0);
        assert!(LikelihoodParams::default().check().is_ok());
        let bad = |p: LikelihoodParams| p.check().unwrap_err().field;
        let d = LikelihoodParams::default();
        assert_eq!(bad(LikelihoodParams { batch: 0, ..d }), "mc_batch");
        assert_eq!(bad(LikelihoodParams { mc_num: 20, ..d }), "mc_num");
        assert_eq!(bad(LikelihoodParams { mc_num: 0, ..d }), "mc_num");
        let no_samples = LikelihoodParams {
            pass_samples: Some(0),
            ..d
        };
        assert_eq!(bad(no_samples), "pass_samples");
        assert_eq!(
            bad(LikelihoodParams {
                cfg_scale: f32::NAN,
                ..d
            }),
            "cfg_scale"
        );
    }
}
