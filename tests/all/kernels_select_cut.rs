//! Token selection under a top-p / top-k / min-p cut over whole rows, against the f64 oracle: the
//! kept set each row's cut key gives, the choice and every confidence kind within it, greedy,
//! noised and tempered, over row groups at a row base, with the model's log-probability of
//! the choice; and the chunked accumulate refusing a cut.

use crate::common::select::{
    KINDS, assert_kind_choices, assert_logprobs, oracle_rows, pairs, positions,
};
use crate::common::{ctx, random_vec};
use unmask_core::oracle::sampling::cut_mask;
use unmask_gpu::ops::sampling::{self as sel, SelectParams};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor};

/// The kernel's order-preserving map of f32 to u32 (`order_key` in shaders/select.wgsl).
fn order_key(x: f32) -> u32 {
    let b = if x == 0.0 { 0 } else { x.to_bits() };
    if b >> 31 != 0 { !b } else { b | 0x8000_0000 }
}

/// Threshold + accumulate over whole rows split in two groups (rows `[0, split)` and
/// `[split, rows)`, the second at row_base `split`): the choices and each row's cut key.
fn run_gpu_cut(
    ctx: &GpuContext,
    logits: &[f32],
    rows: usize,
    n: usize,
    split: usize,
    positions: &[u32],
    params: &SelectParams,
) -> (Vec<u32>, Vec<u32>) {
    let pos = Tensor::from_u32(ctx, &[rows], positions, "positions").unwrap();
    let state = Tensor::zeros(ctx, DType::U32, &[sel::state_len(rows)], "state").unwrap();
    let out = Tensor::zeros(ctx, DType::U32, &[rows, sel::OUT_WORDS], "out").unwrap();
    let cut = Tensor::zeros(ctx, DType::U32, &[rows], "cut").unwrap();
    let groups: Vec<(usize, Tensor)> = [(0, split), (split, rows)]
        .into_iter()
        .map(|(lo, hi)| {
            let data = &logits[lo * n..hi * n];
            (
                lo,
                Tensor::from_f32(ctx, &[hi - lo, n], data, "rows").unwrap(),
            )
        })
        .collect();
    let mut step = StepEncoder::new(ctx, "cut select");
    sel::select_reset(&mut step, &state, rows).unwrap();
    for (lo, t) in &groups {
        let group_rows = t.shape[0];
        let at = sel::FullRows {
            row_base: *lo,
            cut: &cut,
        };
        sel::select_threshold(&mut step, t, group_rows, n, at, params).unwrap();
        sel::select_accumulate_cut(&mut step, t, group_rows, n, at, &pos, &state, params).unwrap();
    }
    sel::select_finalize(&mut step, &state, &out, rows, params).unwrap();
    step.submit().unwrap();
    (out.read_u32(ctx).unwrap(), cut.read_u32(ctx).unwrap())
}

/// Whether a row's top-p cut lies within float noise of a boundary: the oracle's kept set
/// changes when p moves by a relative 1e-4.
fn knife_edge(row: &[f64], params: &SelectParams) -> bool {
    let Some(p) = params.top_p.filter(|&p| p < 1.0) else {
        return false;
    };
    let at = |q: f32| {
        cut_mask(
            row,
            &SelectParams {
                top_p: Some(q.min(1.0)),
                ..*params
            },
        )
    };
    at(p * (1.0 - 1e-4)) != at(p * (1.0 + 1e-4))
}

