//! The most likely ids of each row beside the chosen one (`top_logprobs`), against a sort on
//! the host: over vocabulary chunks in any order, with CFG, ties (the lower id first), a row
//! with fewer ids than asked for, each id's log-probability under the model softmax the
//! selection keeps, and the errors of bad arguments.

use crate::common::select::{chunk_ranges, columns, positions};
use crate::common::{ctx, random_vec};
use unmask_core::oracle::sampling::model_logprob;
use unmask_gpu::ops::alternatives::{self as top, Chunk, TOP_STATE_WORDS, parse_alternatives};
use unmask_gpu::ops::sampling::{self as sel, SelectParams};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor};

/// Selection (with its model softmax) and the top `k` over `chunks`, in one step.
#[allow(clippy::too_many_arguments)]
fn run(
    ctx: &GpuContext,
    logits: &[f32],
    uncond: Option<&[f32]>,
    cfg_scale: f32,
    (rows, n): (usize, usize),
    chunks: &[(usize, usize)],
    k: usize,
) -> Vec<Vec<(u32, f32)>> {
    let params = SelectParams {
        cfg_scale,
        logprob: true,
        top_logprobs: k as u32,
        ..SelectParams::default()
    };
    let pos = Tensor::from_u32(ctx, &[rows], &positions(rows), "positions").unwrap();
    let state = Tensor::zeros(ctx, DType::U32, &[sel::state_len(rows)], "state").unwrap();
    let top_state = Tensor::zeros(ctx, DType::U32, &[rows, TOP_STATE_WORDS], "top").unwrap();
    let out_words = rows * (sel::OUT_WORDS + 2 * k);
    let out = Tensor::zeros(ctx, DType::U32, &[out_words], "out").unwrap();
    let tensors: Vec<(usize, usize, Tensor, Option<Tensor>)> = chunks
        .iter()
        .map(|&(lo, hi)| {
            let t = |m: &[f32], name| {
                Tensor::from_f32(ctx, &[rows, hi - lo], &columns(m, n, lo, hi), name).unwrap()
            };
            (lo, hi, t(logits, "logits"), uncond.map(|u| t(u, "uncond")))
        })
        .collect();
    let mut step = StepEncoder::new(ctx, "alternatives");
    sel::select_reset(&mut step, &state, rows).unwrap();
    top::top_reset(&mut step, &top_state, rows).unwrap();
    for (lo, hi, ct, ut) in &tensors {
        let u = ut.as_ref();
        sel::select_accumulate(&mut step, ct, u, rows, hi - lo, *lo, &pos, &state, &params)
            .unwrap();
        let at = Chunk {
            rows,
            n: hi - lo,
            vocab_offset: *lo,
            row_base: 0,
        };
        top::top_accumulate(&mut step, ct, u, cfg_scale, at, &top_state, k).unwrap();
    }
    sel::select_finalize(&mut step, &state, &out, rows, &params).unwrap();
    let base = rows * sel::OUT_WORDS;
    top::top_finalize(&mut step, &top_state, &state, &out, base, rows, k).unwrap();
    step.submit().unwrap();
    let words = out.read_u32(ctx).unwrap();
    let alternatives = parse_alternatives(&words[base..], k);
    // The chosen (greedy) id is the first alternative, with the very same value.
    for (r, (choice, alts)) in words[..base]
        .chunks(sel::OUT_WORDS)
        .zip(&alternatives)
        .enumerate()
    {
        assert_eq!(
            alts.first().copied(),
            Some((choice[0], f32::from_bits(choice[2]))),
            "row {r}: the greedy choice heads the list"
        );
    }
    alternatives
}

