//! DiffusionGemma's sampler (`docs/models/diffusion-gemma.md` §6), one denoising step at a
//! time over a canvas of L positions: temperature from `t_max` down to `t_min`, a token drawn
//! per position from the temperature-scaled logits, the entropy-bound acceptance (the
//! lowest-entropy positions while the entropies ranked before them sum to at most the bound),
//! every other position renoised with a uniformly random token, and the stable-and-confident
//! stopping rule. Hand-written: no crate implements this sampler.
//!
//! Random draws come from a `CanvasDraws`: the project's generator (`SeededDraws`), or the
//! draws a reference run recorded (`ReplayedDraws`), which no other generator can reproduce.

use std::collections::VecDeque;

use crate::rng::SplitMix64;

/// The sampler's settings (`generation_config.json`; the defaults are the published ones).
#[derive(Clone, Debug, PartialEq)]
pub struct EntropyBoundParams {
    pub max_new_tokens: usize,
    /// N: steps per canvas at most.
    pub max_denoising_steps: usize,
    /// β: the summed entropy (nats) the accepted positions may carry, the largest excluded.
    pub entropy_bound: f32,
    /// Temperatures of the last and the first step: f64 like the reference's Python floats
    /// (their difference is taken in f64, then rounded to f32).
    pub t_min: f64,
    pub t_max: f64,
    /// S: argmax canvases that must repeat for a step to be stable (0: always stable).
    pub stability_threshold: usize,
    /// c: the mean entropy under which a step is confident.
    pub confidence_threshold: f32,
    pub eos: Vec<u32>,
    pub pad: Option<u32>,
}

impl Default for EntropyBoundParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            max_denoising_steps: 48,
            entropy_bound: 0.1,
            t_min: 0.4,
            t_max: 0.8,
            stability_threshold: 1,
            confidence_threshold: 0.005,
            eos: vec![1, 106, 50],
            pad: Some(0),
        }
    }
}

impl EntropyBoundParams {
    /// The temperature of the step with `t` steps left (this one included): `t_min + (t_max -
    /// t_min) · t / N` as the reference rounds it: `t / N` in f32, `t_max - t_min` in f64 then
    /// f32, the product and the sum in f32.
    pub fn temperature(&self, t: usize) -> f32 {
        let frac = t as f32 / self.max_denoising_steps.max(1) as f32;
        self.t_min as f32 + (self.t_max - self.t_min) as f32 * frac
    }
}

/// Where the sampler's random numbers come from.
pub trait CanvasDraws {
    /// `len` tokens uniform in `[0, vocab)`: a canvas's initial tokens and each step's
    /// renoise tokens.
    fn uniform_canvas(&mut self, len: usize, vocab: usize) -> Vec<u32>;
    /// One token per row of `z` (`[len, vocab]`, temperature-scaled logits) drawn from
    /// `softmax(z[row])`.
    fn categorical(&mut self, z: &[f32], vocab: usize) -> Vec<u32>;
    /// A recorded step's `len` drawn tokens, for draws that replay a run; `None` lets the
    /// caller draw them (the GPU draws where the logits are).
    fn replayed_categorical(&mut self, _len: usize) -> Option<Vec<u32>> {
        None
    }
}

/// Draws lent for a while (a run that owns its draws borrows a caller's).
impl<D: CanvasDraws + ?Sized> CanvasDraws for &mut D {
    fn uniform_canvas(&mut self, len: usize, vocab: usize) -> Vec<u32> {
        (**self).uniform_canvas(len, vocab)
    }
    fn categorical(&mut self, z: &[f32], vocab: usize) -> Vec<u32> {
        (**self).categorical(z, vocab)
    }
    fn replayed_categorical(&mut self, len: usize) -> Option<Vec<u32>> {
        (**self).replayed_categorical(len)
    }
}

/// The project's draws, from one seed.
pub struct SeededDraws(SplitMix64);

impl SeededDraws {
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64(seed))
    }
}

impl CanvasDraws for SeededDraws {
    fn uniform_canvas(&mut self, len: usize, vocab: usize) -> Vec<u32> {
        (0..len)
            .map(|_| (self.0.next_f64() * vocab as f64) as u32 % vocab.max(1) as u32)
            .collect()
    }

    /// Inverse-CDF sampling of each row's softmax, in f64.
    fn categorical(&mut self, z: &[f32], vocab: usize) -> Vec<u32> {
        z.chunks_exact(vocab)
            .map(|row| {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let e: Vec<f64> = row.iter().map(|&x| (x as f64 - max).exp()).collect();
                let mut u = self.0.next_f64() * e.iter().sum::<f64>();
                for (i, &p) in e.iter().enumerate() {
                    if u < p {
                        return i as u32;
                    }
                    u -= p;
                }
                // Rounding left u past the last non-zero weight: take that token.
                e.iter().rposition(|&p| p > 0.0).unwrap_or(0) as u32
            })
            .collect()
    }
}