#[test]
fn top_p_top_k_cut_matches_oracle() {
    let ctx = ctx();
    let rows = 7;
    let mut checked = 0;
    let mut edges = 0;
    // 4099 ids: more than the 1024 keys the kernel gathers, so a search starts over the row.
    for &n in &[1000usize, 1003, 4099] {
        let mut logits = random_vec(40 + n as u64, rows * n, 6.0);
        // Row 1 on a coarse grid: many ties, also at the k-th value.
        for x in &mut logits[n..2 * n] {
            *x = (*x * 2.0).round() / 2.0;
        }
        // Row 2 peaked: its first id dominates (p cuts to one id).
        logits[2 * n] = 40.0;
        let pos = positions(rows);
        let cuts: [(Option<f32>, Option<u32>, Option<f32>); 7] = [
            (None, Some(1), None),
            (None, Some(9), None),
            (Some(0.3), None, None),
            (Some(0.9), None, None),
            (Some(0.9), Some(5), Some(0.3)),
            (Some(1.0), Some(40), None),
            (None, None, Some(0.1)),
        ];
        for (top_p, top_k, min_p) in cuts {
            for (temperature, tempered) in [(0.0f32, false), (0.7, false), (0.7, true)] {
                for kind in KINDS {
                    let params = SelectParams {
                        temperature,
                        tempered,
                        top_p,
                        top_k,
                        min_p,
                        confidence: kind,
                        seed: 99,
                        step: 2,
                        suppress_token: Some(3),
                        // The model's log-probability ignores the cut and the suppression.
                        logprob: true,
                        ..SelectParams::default()
                    };
                    let (words, keys) = run_gpu_cut(&ctx, &logits, rows, n, 3, &pos, &params);
                    let got = pairs(&words);
                    let want = oracle_rows(&logits, None, n, &pos, &params);
                    let what = format!(
                        "n={n} top_p={top_p:?} top_k={top_k:?} min_p={min_p:?} T={temperature} tempered={tempered}"
                    );
                    let (mut g, mut w) = (Vec::new(), Vec::new());
                    for r in 0..rows {
                        let row: Vec<f64> = logits[r * n..(r + 1) * n]
                            .iter()
                            .enumerate()
                            .map(|(v, &x)| if v == 3 { f64::NEG_INFINITY } else { x as f64 })
                            .collect();
                        if knife_edge(&row, &params) {
                            edges += 1;
                            continue;
                        }
                        // The kept set itself: key >= cut, the suppressed id aside.
                        let kept: Vec<bool> = logits[r * n..(r + 1) * n]
                            .iter()
                            .enumerate()
                            .map(|(v, &x)| v != 3 && order_key(x) >= keys[r])
                            .collect();
                        assert_eq!(kept, cut_mask(&row, &params), "{what}: row {r} kept set");
                        assert!(kept[got[r].0 as usize], "{what}: row {r} chose a cut id");
                        g.push(got[r]);
                        w.push(want[r]);
                        checked += 1;
                    }
                    // Tempered: the kernel scales the logits in f32, as CFG combines them.
                    assert_kind_choices(&what, kind, tempered, &g, &w);
                    assert_logprobs(&what, &words, &logits, None, n, 0.0);
                }
            }
        }
    }
    eprintln!(
        "[check] cut: {checked} rows equal to the oracle, {edges} within 1e-4 of a p boundary"
    );
    assert!(edges * 20 < checked, "{edges} knife-edge rows of {checked}");
}

#[test]
fn accumulate_refuses_a_cut_over_chunks() {
    let ctx = ctx();
    let logits = Tensor::from_f32(&ctx, &[1, 4], &[0.0; 4], "logits").unwrap();
    let pos = Tensor::from_u32(&ctx, &[1], &[0], "positions").unwrap();
    let state = Tensor::zeros(&ctx, DType::U32, &[sel::state_len(1)], "state").unwrap();
    let params = SelectParams {
        top_k: Some(2),
        ..SelectParams::default()
    };
    let mut step = StepEncoder::new(&ctx, "refuse");
    let err = sel::select_accumulate(&mut step, &logits, None, 1, 4, 0, &pos, &state, &params)
        .unwrap_err();
    assert!(err.to_string().contains("select_accumulate_cut"), "{err}");
}

/// min-p 1 keeps only each row's most probable ids, so a request at temperature 0.8 with it
/// samples as one with top-k 1 (ties aside, which random logits do not have), and not as
/// the same request without a cut.
#[test]
fn a_request_with_min_p_one_samples_as_top_k_one() {
    let engine = crate::common::tiny_engine();
    let run = |top_k, min_p| {
        let params = unmask::GenerationParams {
            temperature: 0.8,
            seed: 5,
            top_k,
            min_p,
            ..crate::common::params(16, 8, 8)
        };
        let prompt = crate::common::shared_prefix_prompt(3);
        let request = unmask::Request::ids(prompt).with_params(params);
        engine.generate(&request).unwrap().ids
    };
    let (min_p, top_k, open) = (run(None, Some(1.0)), run(Some(1), None), run(None, None));
    assert_eq!(min_p, top_k);
    assert_ne!(min_p, open, "the noise chose other tokens without a cut");
    eprintln!("[check] min-p 1 at T 0.8 commits as top-k 1: {min_p:?}");
}
