//! Attention over two KV segments against the f64 oracle: MHA and GQA, head dims that are
//! and are not multiples of the tiles, empty / one-row / non-dividing segments, strided q,
//! and the split-equals-concatenation property the cache modes rely on; every kernel
//! variant (register, wide, wide split over keys at several slice counts) and f16 K/V
//! (packed, and native where the device has shader-f16).

use crate::common;

use std::time::Instant;

use common::{assert_close, ctx, random_vec, relative_error};
use unmask_core::oracle;
use unmask_gpu::ops::attention::{
    self as attn, AttentionKernel, AttentionOptions, AttentionPlan, AttentionShape, KvRead,
    KvSegment,
};
use unmask_gpu::{DType, GpuContext, GpuError, StepEncoder, Tensor};

const TOL: f64 = 1e-4;

/// f16 K/V against the f32 oracle on the unrounded data: each K/V element is off by up to
/// 2^-11 of itself, which moves scores (keys scaled to 2) and outputs by ~1e-3 relative.
/// Against the oracle on the f16-rounded data the kernels are held to `TOL`.
const F16_TOL: f64 = 5e-3;

/// How one run reads its K/V and which kernel it asks for.
#[derive(Clone, Copy, Debug)]
struct Run {
    kernel: AttentionKernel,
    kv: DType,
    native_f16: bool,
    slices: Option<usize>,
}

impl Run {
    fn f32(kernel: AttentionKernel) -> Self {
        Run {
            kernel,
            kv: DType::F32,
            native_f16: false,
            slices: None,
        }
    }

    fn split(slices: usize) -> Self {
        Run {
            slices: Some(slices),
            ..Run::f32(AttentionKernel::WideSplit)
        }
    }

    fn f16(kernel: AttentionKernel, native: bool) -> Self {
        Run {
            kv: DType::F16,
            native_f16: native,
            ..Run::f32(kernel)
        }
    }
}

/// Every concrete variant on f32 K/V: the split at a forced 2 and 3 slices and at the count
/// the shape gives.
fn f32_variants() -> Vec<Run> {
    vec![
        Run::f32(AttentionKernel::Register),
        Run::f32(AttentionKernel::Wide),
        Run::split(2),
        Run::split(3),
        Run::f32(AttentionKernel::WideSplit),
    ]
}

fn describe(plan: &AttentionPlan) -> String {
    format!(
        "{} {} slices={} tile={}x{}",
        plan.kernel.name(),
        plan.read.name(),
        plan.slices,
        plan.tile.0,
        plan.tile.1
    )
}

/// One attention problem: host data for q and both segments.
struct Case {
    shape: AttentionShape,
    m: usize,
    q_stride: usize,
    q_col: usize,
    /// `None`: no segment A; `Some(0)`: an empty one.
    len_a: Option<usize>,
    len_b: usize,
    seed: u64,
}

struct Data {
    q: Vec<f32>,
    ka: Vec<f32>,
    va: Vec<f32>,
    kb: Vec<f32>,
    vb: Vec<f32>,
}

impl Case {
    fn mha(head_dim: usize, n_heads: usize, m: usize, len_a: Option<usize>, len_b: usize) -> Self {
        let width = n_heads * head_dim;
        Case {
            shape: AttentionShape {
                n_heads,
                n_kv_heads: n_heads,
                head_dim,
            },
            m,
            q_stride: width,
            q_col: 0,
            len_a,
            len_b,
            seed: (head_dim * 1000 + m * 7 + len_b) as u64,
        }
    }

    fn kv_width(&self) -> usize {
        self.shape.n_kv_heads * self.shape.head_dim
    }

    fn data(&self) -> Data {
        let kw = self.kv_width();
        let la = self.len_a.unwrap_or(0);
        // Keys scaled up so the softmax is far from uniform.
        Data {
            q: random_vec(self.seed, self.m * self.q_stride, 1.0),
            ka: random_vec(self.seed + 1, la * kw, 2.0),
            va: random_vec(self.seed + 2, la * kw, 1.0),
            kb: random_vec(self.seed + 3, self.len_b * kw, 2.0),
            vb: random_vec(self.seed + 4, self.len_b * kw, 1.0),
        }
    }

