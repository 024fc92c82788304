//! Attention over two KV segments against the f64 oracle, on the kernel the forward picks:
//! MHA and GQA, head dims that are and are not multiples of the tiles, empty / one-row /
//! non-dividing segments, several key tiles per segment, strided q, the
//! split-equals-concatenation property the cache modes rely on, the row windows of a batch in
//! one buffer, the errors of bad shapes, and a timed block step.

use std::time::Instant;

use crate::common::attention::{
    Case, Data, Run, TOL, check, describe, expect_shape_error, run_gpu, run_with, upload,
};
use crate::common::{assert_close, ctx, relative_error};
use unmask_gpu::ops::attention::{
    self as attn, AttentionKernel, AttentionOptions, AttentionShape, KvSegment,
};
use unmask_gpu::{DType, StepEncoder, Tensor};

#[test]
fn segment_b_only_head_dims() {
    // Head dims below, at and above the tile classes; m and lengths that divide no tile.
    for (hd, heads, m, len) in [
        (16, 2, 5, 37),
        (20, 2, 33, 19),
        (64, 2, 17, 40),
        (128, 2, 9, 23),
        (7, 3, 3, 5),
    ] {
        check(&Case::mha(hd, heads, m, None, len));
    }
}

#[test]
fn single_key_and_single_query() {
    check(&Case::mha(16, 1, 1, None, 1));
    check(&Case::mha(128, 1, 1, Some(1), 1));
}

#[test]
fn empty_segment_a_is_the_same_as_none() {
    let none = Case::mha(20, 2, 11, None, 29);
    let empty = Case {
        len_a: Some(0),
        ..Case::mha(20, 2, 11, None, 29)
    };
    let a = check(&none);
    let b = check(&empty);
    assert_eq!(a, b, "len-0 segment A must change nothing");
}

#[test]
fn both_segments_gqa_and_mha() {
    for (hd, heads, kv) in [
        (16, 4, 2),
        (20, 4, 2),
        (128, 4, 2),
        (64, 4, 4),
        (32, 6, 1),
        (30, 2, 1),
    ] {
        let c = Case {
            shape: AttentionShape {
                n_heads: heads,
                n_kv_heads: kv,
                head_dim: hd,
            },
            len_a: Some(21),
            seed: hd as u64 * 31 + heads as u64,
            ..Case::mha(hd, heads, 13, None, 10)
        };
        check(&c);
    }
}

#[test]
fn several_key_tiles_per_segment() {
    // Longer than one tile of keys (128), ending mid-tile, and a one-key segment B.
    for (hd, heads, kv, m, la, lb) in [
        (128, 2, 1, 11, Some(130), 141),
        (20, 4, 2, 9, Some(257), 1),
        (64, 2, 2, 5, None, 385),
        (7, 3, 1, 10, Some(70), 90),
    ] {
        let c = Case {
            shape: AttentionShape {
                n_heads: heads,
                n_kv_heads: kv,
                head_dim: hd,
            },
            seed: 900 + hd as u64,
            ..Case::mha(hd, heads, m, la, lb)
        };
        check(&c);
    }
}

#[test]
fn strided_q_from_fused_qkv() {
    // q is the first block of a fused [m, (n_heads + 2 * n_kv_heads) * hd] QKV output, read
    // at a column offset to prove the offset is honoured.
    for (hd, heads, kv, col) in [(16, 4, 2, 0), (20, 4, 2, 20), (128, 2, 1, 128)] {
        let c = Case {
            shape: AttentionShape {
                n_heads: heads,
                n_kv_heads: kv,
                head_dim: hd,
            },
            q_stride: (heads + 2 * kv) * hd,
            q_col: col,
            seed: 77 + hd as u64,
            ..Case::mha(hd, heads, 10, Some(7), 12)
        };
        check(&c);
    }
}