/// A reference run's draws, replayed in order: every uniform canvas (initial and renoise, in
/// the order they were drawn) and every step's categorical tokens.
#[derive(Clone, Debug, Default)]
pub struct ReplayedDraws {
    pub uniform: VecDeque<Vec<u32>>,
    pub categorical: VecDeque<Vec<u32>>,
}

impl CanvasDraws for ReplayedDraws {
    fn uniform_canvas(&mut self, len: usize, _vocab: usize) -> Vec<u32> {
        let c = self.uniform.pop_front().unwrap_or_default();
        assert_eq!(
            c.len(),
            len,
            "replayed uniform canvas: expected {len} tokens"
        );
        c
    }

    fn categorical(&mut self, z: &[f32], vocab: usize) -> Vec<u32> {
        let c = self.categorical.pop_front().unwrap_or_default();
        assert_eq!(
            c.len(),
            z.len() / vocab.max(1),
            "replayed draws: one token per row"
        );
        c
    }

    fn replayed_categorical(&mut self, len: usize) -> Option<Vec<u32>> {
        let c = self.categorical.pop_front().unwrap_or_default();
        assert_eq!(c.len(), len, "replayed draws: one token per row");
        Some(c)
    }
}

/// A canvas being denoised: the tokens the next step reads, and the last S argmax canvases.
#[derive(Clone, Debug)]
pub struct Canvas {
    pub tokens: Vec<u32>,
    /// Steps not yet seen count as no canvas (the reference's rows of -1).
    history: VecDeque<Option<Vec<u32>>>,
}

impl Canvas {
    pub fn new(tokens: Vec<u32>, params: &EntropyBoundParams) -> Self {
        Self {
            tokens,
            history: std::iter::repeat_n(None, params.stability_threshold).collect(),
        }
    }
}

/// What one step decided.
#[derive(Clone, Debug, PartialEq)]
pub struct EntropyBoundStep {
    pub temperature: f32,
    /// The drawn token per position.
    pub sampled: Vec<u32>,
    /// Accepted positions, ascending.
    pub accepted: Vec<usize>,
    /// The argmax canvas: the output if the loop stops here.
    pub argmax: Vec<u32>,
    pub mean_entropy: f32,
    pub stable: bool,
    pub stop: bool,
    /// The temperature-scaled logits `[L, V]`: the next step's self-conditioning.
    pub scaled: Vec<f32>,
}

/// Entropy (nats) of `softmax(row)`.
pub fn entropy(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    -row.iter()
        .map(|&x| {
            let lp = x as f64 - lse;
            lp.exp() * lp
        })
        .sum::<f64>() as f32
}

/// The entropy-bound acceptance: positions sorted by entropy ascending, each accepted while
/// the entropies ranked before it sum to at most `bound`. Ascending positions.
pub fn accept(entropies: &[f32], bound: f32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..entropies.len()).collect();
    order.sort_by(|&a, &b| entropies[a].total_cmp(&entropies[b]));
    let mut before = 0.0f64;
    let mut accepted = Vec::new();
    for i in order {
        if before > bound as f64 {
            break;
        }
        accepted.push(i);
        before += entropies[i] as f64;
    }
    accepted.sort_unstable();
    accepted
}

/// One step over `raw` (the decoder's soft-capped logits `[L, V]`) with `t` steps left: the
/// canvas's tokens become the next step's input (accepted positions their drawn token, every
/// other a renoise token).
pub fn denoise_step(
    raw: &[f32],
    vocab: usize,
    t: usize,
    params: &EntropyBoundParams,
    canvas: &mut Canvas,
    draws: &mut dyn CanvasDraws,
) -> EntropyBoundStep {
    let temperature = params.temperature(t);
    let scaled: Vec<f32> = raw.iter().map(|&x| x / temperature).collect();
    let sampled = draws.categorical(&scaled, vocab);
    let mut rows = Vec::with_capacity(canvas.tokens.len());
    for row in scaled.chunks_exact(vocab) {
        // The first index of the largest (torch.argmax on ties).
        let best = row
            .iter()
            .enumerate()
            .fold(0, |b, (i, &x)| if x > row[b] { i } else { b });
        rows.push((best as u32, entropy(row)));
    }
    let mut step = step_from_rows(&rows, sampled, vocab, t, params, canvas, draws);
    step.scaled = scaled;
    step
}

/// One step from each row's (argmax, entropy) of the temperature-scaled logits and the
/// drawn tokens, computed where the logits are (`unmask_gpu::ops::denoise`; a caller that
/// replays draws passes `CanvasDraws::replayed_categorical`'s). The step's `scaled` is left
/// empty.
pub fn step_from_rows(
    rows: &[(u32, f32)],
    sampled: Vec<u32>,
    vocab: usize,
    t: usize,
    params: &EntropyBoundParams,
    canvas: &mut Canvas,
    draws: &mut dyn CanvasDraws,
) -> EntropyBoundStep {
    let len = canvas.tokens.len();
    let argmax: Vec<u32> = rows.iter().map(|r| r.0).collect();
    let entropies: Vec<f32> = rows.iter().map(|r| r.1).collect();
    let accepted = accept(&entropies, params.entropy_bound);
    let mut next = draws.uniform_canvas(len, vocab);
    for &i in &accepted {
        next[i] = sampled[i];
    }
    let stable = canvas
        .history
        .iter()
        .all(|h| h.as_ref().is_some_and(|h| *h == argmax));
    if params.stability_threshold > 0 {
        canvas.history.pop_front();
        canvas.history.push_back(Some(argmax.clone()));
    }
    let mean_entropy =
        (entropies.iter().map(|&h| h as f64).sum::<f64>() / len.max(1) as f64) as f32;
    let stop = stable && mean_entropy < params.confidence_threshold;
    canvas.tokens = next;
    EntropyBoundStep {
        temperature: params.temperature(t),
        sampled,
        accepted,
        argmax,
        mean_entropy,
        stable,
        stop,
        scaled: Vec::new(),
    }
}