/// The host's top `k` of each row: (id, log-probability), the higher logit first, then the
/// lower id.
fn oracle(
    logits: &[f32],
    uncond: Option<&[f32]>,
    cfg: f32,
    n: usize,
    k: usize,
) -> Vec<Vec<(u32, f64)>> {
    (0..logits.len() / n)
        .map(|r| {
            let row = &logits[r * n..(r + 1) * n];
            let u = uncond.map(|u| &u[r * n..(r + 1) * n]);
            let l = |v: usize| match u {
                Some(u) => u[v] + (cfg + 1.0) * (row[v] - u[v]),
                None => row[v],
            };
            let mut ids: Vec<usize> = (0..n).collect();
            ids.sort_by(|&a, &b| l(b).total_cmp(&l(a)).then(a.cmp(&b)));
            ids.iter()
                .take(k)
                .map(|&v| (v as u32, model_logprob(row, u, v as u32, cfg)))
                .collect()
        })
        .collect()
}

#[test]
fn the_most_likely_ids_match_a_host_sort_over_any_chunks() {
    let ctx = ctx();
    let rows = 5;
    let mut checked = 0;
    for &n in &[3usize, 1000, 5003] {
        let mut logits = random_vec(300 + n as u64, rows * n, 4.0);
        let uncond = random_vec(400 + n as u64, rows * n, 4.0);
        // Row 1 on a coarse grid: ties everywhere, also across chunks. Row 2 one value:
        // every logit reaches the floor, so past 256 ids the kernel takes its rounds; the
        // other rows rank their few candidates.
        for x in &mut logits[n..2 * n] {
            *x = (*x * 2.0).round() / 2.0;
        }
        logits[2 * n..3 * n].fill(0.75);
        for (cfg, k) in [(false, 1usize), (false, 5), (true, 20)] {
            let (u, scale) = if cfg {
                (Some(&uncond[..]), 1.5)
            } else {
                (None, 0.0)
            };
            let want = oracle(&logits, u, scale, n, k);
            for parts in [1, 4] {
                let mut chunks = chunk_ranges(n, parts);
                chunks.reverse();
                let got = run(&ctx, &logits, u, scale, (rows, n), &chunks, k);
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    let what = format!("n={n} cfg={cfg} k={k} chunks={parts} row {r}");
                    assert_eq!(
                        g.len(),
                        k.min(n),
                        "{what}: fewer ids than k leave empty slots"
                    );
                    let got_ids: Vec<u32> = g.iter().map(|x| x.0).collect();
                    let want_ids: Vec<u32> = w.iter().map(|x| x.0).collect();
                    assert_eq!(got_ids, want_ids, "{what}: ids");
                    for (&(_, gl), &(_, wl)) in g.iter().zip(w) {
                        let err = (gl as f64 - wl).abs() / wl.abs().max(1.0);
                        assert!(err < 5e-6, "{what}: log-probability {gl} vs {wl}");
                    }
                    checked += 1;
                }
            }
        }
    }
    eprintln!("[check] alternatives: {checked} rows equal to the host's sort");
}

#[test]
fn bad_arguments_are_refused() {
    let ctx = ctx();
    let logits = Tensor::from_f32(&ctx, &[1, 4], &[0.0; 4], "logits").unwrap();
    let state = Tensor::zeros(&ctx, DType::U32, &[TOP_STATE_WORDS], "top").unwrap();
    let at = Chunk {
        rows: 1,
        n: 4,
        vocab_offset: 0,
        row_base: 0,
    };
    let mut step = StepEncoder::new(&ctx, "bad alternatives");
    for k in [0, 21] {
        let e = top::top_accumulate(&mut step, &logits, None, 0.0, at, &state, k).unwrap_err();
        assert!(e.to_string().contains("k in 1..=20"), "{e}");
    }
    let wide = Chunk { n: 8, ..at };
    let e = top::top_accumulate(&mut step, &logits, None, 0.0, wide, &state, 3).unwrap_err();
    assert!(e.to_string().contains("logits"), "{e}");
    let two_rows = Chunk { row_base: 1, ..at };
    let e = top::top_accumulate(&mut step, &logits, None, 0.0, two_rows, &state, 3).unwrap_err();
    assert!(e.to_string().contains("state"), "{e}");
}
