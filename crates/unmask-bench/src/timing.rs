//! Timed runs: how many, their median and fastest, and the deterministic inputs they use.

use std::time::{Duration, Instant};

use unmask_core::rng::SplitMix64;
use unmask_gpu::{GpuContext, StepEncoder};

/// How long one measurement may take: at least `min_runs` timed runs, then more until
/// `max_runs` or `budget` is reached.
#[derive(Clone, Copy, Debug)]
pub struct Repeats {
    pub min_runs: usize,
    pub max_runs: usize,
    pub budget: Duration,
}

impl Default for Repeats {
    fn default() -> Self {
        Self {
            min_runs: 3,
            max_runs: 15,
            budget: Duration::from_millis(1500),
        }
    }
}

/// Median and fastest of several timed runs, in milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub median_ms: f64,
    pub min_ms: f64,
    pub runs: usize,
}

/// Times `record` + submit + device wait: one untimed warm-up run (it also compiles the
/// pipelines), then `repeats`.
pub fn time_step(
    ctx: &GpuContext,
    repeats: Repeats,
    mut record: impl FnMut(&mut StepEncoder) -> unmask_gpu::Result<()>,
) -> unmask_gpu::Result<Sample> {
    let mut run = || -> unmask_gpu::Result<f64> {
        let mut step = StepEncoder::new(ctx, "bench");
        record(&mut step)?;
        let start = Instant::now();
        step.submit()?;
        ctx.wait_idle()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    run()?;
    let mut times = Vec::new();
    let began = Instant::now();
    while times.len() < repeats.min_runs.max(1)
        || (times.len() < repeats.max_runs && began.elapsed() < repeats.budget)
    {
        times.push(run()?);
    }
    times.sort_by(f64::total_cmp);
    Ok(Sample {
        median_ms: times[times.len() / 2],
        min_ms: times[0],
        runs: times.len(),
    })
}

/// Deterministic values in [-scale, scale), never zero.
pub fn pseudo_random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|_| {
            let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
            let v = (u * 2.0 - 1.0) * scale;
            if v == 0.0 { scale * 1e-3 } else { v }
        })
        .collect()
}

pub(crate) fn round3(v: f64) -> f64 {
    (v * 1e3).round() / 1e3
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