    fn oracle(&self, d: &Data) -> Vec<f32> {
        let la = self.len_a.unwrap_or(0);
        oracle::attention::attention(
            &d.q,
            self.q_stride,
            self.q_col,
            self.m,
            self.len_a.map(|_| (&d.ka[..], &d.va[..], la)),
            (&d.kb, &d.vb, self.len_b),
            self.shape.n_heads,
            self.shape.n_kv_heads,
            self.shape.head_dim,
        )
    }

    fn label(&self) -> String {
        let s = self.shape;
        format!(
            "attention hd={} heads={}/{} m={} q_stride={} q_col={} A={:?} B={}",
            s.head_dim,
            s.n_heads,
            s.n_kv_heads,
            self.m,
            self.q_stride,
            self.q_col,
            self.len_a,
            self.len_b
        )
    }
}

/// Uploads with at least one row so empty segments still have a valid buffer.
fn upload(ctx: &GpuContext, data: &[f32], label: &str) -> Tensor {
    if data.is_empty() {
        Tensor::zeros(ctx, DType::F32, &[1], label).unwrap()
    } else {
        Tensor::from_f32(ctx, &[data.len()], data, label).unwrap()
    }
}

fn run_gpu(ctx: &GpuContext, c: &Case, d: &Data) -> Vec<f32> {
    run_with(ctx, c, d, Run::f32(AttentionKernel::Auto)).0
}

/// K or V in the run's format.
fn upload_kv(ctx: &GpuContext, data: &[f32], kv: DType, label: &str) -> Tensor {
    match (kv, data.is_empty()) {
        (DType::F16, false) => Tensor::from_f32_as_f16(ctx, &[data.len()], data, label).unwrap(),
        (DType::F16, true) => Tensor::zeros(ctx, DType::F16, &[2], label).unwrap(),
        _ => upload(ctx, data, label),
    }
}

/// A scratch for up to 64 key slices of `c` (the split plan never asks for more here).
fn split_scratch(ctx: &GpuContext, c: &Case) -> Tensor {
    let floats = attn::split_scratch_floats(ctx, c.shape, c.m, 64);
    Tensor::zeros(ctx, DType::F32, &[floats], "split scratch").unwrap()
}

fn run_with(ctx: &GpuContext, c: &Case, d: &Data, run: Run) -> (Vec<f32>, AttentionPlan) {
    let q = upload(ctx, &d.q, "q");
    let ka = upload_kv(ctx, &d.ka, run.kv, "ka");
    let va = upload_kv(ctx, &d.va, run.kv, "va");
    let kb = upload_kv(ctx, &d.kb, run.kv, "kb");
    let vb = upload_kv(ctx, &d.vb, run.kv, "vb");
    let out = Tensor::zeros(
        ctx,
        DType::F32,
        &[c.m, c.shape.n_heads * c.shape.head_dim],
        "out",
    )
    .unwrap();
    // `Auto` runs as the forward calls it, without a scratch (so without a split).
    let scratch = split_scratch(ctx, c);
    let options = AttentionOptions {
        kernel: run.kernel,
        tuner: None,
        native_f16: run.native_f16,
        scratch: (run.kernel != AttentionKernel::Auto).then_some(&scratch),
        slices: run.slices,
        ..AttentionOptions::default()
    };
    let mut step = StepEncoder::new(ctx, "attention");
    let seg_a = c.len_a.map(|len| KvSegment::first(&ka, &va, len));
    let seg_b = KvSegment::first(&kb, &vb, c.len_b);
    let plan = attn::attention_with(
        &mut step,
        &q,
        c.q_stride,
        c.q_col,
        0..c.m,
        seg_a,
        seg_b,
        &out,
        c.shape,
        &options,
    )
    .unwrap_or_else(|e| panic!("{} {run:?}: {e}", c.label()));
    step.submit().unwrap();
    (out.read_f32(ctx).unwrap(), plan)
}

fn check(c: &Case) -> Vec<f32> {
    let ctx = ctx();
    let d = c.data();
    let got = run_gpu(&ctx, c, &d);
    let want = c.oracle(&d);
    assert_close(&c.label(), &got, &want, TOL);
    got
}

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