#[test]
fn split_equals_concatenation() {
    // Attention over A then B equals attention over A ++ B as one segment, up to the
    // rounding of a different tiling of the keys.
    let ctx = ctx();
    for (hd, heads, kv, la, lb) in [(16, 4, 2, 5, 19), (128, 2, 2, 150, 100), (20, 2, 1, 1, 30)] {
        let split = Case {
            shape: AttentionShape {
                n_heads: heads,
                n_kv_heads: kv,
                head_dim: hd,
            },
            seed: 500 + hd as u64,
            ..Case::mha(hd, heads, 7, Some(la), lb)
        };
        let d = split.data();
        let joined = Case {
            len_a: None,
            len_b: la + lb,
            ..split
        };
        let dj = Data {
            q: d.q.clone(),
            ka: Vec::new(),
            va: Vec::new(),
            kb: [d.ka.clone(), d.kb.clone()].concat(),
            vb: [d.va.clone(), d.vb.clone()].concat(),
        };
        let got_split = run_gpu(&ctx, &split, &d);
        let got_joined = run_gpu(&ctx, &joined, &dj);
        let want = split.oracle(&d);
        assert_close(
            &format!("{} (split)", split.label()),
            &got_split,
            &want,
            TOL,
        );
        assert_close(
            &format!("{} (joined)", joined.label()),
            &got_joined,
            &want,
            TOL,
        );
        let diff = relative_error(&got_split, &got_joined);
        eprintln!(
            "[check] split vs joined hd={hd}: relative difference {diff:.3e} (tolerance 1e-6)"
        );
        assert!(diff <= 1e-6, "split and joined differ by {diff:.3e}");
    }
}

#[test]
fn batched_windows_equal_separate_problems() {
    // A batch keeps the query rows of several sequences in one q / out and their arenas one
    // after the other in one K/V buffer, all sharing segment A. Each sequence's dispatch
    // (row window, segment B start) must give exactly what its own problem gives alone.
    let ctx = ctx();
    let (hd, heads, kv) = (20, 4, 2);
    let shape = AttentionShape {
        n_heads: heads,
        n_kv_heads: kv,
        head_dim: hd,
    };
    let sequences = [(5, 17), (3, 9), (8, 30)]; // (query rows, arena rows)
    let cases: Vec<Case> = sequences
        .iter()
        .enumerate()
        .map(|(i, &(m, lb))| Case {
            shape,
            q_stride: (heads + 2 * kv) * hd,
            q_col: 0,
            seed: 40 + i as u64,
            ..Case::mha(hd, heads, m, Some(11), lb)
        })
        .collect();
    let mut data: Vec<Data> = cases.iter().map(Case::data).collect();
    // One shared segment A (from the first case) for all of them.
    for i in 1..data.len() {
        data[i].ka = data[0].ka.clone();
        data[i].va = data[0].va.clone();
    }
    let q_all: Vec<f32> = data.iter().flat_map(|d| d.q.clone()).collect();
    let kb_all: Vec<f32> = data.iter().flat_map(|d| d.kb.clone()).collect();
    let vb_all: Vec<f32> = data.iter().flat_map(|d| d.vb.clone()).collect();
    let (q, kb, vb) = (
        upload(&ctx, &q_all, "q"),
        upload(&ctx, &kb_all, "kb"),
        upload(&ctx, &vb_all, "vb"),
    );
    let (ka, va) = (
        upload(&ctx, &data[0].ka, "ka"),
        upload(&ctx, &data[0].va, "va"),
    );
    let rows: usize = sequences.iter().map(|s| s.0).sum();
    let width = heads * hd;
    let max_m = sequences.iter().map(|s| s.0).max().unwrap();
    let floats = attn::split_scratch_floats(&ctx, shape, max_m, 64);
    let scratch = Tensor::zeros(&ctx, DType::F32, &[floats], "split scratch").unwrap();
    for run in [
        Run::f32(AttentionKernel::Register),
        Run::f32(AttentionKernel::Wide),
        Run::split(2),
    ] {
        let out = Tensor::zeros(&ctx, DType::F32, &[rows, width], "out").unwrap();
        let options = AttentionOptions {
            kernel: run.kernel,
            scratch: Some(&scratch),
            slices: run.slices,
            ..AttentionOptions::default()
        };
        let mut step = StepEncoder::new(&ctx, "batched attention");
        let (mut row0, mut kv0) = (0, 0);
        for c in &cases {
            let seg_b = KvSegment {
                k: &kb,
                v: &vb,
                start: kv0,
                len: c.len_b,
            };
            let seg_a = Some(KvSegment::first(&ka, &va, 11));
            // One scratch for every sequence: the dispatches run in order.
            attn::attention_with(
                &mut step,
                &q,
                c.q_stride,
                0,
                row0..row0 + c.m,
                seg_a,
                seg_b,
                &out,
                shape,
                &options,
            )
            .unwrap();
            row0 += c.m;
            kv0 += c.len_b;
        }
        step.submit().unwrap();
        let got = out.read_f32(&ctx).unwrap();
        let mut row0 = 0;
        for (c, d) in cases.iter().zip(&data) {
            let (alone, plan) = run_with(&ctx, c, d, run);
            let label = format!("{} [{}]", c.label(), describe(&plan));
            let part = &got[row0 * width..(row0 + c.m) * width];
            assert_close(&format!("{label} (in a batch)"), part, &c.oracle(d), TOL);
            assert_eq!(part, &alone[..], "{label}: batched and alone differ");
            row0 += c.m;
        }
    }
    eprintln!(
        "[check] 3 sequences in one buffer: each window equals its problem alone, bit for bit"
    );
}

