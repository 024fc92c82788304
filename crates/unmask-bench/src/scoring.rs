//! Likelihood scoring (LLaDA's Monte Carlo estimate) at several pass sizes: the same drawn
//! samples of one prompt and answer, carried one per forward pass or side by side, timed
//! back to back so the ratios between pass sizes hold on a noisy machine.

use std::time::Instant;

use serde_json::{Value, json};
use unmask::{Engine, EngineError, LikelihoodParams};

use crate::timing::{median, round3};
use crate::with_envelope;

/// What `run_scoring_bench` measures.
#[derive(Clone, Debug)]
pub struct ScoringBenchOptions {
    /// Monte Carlo samples per estimate (stratified in batches of 16 when it divides, else
    /// in one batch).
    pub mc_num: usize,
    /// Pass sizes to time, in order (None: the engine's own choice).
    pub pass_samples: Vec<Option<usize>>,
    /// Timed runs per pass size, after one warm-up run.
    pub runs: usize,
}

/// One record per pass size: the median time of an estimate, samples per second, forward
/// passes, GPU memory peak, bytes read back, submits and buffers made per estimate, the
/// estimate itself (equal across pass sizes up to f32
/// rounding), and the speed-up over one sample per pass when that size was timed.
pub fn run_scoring_bench(
    engine: &Engine,
    envelope: &Value,
    prompt: &[u32],
    answer: &[u32],
    options: &ScoringBenchOptions,
    on_record: &mut dyn FnMut(&Value),
) -> Result<Vec<Value>, EngineError> {
    let batch = if options.mc_num.is_multiple_of(16) {
        16
    } else {
        options.mc_num
    };
    let mut records = Vec::new();
    for &pass_samples in &options.pass_samples {
        let params = LikelihoodParams {
            mc_num: options.mc_num,
            batch,
            pass_samples,
            ..LikelihoodParams::default()
        };
        // The warm-up compiles the matmul variants this pass size's row count picks.
        engine.log_likelihood(prompt, answer, &params)?;
        engine.ctx().memory.reset_peak();
        let host_before = engine.ctx().host.snapshot();
        let mut times = Vec::with_capacity(options.runs);
        let mut last = None;
        for _ in 0..options.runs.max(1) {
            let began = Instant::now();
            let l = engine.log_likelihood(prompt, answer, &params)?;
            times.push(began.elapsed().as_secs_f64());
            last = Some(l);
        }
        let Some(l) = last else { continue };
        let runs = options.runs.max(1) as u64;
        let host = engine.ctx().host.snapshot() - host_before;
        let s = median(times);
        records.push(with_envelope(
            envelope,
            json!({
                "record": "scoring",
                "prompt_tokens": prompt.len(),
                "answer_tokens": answer.len(),
                "mc_num": options.mc_num,
                "pass_samples_asked": pass_samples.map_or(json!("auto"), |n| json!(n)),
                "pass_samples": l.pass_samples,
                "forward_passes": l.forward_passes,
                "sequences": l.sequences,
                "runs": options.runs.max(1),
                "estimate_ms": round3(s * 1e3),
                "samples_per_s": round3(options.mc_num as f64 / s.max(1e-9)),
                "log_likelihood": l.log_likelihood,
                "gpu_peak_bytes": engine.ctx().memory.peak_bytes(),
                "read_back_bytes": host.bytes_read_back / runs,
                "submits": host.submits / runs,
                "buffers_created": host.buffers_created / runs,
            }),
        ));
    }
    let one = records
        .iter()
        .find(|r| r["pass_samples"] == 1)
        .and_then(|r| r["estimate_ms"].as_f64());
    for r in &mut records {
        let mine = r["estimate_ms"].as_f64().unwrap_or(f64::NAN);
        r["speedup_over_one_per_pass"] = json!(one.map(|o| round3(o / mine.max(1e-9))));
        on_record(r);
    }
    Ok(records)
}