fn expect_shape_error(result: unmask_gpu::Result<()>, what: &str) {
    match result {
        Err(GpuError::Shape { .. }) => eprintln!("[check] {what}: rejected"),
        other => panic!("{what}: expected a shape error, got {other:?}"),
    }
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

/// Odd shapes for the variant table: (head_dim, heads, kv heads, query rows, segment A,
/// segment B, q read from a fused QKV row at column head_dim). Query rows 1, 3 and 33; key
/// counts that fill no tile; A empty, B empty; GQA groups 1 and 7; head dims 128 and 7.
type OddShape = (usize, usize, usize, usize, Option<usize>, usize, bool);

const ODD_SHAPES: [OddShape; 7] = [
    (128, 2, 2, 1, None, 37, false),
    (128, 7, 1, 3, Some(45), 0, true),
    (7, 7, 1, 33, Some(0), 70, false),
    (128, 4, 4, 33, Some(21), 50, false),
    (7, 2, 2, 3, Some(100), 29, true),
    (20, 14, 2, 5, Some(17), 65, false),
    (64, 7, 1, 1, Some(3), 130, false),
];

fn odd_case(i: usize) -> Case {
    let (hd, heads, kv, m, la, lb, fused) = ODD_SHAPES[i];
    let shape = AttentionShape {
        n_heads: heads,
        n_kv_heads: kv,
        head_dim: hd,
    };
    let (q_stride, q_col) = if fused {
        ((heads + 2 * kv) * hd, hd)
    } else {
        (heads * hd, 0)
    };
    Case {
        shape,
        q_stride,
        q_col,
        seed: 3000 + 17 * i as u64,
        ..Case::mha(hd, heads, m, la, lb)
    }
}

#[test]
fn every_variant_at_odd_shapes() {
    let ctx = ctx();
    for i in 0..ODD_SHAPES.len() {
        let c = odd_case(i);
        let d = c.data();
        let want = c.oracle(&d);
        for run in f32_variants() {
            let (got, plan) = run_with(&ctx, &c, &d, run);
            assert_eq!(plan.kernel, run.kernel, "{run:?} ran as {plan:?}");
            assert_close(
                &format!("{} [{}]", c.label(), describe(&plan)),
                &got,
                &want,
                TOL,
            );
        }
    }
}

#[test]
fn split_at_several_slice_counts() {
    // Several key tiles in each segment; slice counts from 1 to more than there are tiles
    // (clamped), each against the oracle and against the unsplit wide kernel.
    let ctx = ctx();
    let c = Case {
        shape: AttentionShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 128,
        },
        seed: 4242,
        ..Case::mha(128, 4, 3, Some(70), 261)
    };
    let d = c.data();
    let want = c.oracle(&d);
    let (whole, _) = run_with(&ctx, &c, &d, Run::f32(AttentionKernel::Wide));
    let mut seen = Vec::new();
    for slices in [1, 2, 3, 5, 8, 1000] {
        let (got, plan) = run_with(&ctx, &c, &d, Run::split(slices));
        let label = format!("{} [{} of {slices} asked]", c.label(), describe(&plan));
        assert_close(&label, &got, &want, TOL);
        let diff = relative_error(&got, &whole);
        eprintln!("[check] {label}: vs unsplit {diff:.3e} (tolerance 1e-5)");
        assert!(
            diff <= 1e-5,
            "{label}: split and unsplit differ by {diff:.3e}"
        );
        assert!(
            plan.slices <= slices && (slices == 1 || plan.slices >= 2),
            "{label}: ran {} slices",
            plan.slices
        );
        seen.push(plan.slices);
    }
    seen.dedup();
    assert!(seen.len() >= 4, "slice counts run: {seen:?}");
}