/// The arguments of one `attention` call, so each rejected call states only what it changes.
#[derive(Clone)]
struct Call<'a> {
    q: &'a Tensor,
    q_stride: usize,
    q_col: usize,
    rows: std::ops::Range<usize>,
    seg_a: Option<KvSegment<'a>>,
    seg_b: KvSegment<'a>,
    out: &'a Tensor,
    shape: AttentionShape,
}

fn call(step: &mut StepEncoder, c: Call) -> unmask_gpu::Result<()> {
    let options = attn::AttentionOptions::default();
    attn::attention_with(
        step, c.q, c.q_stride, c.q_col, c.rows, c.seg_a, c.seg_b, c.out, c.shape, &options,
    )
    .map(|_| ())
}

#[test]
fn rejects_bad_shapes() {
    let ctx = ctx();
    let t = |n: usize| Tensor::zeros(&ctx, DType::F32, &[n], "t").unwrap();
    let (q, k, v, out) = (t(4096), t(4096), t(4096), t(4096));
    let u = Tensor::zeros(&ctx, DType::U32, &[4096], "u").unwrap();
    let seg = |len| KvSegment::first(&k, &v, len);
    let shape = |n_heads, n_kv_heads, head_dim| AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    // A valid call: 2 heads of 16 over one key; every case below breaks one thing.
    let ok = Call {
        q: &q,
        q_stride: 32,
        q_col: 0,
        rows: 0..1,
        seg_a: None,
        seg_b: seg(1),
        out: &out,
        shape: shape(2, 2, 16),
    };
    let cases = [
        (
            Call {
                q_stride: 513,
                shape: shape(1, 1, 513),
                ..ok.clone()
            },
            "head_dim 513",
        ),
        (
            Call {
                q_stride: 48,
                shape: shape(3, 2, 16),
                ..ok.clone()
            },
            "3 heads over 2 kv heads",
        ),
        (
            Call {
                seg_a: Some(seg(0)),
                seg_b: seg(0),
                ..ok.clone()
            },
            "no keys at all",
        ),
        (
            Call {
                q_col: 8,
                ..ok.clone()
            },
            "q_col past the row",
        ),
        (
            Call {
                rows: 0..200,
                ..ok.clone()
            },
            "q too short for m rows",
        ),
        (
            Call {
                seg_b: seg(300),
                ..ok.clone()
            },
            "segment longer than its tensor",
        ),
        (
            Call {
                seg_b: KvSegment {
                    start: 200,
                    ..seg(100)
                },
                ..ok.clone()
            },
            "segment window past the end of its tensor",
        ),
        (
            Call {
                rows: 127..129,
                ..ok.clone()
            },
            "query window past the end of q",
        ),
        (
            Call {
                out: &k,
                ..ok.clone()
            },
            "out aliasing the keys",
        ),
        (
            Call {
                q: &u,
                ..ok.clone()
            },
            "u32 q",
        ),
    ];
    let mut step = StepEncoder::new(&ctx, "errors");
    for (c, what) in cases {
        expect_shape_error(call(&mut step, c), what);
    }
    assert_eq!(
        step.dispatch_count(),
        0,
        "rejected calls must record nothing"
    );
    call(&mut step, ok).expect("the unchanged call is valid");
    assert_eq!(step.dispatch_count(), 1);
}

/// A LLaDA-like step (head dim 128, a block of query rows over a longer context), timed.
/// Not a benchmark: a sanity check that the kernel is not pathologically slow.
#[test]
fn timed_block_step() {
    let ctx = ctx();
    let c = Case::mha(128, 4, 32, Some(96), 160);
    let d = c.data();
    let want = c.oracle(&d);
    let _ = run_gpu(&ctx, &c, &d); // compile the pipeline outside the timing
    let start = Instant::now();
    let got = run_gpu(&ctx, &c, &d);
    let secs = start.elapsed().as_secs_f64();
    let flops = 4.0 * (c.m * c.shape.n_heads * 256 * 128) as f64;
    eprintln!(
        "[time] {}: {:.1} ms including upload and readback ({:.2} GFLOP/s)",
        c.label(),
        secs * 1e3,
        flops / secs / 1e9
    );
    assert_close(&c.label(), &got, &want, TOL);
}
