//! The token choice's cost with log-probabilities: one chunk of `rows` x `vocab` logits
//! through `select` alone (`plain`), with the model softmax's sum (`logprob`), and with the
//! 5 and 20 most likely alternatives (`top5`, `top20`). Each record's `vs_plain` is its time
//! over `plain`'s from the same run.

use serde_json::{Value, json};
use unmask_gpu::ops::alternatives::{self, Chunk, TOP_STATE_WORDS};
use unmask_gpu::ops::sampling::{self, SelectParams};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor};

use super::{KernelBenchOptions, kernel_record};
use crate::timing::{pseudo_random, round3, time_step};

pub(super) fn run(
    ctx: &GpuContext,
    envelope: &Value,
    rows: usize,
    vocab: usize,
    options: &KernelBenchOptions,
) -> unmask_gpu::Result<Vec<Value>> {
    let logits = pseudo_random(11, rows * vocab, 4.0);
    let logits = Tensor::from_f32(ctx, &[rows, vocab], &logits, "bench.logits")?;
    let positions: Vec<u32> = (0..rows as u32).collect();
    let positions = Tensor::from_u32(ctx, &[rows], &positions, "bench.positions")?;
    let state = Tensor::zeros(ctx, DType::U32, &[sampling::state_len(rows)], "bench.state")?;
    let top_state = Tensor::zeros(ctx, DType::U32, &[rows, TOP_STATE_WORDS], "bench.top")?;
    let out_words = rows * (sampling::OUT_WORDS + TOP_STATE_WORDS);
    let out = Tensor::zeros(ctx, DType::U32, &[out_words], "bench.out")?;
    let record = |step: &mut StepEncoder, params: &SelectParams| -> unmask_gpu::Result<()> {
        let top = params.top_logprobs as usize;
        sampling::select_reset(step, &state, rows)?;
        sampling::select_accumulate(
            step, &logits, None, rows, vocab, 0, &positions, &state, params,
        )?;
        if top > 0 {
            let at = Chunk {
                rows,
                n: vocab,
                vocab_offset: 0,
                row_base: 0,
            };
            alternatives::top_reset(step, &top_state, rows)?;
            alternatives::top_accumulate(step, &logits, None, 0.0, at, &top_state, top)?;
        }
        sampling::select_finalize(step, &state, &out, rows, params)?;
        if top > 0 {
            let base = rows * sampling::OUT_WORDS;
            alternatives::top_finalize(step, &top_state, &state, &out, base, rows, top)?;
        }
        Ok(())
    };
    let variants = [
        ("plain", false, 0),
        ("logprob", true, 0),
        ("top5", true, 5),
        ("top20", true, 20),
    ];
    let mut records = Vec::new();
    let mut plain_ms = None;
    for (name, logprob, top) in variants {
        let params = SelectParams {
            logprob,
            top_logprobs: top,
            ..SelectParams::default()
        };
        let s = time_step(ctx, options.repeats, |step| record(step, &params))?;
        let base = *plain_ms.get_or_insert(s.median_ms);
        let fields = json!({
            "kernel": "select",
            "case": "lm_head_choice",
            "variant": name,
            "format": "f32",
            "rows": rows,
            "vocab": vocab,
            "vs_plain": round3(s.median_ms / base),
        });
        // One pass over the logits: an operation and 4 bytes per logit.
        let elements = (rows * vocab) as f64;
        records.push(kernel_record(
            envelope,
            fields,
            s,
            elements,
            4.0 * elements,
            &options.peak,
            false,
        ));
    }
    Ok(records)
}