#[test]
fn f16_kv_packed_and_native() {
    // The packed path always (it needs no shader-f16); the native one where the device has
    // shader-f16. Each against the oracle on the f16-rounded K/V (the kernel's own error)
    // and on the f32 originals (what storing the arena in f16 costs).
    let ctx = ctx();
    let mut paths = vec![false];
    if ctx.features.shader_f16 {
        paths.push(true);
    } else {
        eprintln!("[f16] no shader-f16 on this device: the packed path only");
    }
    let round =
        |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect() };
    for i in [1, 2, 4] {
        let c = odd_case(i);
        let d = c.data();
        let rounded = Data {
            q: d.q.clone(),
            ka: round(&d.ka),
            va: round(&d.va),
            kb: round(&d.kb),
            vb: round(&d.vb),
        };
        let want_rounded = c.oracle(&rounded);
        let want_f32 = c.oracle(&d);
        for &native in &paths {
            let split = Run {
                slices: Some(2),
                ..Run::f16(AttentionKernel::WideSplit, native)
            };
            // The register kernel reads f16 at head dims that are multiples of 4.
            let register = c.shape.head_dim.is_multiple_of(4);
            let runs = [
                Some(Run::f16(AttentionKernel::Wide, native)),
                Some(split),
                Some(Run::f16(AttentionKernel::Auto, native)),
                register.then(|| Run::f16(AttentionKernel::Register, native)),
            ];
            for run in runs.into_iter().flatten() {
                let (got, plan) = run_with(&ctx, &c, &d, run);
                // The register kernel unpacks f16 words whatever the device has.
                let expected = if native && plan.kernel != AttentionKernel::Register {
                    KvRead::F16Native
                } else {
                    KvRead::F16Packed
                };
                assert_eq!(plan.read, expected, "{run:?}");
                eprintln!("[f16] {} ran the {} path", c.label(), plan.read.name());
                let label = format!("{} [{}]", c.label(), describe(&plan));
                assert_close(&format!("{label} vs rounded"), &got, &want_rounded, TOL);
                assert_close(&format!("{label} vs f32"), &got, &want_f32, F16_TOL);
            }
        }
    }
}

#[test]
fn auto_plan_on_this_device() {
    // Off hardware GPUs (lavapipe: device type Cpu) the register kernel stays, for f32 K/V
    // and (head dim 128, a multiple of 4) for f16; no scratch, no split. Hardware GPUs run
    // the wide kernel.
    let ctx = ctx();
    let shape = AttentionShape {
        n_heads: 32,
        n_kv_heads: 32,
        head_dim: 128,
    };
    let auto = AttentionKernel::Auto;
    let plain = AttentionOptions::default();
    let f32_plan = auto
        .plan(&ctx, shape, 32, 4096, DType::F32, &plain)
        .unwrap();
    let f16_plan = auto
        .plan(&ctx, shape, 32, 4096, DType::F16, &plain)
        .unwrap();
    eprintln!(
        "[plan] {:?}: f32 K/V -> {}, f16 K/V -> {}",
        ctx.info.device_type,
        describe(&f32_plan),
        describe(&f16_plan)
    );
    let hardware = ctx.features.adapter == unmask_gpu::context::AdapterClass::Gpu;
    if hardware {
        assert_eq!(f32_plan.kernel, AttentionKernel::Wide);
        assert_eq!(f16_plan.kernel, AttentionKernel::Wide);
    } else {
        assert_eq!(f32_plan.kernel, AttentionKernel::Register);
        assert_eq!(f16_plan.kernel, AttentionKernel::Register);
        assert_eq!(f16_plan.read, KvRead::F16Packed);
    }
    // Off hardware GPUs a head dim the register kernel cannot read f16 at goes wide.
    let odd = AttentionShape {
        head_dim: 6,
        ..shape
    };
    let odd_plan = auto.plan(&ctx, odd, 32, 64, DType::F16, &plain).unwrap();
    assert_eq!(odd_plan.kernel, AttentionKernel::Wide, "{odd_plan:?}");
    // With a scratch, 32 rows over 4096 keys split on a hardware GPU (64 workgroups
    // alone) and not elsewhere.
    let floats = attn::split_scratch_floats(&ctx, shape, 32, 64);
    let scratch = Tensor::zeros(&ctx, DType::F32, &[floats], "scratch").unwrap();
    let with_scratch = AttentionOptions {
        scratch: Some(&scratch),
        ..plain
    };
    let long = auto
        .plan(&ctx, shape, 32, 4096, DType::F16, &with_scratch)
        .unwrap();
    let many_rows = auto
        .plan(&ctx, shape, 1024, 4096, DType::F16, &with_scratch)
        .unwrap();
    eprintln!(
        "[plan] with a scratch: 32 rows -> {}, 1024 rows -> {}",
        describe(&long),
        describe(&many_rows)
    );
    if !hardware {
        assert_eq!(long.kernel, AttentionKernel::Register);
    } else {
        assert_eq!(long.kernel, AttentionKernel::WideSplit);
        assert!(32usize.div_ceil(16) * 32 * long.slices >= 256, "{long:?}");
    }
    assert_eq!(many_rows.slices, 1, "{many_rows:?}");
}

