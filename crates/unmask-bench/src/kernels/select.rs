//! The token choice's cost with log-probabilities, logit biases and cuts: one chunk of
//! `rows` x `vocab` logits through `select` alone (`plain`), with the model softmax's sum
//! (`logprob`), with the 5 and 20 most likely alternatives (`top5`, `top20`), after adding
//! 32 or 1024 biased ids per row (`bias32`, `bias1024`: a `logit_bias` list, and the most
//! one may hold), and under the whole-row cut (`top-p` 0.9, `top-k` 50 as Dream's default,
//! `min-p` 0.05 alone, both min-p and top-p). Each record's `vs_plain` is its time over `plain`'s from the same run.

use serde_json::{Value, json};
use unmask_gpu::ops::alternatives::{self, Chunk, TOP_STATE_WORDS};
use unmask_gpu::ops::logit_bias::{RowBiases, add_logit_bias};
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
    let cut = Tensor::zeros(ctx, DType::U32, &[rows], "bench.cut")?;
    // Ids spread over the vocabulary, every row its own list.
    let bias_table = |per_row: usize| -> unmask_gpu::Result<Tensor> {
        let mut table = RowBiases::default();
        for r in 0..rows {
            let list: Vec<(u32, f32)> = (0..per_row)
                .map(|i| (((i * 7919 + r * 131) % vocab) as u32, -1.5))
                .collect();
            table.push(&list, 1);
        }
        let words = table.words();
        Tensor::from_u32(ctx, &[words.len()], &words, "bench.bias")
    };
    let tables = [(32, bias_table(32)?), (1024, bias_table(1024)?)];
    let logprob = |top_logprobs| SelectParams {
        logprob: true,
        top_logprobs,
        ..SelectParams::default()
    };
    let cut_by = |top_p, min_p| SelectParams {
        top_p,
        min_p,
        ..SelectParams::default()
    };
    let record = |step: &mut StepEncoder,
                  params: &SelectParams,
                  bias: Option<&Tensor>|
     -> unmask_gpu::Result<()> {
        let top = params.top_logprobs as usize;
        if let Some(table) = bias {
            add_logit_bias(step, &logits, rows, vocab, 0, table)?;
        }
        sampling::select_reset(step, &state, rows)?;
        if params.cuts() {
            let at = sampling::FullRows {
                row_base: 0,
                cut: &cut,
            };
            sampling::select_threshold(step, &logits, rows, vocab, at, params)?;
            sampling::select_accumulate_cut(
                step, &logits, rows, vocab, at, &positions, &state, params,
            )?;
        } else {
            sampling::select_accumulate(
                step, &logits, None, rows, vocab, 0, &positions, &state, params,
            )?;
        }
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
    let variants: [(&str, SelectParams, usize); 10] = [
        ("plain", SelectParams::default(), 0),
        ("logprob", logprob(0), 0),
        ("top5", logprob(5), 0),
        ("top20", logprob(20), 0),
        ("bias32", SelectParams::default(), 32),
        ("bias1024", SelectParams::default(), 1024),
        ("top-p", cut_by(Some(0.9), None), 0),
        // Dream's default cut.
        (
            "top-k",
            SelectParams {
                top_k: Some(50),
                ..SelectParams::default()
            },
            0,
        ),
        ("min-p", cut_by(None, Some(0.05)), 0),
        ("min-p+top-p", cut_by(Some(0.9), Some(0.05)), 0),
    ];
    let mut records = Vec::new();
    let mut plain_ms = None;
    for (name, params, biased) in variants {
        // The bias adds to the logits in place: repeats drift them, which costs the same.
        let bias = tables.iter().find(|(n, _)| *n == biased).map(|(_, t)| t);
        let s = time_step(ctx, options.repeats, |step| record(step, &params, bias))?;
        let base = *plain_ms.get_or_insert(s.median_ms);
        let fields = json!({
            "kernel": "select",
            "case": "lm_head_choice",
            "variant": name,
            "format": "f32",
            "rows": rows,
            "vocab": vocab,
            "vs_plain": round3(s.median_ms / base),
            "biased_ids_per_row": biased,
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
