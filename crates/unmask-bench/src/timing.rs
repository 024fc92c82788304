//! Timed runs: how many, their median and fastest, and the deterministic inputs they use.

use std::time::{Duration, Instant};

use unmask_core::rng::SplitMix64;
use unmask_gpu::{GpuContext, StepEncoder, TraceClock, TraceOptions};

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
    /// How the runs were timed: GPU timestamps around each dispatch (summed over the
    /// step's dispatches) where the adapter has them, else host wall clock around submit
    /// and wait, which adds the submit and wake-up latency.
    pub clock: TraceClock,
    /// Median host wall clock of submit + wait, whatever `clock` is.
    pub wall_ms: f64,
}

/// Times `record` + submit + device wait: one untimed warm-up run (it also compiles the
/// pipelines), then `repeats`. With GPU timestamps the figure is the GPU time of the
/// step's dispatches (`Sample::clock` says which).
pub fn time_step(
    ctx: &GpuContext,
    repeats: Repeats,
    mut record: impl FnMut(&mut StepEncoder) -> unmask_gpu::Result<()>,
) -> unmask_gpu::Result<Sample> {
    let gpu_clock = ctx.has_timestamps();
    let mut walls = Vec::new();
    let mut run = |walls: &mut Vec<f64>| -> unmask_gpu::Result<f64> {
        let mut step = StepEncoder::new(ctx, "bench");
        record(&mut step)?;
        if gpu_clock {
            ctx.start_trace(TraceOptions { timing: true });
        }
        let start = Instant::now();
        let submitted = step.submit();
        let waited = submitted.and_then(|_| ctx.wait_idle());
        let wall = start.elapsed().as_secs_f64() * 1e3;
        let traces = if gpu_clock {
            ctx.finish_trace()
        } else {
            Vec::new()
        };
        waited?;
        walls.push(wall);
        if !gpu_clock {
            return Ok(wall);
        }
        Ok(traces
            .iter()
            .flat_map(|t| &t.dispatches)
            .filter_map(|d| d.ms)
            .sum())
    };
    run(&mut walls)?;
    walls.clear();
    let mut times = Vec::new();
    let began = Instant::now();
    while times.len() < repeats.min_runs.max(1)
        || (times.len() < repeats.max_runs && began.elapsed() < repeats.budget)
    {
        times.push(run(&mut walls)?);
    }
    times.sort_by(f64::total_cmp);
    Ok(Sample {
        median_ms: times[times.len() / 2],
        min_ms: times[0],
        runs: times.len(),
        clock: if gpu_clock {
            TraceClock::GpuTimestamps
        } else {
            TraceClock::CpuWallClock
        },
        wall_ms: median(walls),
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