#[test]
fn rejects_what_a_variant_cannot_run() {
    let ctx = ctx();
    let shape = AttentionShape {
        n_heads: 2,
        n_kv_heads: 2,
        head_dim: 16,
    };
    let q = Tensor::zeros(&ctx, DType::F32, &[64], "q").unwrap();
    let out = Tensor::zeros(&ctx, DType::F32, &[64], "out").unwrap();
    let kh = Tensor::zeros(&ctx, DType::F16, &[64], "k16").unwrap();
    let vh = Tensor::zeros(&ctx, DType::F16, &[64], "v16").unwrap();
    let k = Tensor::zeros(&ctx, DType::F32, &[64], "k").unwrap();
    let v = Tensor::zeros(&ctx, DType::F32, &[64], "v").unwrap();
    let tiny = Tensor::zeros(&ctx, DType::F32, &[4], "tiny scratch").unwrap();
    let mut step = StepEncoder::new(&ctx, "errors");
    {
        let mut call = |seg_a: Option<KvSegment>, seg_b: KvSegment, options: AttentionOptions| {
            attn::attention_with(
                &mut step,
                &q,
                32,
                0,
                0..1,
                seg_a,
                seg_b,
                &out,
                shape,
                &options,
            )
            .map(|_| ())
        };
        let f16_b = KvSegment::first(&kh, &vh, 1);
        let f32_a = Some(KvSegment::first(&k, &v, 1));
        let options = |kernel, scratch| AttentionOptions {
            kernel,
            scratch,
            ..AttentionOptions::default()
        };
        expect_shape_error(
            call(None, f16_b, options(AttentionKernel::WideSplit, None)),
            "the split without a scratch",
        );
        expect_shape_error(
            call(
                None,
                f16_b,
                options(AttentionKernel::WideSplit, Some(&tiny)),
            ),
            "the split with a scratch too small for one slice",
        );
        expect_shape_error(
            call(f32_a, f16_b, options(AttentionKernel::Wide, None)),
            "segment A in f32, segment B in f16",
        );
        expect_shape_error(
            call(
                None,
                KvSegment::first(&k, &v, 1),
                options(AttentionKernel::WideSplit, Some(&k)),
            ),
            "the scratch aliasing the keys",
        );
    }
    // f16 K/V on the register kernel at a head dim that is not a multiple of 4.
    let shape6 = AttentionShape {
        head_dim: 6,
        ..shape
    };
    expect_shape_error(
        attn::attention_with(
            &mut step,
            &q,
            12,
            0,
            0..1,
            None,
            KvSegment::first(&kh, &vh, 1),
            &out,
            shape6,
            &AttentionOptions {
                kernel: AttentionKernel::Register,
                ..AttentionOptions::default()
            },
        )
        .map(|_| ()),
        "f16 K/V on the register kernel at head_dim 6",
    );
    assert_eq!(step.dispatch_count(), 0, "rejected calls record nothing");
}

#[test]
fn browser_tiles_natively() {
    // The wide kernel's tiles for 16 KiB of workgroup memory (the browser's), run here by
    // capping the context: head dims 128 and 7, with and without a split.
    let ctx = GpuContext::new(&unmask_gpu::ContextOptions {
        max_workgroup_storage_bytes: Some(16 * 1024),
        ..unmask_gpu::ContextOptions::default()
    })
    .expect("GPU adapter");
    assert_eq!(ctx.features.max_workgroup_storage_bytes, 16 * 1024);
    for i in [3, 4] {
        let c = odd_case(i);
        let d = c.data();
        let want = c.oracle(&d);
        for run in [Run::f32(AttentionKernel::Wide), Run::split(3)] {
            let (got, plan) = run_with(&ctx, &c, &d, run);
            let label = format!("{} [{}, 16 KiB tiles]", c.label(), describe(&plan));
            if c.shape.head_dim == 128 {
                // 8 units x 16 keys: the one tile of head dim 128 that fits 16 KiB.
                assert_eq!(plan.tile, (8, 16), "{label}");
            }
            assert_close(&label, &got, &want, TOL);
        }
    }
}