/// The canvas as output: tokens after the first eos become pad (the eos stays). Whether an
/// eos was found.
pub fn pad_after_eos(canvas: &mut [u32], params: &EntropyBoundParams) -> bool {
    let Some(first) = canvas.iter().position(|t| params.eos.contains(t)) else {
        return false;
    };
    if let Some(pad) = params.pad {
        for t in &mut canvas[first + 1..] {
            *t = pad;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temperature_runs_from_t_max_down_never_reaching_t_min() {
        let p = EntropyBoundParams::default();
        assert_eq!(p.temperature(48), 0.8);
        assert!((p.temperature(1) - (0.4 + 0.4 / 48.0)).abs() < 1e-7);
        assert!(p.temperature(1) as f64 > p.t_min);
        // The difference is rounded once from f64: 0.15 - 0.05 -> 0.1f32, not 0.15f32 - 0.05f32.
        let cold = EntropyBoundParams {
            t_min: 0.05,
            t_max: 0.15,
            max_denoising_steps: 16,
            ..Default::default()
        };
        assert_eq!(cold.temperature(15), 0.143_75_f32);
        assert_ne!(
            cold.temperature(15),
            0.05f32 + (0.15f32 - 0.05f32) * (15.0 / 16.0)
        );
    }

    #[test]
    fn acceptance_counts_the_entropies_ranked_before() {
        // Sorted: 0.0 (pos 2), 0.05 (pos 0), 0.06 (pos 3), 0.5 (pos 1): before-sums 0, 0,
        // 0.05, 0.11 -> the first three accepted at bound 0.1.
        assert_eq!(accept(&[0.05, 0.5, 0.0, 0.06], 0.1), vec![0, 2, 3]);
        // The lowest is always accepted, whatever its entropy.
        assert_eq!(accept(&[3.0, 2.0], 0.1), vec![1]);
        assert_eq!(accept(&[], 0.1), Vec::<usize>::new());
    }

    #[test]
    fn entropy_of_uniform_and_certain_rows() {
        assert!((entropy(&[0.0; 4]) - 4f32.ln()).abs() < 1e-6);
        assert!(entropy(&[100.0, 0.0, 0.0]) < 1e-20);
    }

    #[test]
    fn a_step_renoises_what_it_does_not_accept_and_stops_when_stable_and_confident() {
        let p = EntropyBoundParams {
            max_denoising_steps: 4,
            ..Default::default()
        };
        // Three positions over a vocabulary of 3: position 0 certain, 1 and 2 uncertain
        // (about ln 3 each, 2 a little less): 0 and the next ranked, 2 (nothing before it
        // but ~0), are accepted; 1 is not (ln 3 before it).
        let raw = [40.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.2];
        let mut canvas = Canvas::new(vec![2, 2, 2], &p);
        let mut draws = ReplayedDraws {
            uniform: [vec![1, 1, 1], vec![1, 1, 1]].into(),
            categorical: [vec![0, 2, 0], vec![0, 2, 0]].into(),
        };
        let s = denoise_step(&raw, 3, 4, &p, &mut canvas, &mut draws);
        assert_eq!(s.accepted, vec![0, 2]);
        assert_eq!(
            canvas.tokens,
            vec![0, 1, 0],
            "accepted: drawn tokens; the rest renoised"
        );
        assert_eq!(s.argmax, vec![0, 1, 2]);
        assert!(!s.stable && !s.stop, "the first step has no history");
        let s = denoise_step(&raw, 3, 3, &p, &mut canvas, &mut draws);
        assert!(s.stable, "the argmax repeated");
        assert!(!s.stop, "mean entropy {} is above c", s.mean_entropy);
        let mut out = vec![5, 1, 7, 1];
        assert!(pad_after_eos(&mut out, &p));
        assert_eq!(out, vec![5, 1, 0, 0]);
        assert!(!pad_after_eos(&mut [5, 7], &p));
    }

    #[test]
    fn seeded_draws_are_in_range_and_follow_the_distribution() {
        let mut d = SeededDraws::new(7);
        assert!(d.uniform_canvas(100, 13).iter().all(|&t| t < 13));
        let z = [0.0, 50.0, 0.0];
        assert_eq!(d.categorical(&z, 3), vec![1]);
    }
}