/// The tensor-core kernels (`coop`, and `coop-split` over 2, 3 and the shape's count of key
/// slices): Q K^T and P V as cooperative-matrix products, two passes over the keys. MHA and GQA (query units of several heads in one tile), one and two
/// segments, empty and one-key segments, lengths that divide no tile, strided q, f32 and f16
/// K/V, at the head dim it serves (8 fragments) and at one it does not (runs `wide`). Its
/// inputs are rounded to f16: the f16 budget against the oracle on the unrounded data.
/// Without cooperative matrices they run `wide` and `wide-split`, and say so.
#[test]
fn coop_attention_matches_the_oracle() {
    let ctx = ctx();
    let served = attn::coop_attention(&ctx, 64)
        .or_else(|| attn::coop_attention(&ctx, 128))
        .map(|c| 8 * c.fragment as usize);
    eprintln!(
        "[path] coop attention runs {}",
        match served {
            Some(hd) => format!("cooperative matrices at head dim {hd}"),
            None => "the wide kernel (no cooperative matrices)".to_string(),
        }
    );
    if common::coop_fragment().is_some() {
        assert!(
            served.is_some(),
            "UNMASK_COOP_FRAGMENT is set, no coop attention here"
        );
    }
    let hd = served.unwrap_or(128);
    let cases = [
        (4, 4, 1, None, 1),
        (4, 4, 5, None, 37),
        (2, 2, 33, Some(21), 10),
        (4, 2, 13, Some(0), 40),
        (8, 2, 7, Some(65), 3),
        (4, 1, 40, Some(17), 100),
    ];
    for (heads, kv_heads, m, len_a, len_b) in cases {
        let width = heads * hd;
        let c = Case {
            shape: AttentionShape {
                n_heads: heads,
                n_kv_heads: kv_heads,
                head_dim: hd,
            },
            q_stride: width + 3 * hd,
            q_col: 2 * hd,
            len_a,
            seed: (heads * 100 + m + len_b) as u64,
            ..Case::mha(hd, heads, m, None, len_b)
        };
        let d = c.data();
        let want = c.oracle(&d);
        let coop_split = |slices| Run {
            slices,
            ..Run::f32(AttentionKernel::CoopSplit)
        };
        for run in [
            Run::f32(AttentionKernel::Coop),
            Run::f16(AttentionKernel::Coop, false),
            Run::f16(AttentionKernel::Coop, true),
            coop_split(None),
            coop_split(Some(2)),
            coop_split(Some(3)),
            Run::f16(AttentionKernel::CoopSplit, true),
        ] {
            let (got, plan) = run_with(&ctx, &c, &d, run);
            let expected = match (run.kernel, served.is_some()) {
                (AttentionKernel::Coop, true) => AttentionKernel::Coop,
                (AttentionKernel::Coop, false) => AttentionKernel::Wide,
                (_, true) => AttentionKernel::CoopSplit,
                (_, false) => AttentionKernel::WideSplit,
            };
            assert_eq!(plan.kernel, expected, "{}", c.label());
            let tol = if served.is_some() || run.kv == DType::F16 {
                F16_TOL
            } else {
                TOL
            };
            assert_close(
                &format!("{} {}", c.label(), describe(&plan)),
                &got,
                &want,
                tol,
            );
        }
    }
    // A head dim the kernel does not serve runs `wide`.
    let other = Case::mha(hd / 2, 2, 5, None, 9);
    let (_, plan) = run_with(&ctx, &other, &other.data(), Run::f32(AttentionKernel::Coop));
    assert_eq!(plan.kernel, AttentionKernel::Wide);
}
