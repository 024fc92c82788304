//! Attention with DiffusionGemma's masks, scale and head dims against the f64 oracle: causal
//! with and without a sliding window (window 1, windows smaller than the rows), a commit
//! pass (cached keys in segment A, new rows in B, `query_start` past A), the decoder pass
//! (bidirectional over a row range of the cache and the canvas, scale 1.0), GQA, head dims
//! 16, 32, 256 and 512 (and 200, 300: partial chunks of the large classes), f32 and f16 K/V,
//! each kernel forced where it serves the case; and the errors of bad masks and head dims.

use crate::common;

use std::time::Instant;

use common::{assert_close, ctx, random_vec};
use unmask_core::oracle::attention::{Mask, attention_masked};
use unmask_gpu::ops::attention::{
    self as attn, AttentionKernel, AttentionMask, AttentionOptions, AttentionPlan, AttentionShape,
    KvSegment,
};
use unmask_gpu::{DType, GpuContext, GpuError, StepEncoder, Tensor};

/// Against the oracle on the K/V the kernel read (f16-rounded for f16 runs).
const TOL: f64 = 1e-4;

/// One forced run: kernel, K/V format, split slices.
#[derive(Clone, Copy, Debug)]
struct Run {
    kernel: AttentionKernel,
    kv: DType,
    slices: Option<usize>,
}

impl Run {
    fn new(kernel: AttentionKernel) -> Self {
        Run {
            kernel,
            kv: DType::F32,
            slices: None,
        }
    }

    fn split(slices: usize) -> Self {
        Run {
            slices: Some(slices),
            ..Run::new(AttentionKernel::WideSplit)
        }
    }

    fn f16(self) -> Self {
        Run {
            kv: DType::F16,
            ..self
        }
    }
}

/// Every kernel that serves `head_dim` (the register kernel up to 128), the split at 2 and
/// 3 slices, and `Auto`.
fn runs(head_dim: usize) -> Vec<Run> {
    let mut v = vec![
        Run::new(AttentionKernel::Wide),
        Run::split(2),
        Run::split(3),
        Run::new(AttentionKernel::Auto),
    ];
    if head_dim <= attn::REGISTER_MAX_HEAD_DIM {
        v.insert(0, Run::new(AttentionKernel::Register));
    }
    v
}

/// One problem. The query rows are rows `row0 .. row0 + m` of a q of `row0 + m + 1` rows
/// (one sequence of a batch); segment A is rows `a_start ..` of its tensor (the decoder's
/// range of the cache).
#[derive(Clone, Copy, Debug)]
struct Case {
    shape: AttentionShape,
    m: usize,
    row0: usize,
    len_a: Option<usize>,
    a_start: usize,
    len_b: usize,
    scale: Option<f32>,
    mask: AttentionMask,
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
    /// The encoder pass: `m` rows over their own keys (all in B), causal within `window`.
    fn encoder(
        head_dim: usize,
        n_heads: usize,
        n_kv_heads: usize,
        m: usize,
        window: usize,
    ) -> Self {
        Case {
            shape: AttentionShape {
                n_heads,
                n_kv_heads,
                head_dim,
            },
            m,
            row0: 0,
            len_a: None,
            a_start: 0,
            len_b: m,
            scale: Some(1.0),
            mask: AttentionMask::sliding(window, 0),
            seed: (head_dim * 131 + n_kv_heads * 17 + m + window) as u64,
        }
    }

    /// The commit pass: `m` new rows (keys in B) after `cached` keys in A.
    fn commit(head_dim: usize, n_kv_heads: usize, cached: usize, m: usize, window: usize) -> Self {
        Case {
            len_a: Some(cached),
            mask: AttentionMask::sliding(window, cached),
            row0: 2,
            seed: (head_dim * 7 + cached * 3 + m + window) as u64 + 5000,
            ..Case::encoder(head_dim, 4, n_kv_heads, m, window)
        }
    }

    fn width(&self) -> usize {
        self.shape.n_heads * self.shape.head_dim
    }

    fn kv_width(&self) -> usize {
        self.shape.n_kv_heads * self.shape.head_dim
    }

    fn q_rows(&self) -> usize {
        self.row0 + self.m + 1
    }

    fn data(&self) -> Data {
        let kw = self.kv_width();
        let a_rows = self.a_start + self.len_a.unwrap_or(0);
        // Scores of a few units at scale 1.0 (q small), far from uniform either way.
        let q_amp = match self.scale {
            Some(_) => 4.0 / (self.shape.head_dim as f32).sqrt(),
            None => 1.0,
        };
        Data {
            q: random_vec(self.seed, self.q_rows() * self.width(), q_amp),
            ka: random_vec(self.seed + 1, a_rows * kw, 2.0),
            va: random_vec(self.seed + 2, a_rows * kw, 1.0),
            kb: random_vec(self.seed + 3, self.len_b * kw, 2.0),
            vb: random_vec(self.seed + 4, self.len_b * kw, 1.0),
        }
    }

    fn oracle(&self, d: &Data) -> Vec<f32> {
        let kw = self.kv_width();
        let s = self.shape;
        attention_masked(
            &d.q[self.row0 * self.width()..],
            self.width(),
            0,
            self.m,
            self.len_a
                .map(|len| (&d.ka[self.a_start * kw..], &d.va[self.a_start * kw..], len)),
            (&d.kb, &d.vb, self.len_b),
            s.n_heads,
            s.n_kv_heads,
            s.head_dim,
            self.scale.map(f64::from),
            Mask {
                causal: self.mask.causal,
                window: self.mask.window,
                query_start: self.mask.query_start,
            },
        )
    }

    fn label(&self) -> String {
        let (s, mask) = (self.shape, self.mask);
        format!(
            "hd={} heads={}/{} m={} A={:?}@{} B={} scale={:?} {mask:?}",
            s.head_dim,
            s.n_heads,
            s.n_kv_heads,
            self.m,
            self.len_a,
            self.a_start,
            self.len_b,
            self.scale,
        )
    }
}

fn upload(ctx: &GpuContext, data: &[f32], kv: DType, label: &str) -> Tensor {
    match (kv, data.is_empty()) {
        (_, true) => Tensor::zeros(ctx, kv, &[4], label).unwrap(),
        (DType::F16, false) => Tensor::from_f32_as_f16(ctx, &[data.len()], data, label).unwrap(),
        _ => Tensor::from_f32(ctx, &[data.len()], data, label).unwrap(),
    }
}

fn round_f16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
}

/// The call's rows of `out`, and the plan that ran; the rows around them must stay zero.
fn run_on(ctx: &GpuContext, c: &Case, d: &Data, run: Run) -> (Vec<f32>, AttentionPlan) {
    let q = upload(ctx, &d.q, DType::F32, "q");
    let [ka, va, kb, vb] = [(&d.ka, "ka"), (&d.va, "va"), (&d.kb, "kb"), (&d.vb, "vb")]
        .map(|(data, label)| upload(ctx, data, run.kv, label));
    let out = Tensor::zeros(ctx, DType::F32, &[c.q_rows(), c.width()], "out").unwrap();
    let floats = attn::split_scratch_floats(ctx, c.shape, c.m, 64);
    let scratch = Tensor::zeros(ctx, DType::F32, &[floats], "split scratch").unwrap();
    let seg_a = c.len_a.map(|len| KvSegment {
        k: &ka,
        v: &va,
        start: c.a_start,
        len,
    });
    let options = AttentionOptions {
        kernel: run.kernel,
        // `Auto` runs as the forward calls it, without a scratch (so without a split).
        scratch: (run.kernel != AttentionKernel::Auto).then_some(&scratch),
        slices: run.slices,
        scale: c.scale,
        mask: c.mask,
        ..AttentionOptions::default()
    };
    let mut step = StepEncoder::new(ctx, "masked attention");
    let plan = attn::attention_with(
        &mut step,
        &q,
        c.width(),
        0,
        c.row0..c.row0 + c.m,
        seg_a,
        KvSegment::first(&kb, &vb, c.len_b),
        &out,
        c.shape,
        &options,
    )
    .unwrap_or_else(|e| panic!("{} {run:?}: {e}", c.label()));
    step.submit().unwrap();
    let all = out.read_f32(ctx).unwrap();
    let w = c.width();
    let (before, rest) = all.split_at(c.row0 * w);
    let (rows, after) = rest.split_at(c.m * w);
    assert!(
        before.iter().chain(after).all(|&x| x == 0.0),
        "{} {run:?}: wrote outside its rows",
        c.label()
    );
    (rows.to_vec(), plan)
}

/// Every run of `runs` on `c` against the oracle (on f16-rounded K/V for f16 runs); each
/// forced kernel must run as asked, `Auto` must pick one that serves the head dim.
fn check_runs(ctx: &GpuContext, c: &Case, runs: &[Run]) {
    let d = c.data();
    let want = c.oracle(&d);
    let rounded = Data {
        q: d.q.clone(),
        ka: round_f16(&d.ka),
        va: round_f16(&d.va),
        kb: round_f16(&d.kb),
        vb: round_f16(&d.vb),
    };
    let mut want_f16 = None;
    for &run in runs {
        let (got, plan) = run_on(ctx, c, &d, run);
        if run.kernel != AttentionKernel::Auto {
            assert_eq!(plan.kernel, run.kernel, "{} {run:?}", c.label());
        } else if c.shape.head_dim > attn::REGISTER_MAX_HEAD_DIM {
            assert_ne!(plan.kernel, AttentionKernel::Register, "{}", c.label());
        }
        let label = format!(
            "{} [{} {} slices={}]",
            c.label(),
            plan.kernel.name(),
            plan.read.name(),
            plan.slices
        );
        let want = match run.kv {
            DType::F16 => want_f16.get_or_insert_with(|| c.oracle(&rounded)),
            _ => &want,
        };
        assert_close(&label, &got, want, TOL);
    }
}

#[test]
fn causal_with_and_without_a_window() {
    // The encoder pass at the fixture's head dims: more rows (and keys) than one tile of
    // the register kernel (64 keys at head dim 16) or the wide one; windows of 1, one
    // smaller than a tile, and none; GQA groups 4 and 2.
    let ctx = ctx();
    let start = Instant::now();
    for (hd, kv) in [(16, 1), (32, 2)] {
        for window in [0, 1, 9] {
            let c = Case::encoder(hd, 4, kv, 75, window);
            check_runs(&ctx, &c, &runs(hd));
        }
    }
    let f16 = [
        Run::new(AttentionKernel::Register).f16(),
        Run::new(AttentionKernel::Wide).f16(),
        Run::split(2).f16(),
    ];
    check_runs(&ctx, &Case::encoder(32, 4, 2, 40, 7), &f16);
    eprintln!(
        "[time] causal masks: {:.2} s",
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn commit_pass_across_segments() {
    // Cached keys in A, the new rows' keys in B, query_start = len A: with a window smaller
    // than A (leading tiles of A skipped), of 1, and none. Query rows at row 2 of q (one
    // sequence of a batch) and segment A read from row 3 of its tensor.
    let ctx = ctx();
    let start = Instant::now();
    for (hd, kv, cached, m, window) in [
        (16, 1, 70, 30, 0),
        (16, 2, 70, 30, 20),
        (32, 1, 45, 19, 1),
        (32, 2, 130, 11, 64),
    ] {
        let c = Case {
            a_start: 3,
            ..Case::commit(hd, kv, cached, m, window)
        };
        check_runs(&ctx, &c, &runs(hd));
    }
    // LLaDA's default scale under a causal mask.
    let default_scale = Case {
        scale: None,
        ..Case::commit(32, 2, 33, 12, 10)
    };
    check_runs(&ctx, &default_scale, &runs(32));
    // A causal row may sit inside segment A: rows at key indices 10.. of A ++ B.
    let inside = Case {
        mask: AttentionMask::sliding(5, 10),
        m: 40,
        ..Case::commit(16, 2, 30, 30, 5)
    };
    check_runs(&ctx, &inside, &runs(16));
    eprintln!("[time] commit pass: {:.2} s", start.elapsed().as_secs_f64());
}

#[test]
fn a_tile_hidden_from_some_units_mid_way() {
    // Rows at key indices 2.. over A (5 keys) and B (130): B's tiles start at key index 5,
    // so some workgroup holds rows on both sides of a B tile boundary. With window 1 the
    // later rows see nothing of the tile before it (which is not skipped: the earlier rows
    // see it): their running max is still the floor when it is scored, and the masked
    // scores must weigh exactly 0 (the output is each row's own value, no NaN).
    let ctx = ctx();
    for window in [1, 3] {
        let c = Case {
            mask: AttentionMask::sliding(window, 2),
            m: 100,
            row0: 0,
            shape: AttentionShape {
                n_heads: 2,
                n_kv_heads: 2,
                head_dim: 16,
            },
            ..Case::commit(16, 2, 5, 130, window)
        };
        check_runs(&ctx, &c, &runs(16));
    }
}

#[test]
fn decoder_pass_scale_one() {
    // Bidirectional over a row range of the cache (segment A from row 6) and the canvas
    // (segment B); scale 1.0 instead of 1/sqrt(head_dim).
    let ctx = ctx();
    for (hd, kv) in [(16, 1), (32, 2)] {
        let c = Case {
            mask: AttentionMask::default(),
            len_a: Some(21),
            a_start: 6,
            ..Case::encoder(hd, 4, kv, 24, 0)
        };
        check_runs(&ctx, &c, &runs(hd));
        check_runs(&ctx, &c, &[Run::split(2).f16()]);
    }
}

#[test]
fn large_head_dims() {
    // DiffusionGemma's 256 (sliding layers) and 512 (full layers), staged 128 dims at a
    // time by the wide kernels; 200 and 300 end inside a chunk. The register kernel serves
    // none of them, and `Auto` must not pick it.
    let ctx = ctx();
    let start = Instant::now();
    for (hd, kv, window) in [(256, 2, 7), (512, 1, 0), (200, 2, 0), (300, 1, 5)] {
        let c = Case::commit(hd, kv, 13, 9, window);
        check_runs(&ctx, &c, &runs(hd));
    }
    for hd in [256, 512] {
        let c = Case::commit(hd, 2, 6, 7, 4);
        check_runs(
            &ctx,
            &c,
            &[Run::new(AttentionKernel::Wide).f16(), Run::split(2).f16()],
        );
        // Decoder: bidirectional, scale 1.0.
        let dec = Case {
            mask: AttentionMask::default(),
            ..c
        };
        check_runs(&ctx, &dec, &[Run::new(AttentionKernel::Wide)]);
    }
    eprintln!(
        "[time] head dims 200-512: {:.2} s",
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn large_head_dims_in_browser_tiles() {
    // 16 KiB of workgroup memory (a browser's): head dims 256 and 512 take head dim 128's
    // tile of 8 units x 16 keys.
    let ctx = GpuContext::new(&unmask_gpu::ContextOptions {
        max_workgroup_storage_bytes: Some(16 * 1024),
        ..common::options()
    })
    .expect("GPU adapter");
    for hd in [256, 512] {
        let c = Case::commit(hd, 2, 20, 9, 6);
        let d = c.data();
        let want = c.oracle(&d);
        for run in [Run::new(AttentionKernel::Wide), Run::split(2)] {
            let (got, plan) = run_on(&ctx, &c, &d, run);
            assert_eq!(plan.tile, (8, 16), "{} {run:?}", c.label());
            assert_close(
                &format!("{} [16 KiB, {run:?}]", c.label()),
                &got,
                &want,
                TOL,
            );
        }
    }
}

#[test]
fn coop_kernels_honour_the_mask() {
    // The tensor-core kernels where this device has them (UNMASK_COOP_FRAGMENT on
    // lavapipe), else their wide stand-ins: causal with a window across both segments, and
    // the decoder's scale 1.0.
    let ctx = ctx();
    // Every head dim it serves here (8, 16 and 32 fragments), else 128 on the wide
    // stand-ins.
    let mut dims: Vec<usize> = [64, 128, 256, 512]
        .into_iter()
        .filter(|&hd| attn::coop_attention(&ctx, hd).is_some())
        .collect();
    if dims.is_empty() {
        dims.push(128);
    }
    eprintln!("[path] coop attention at head dims {dims:?}");
    let coop = [
        Run::new(AttentionKernel::Coop),
        Run {
            slices: Some(2),
            ..Run::new(AttentionKernel::CoopSplit)
        },
    ];
    for (hd, window) in dims.iter().flat_map(|&hd| [(hd, 0), (hd, 3)]) {
        let c = Case::commit(hd, 2, 37, 20, window);
        let d = c.data();
        let want = c.oracle(&d);
        for run in coop {
            let (got, plan) = run_on(&ctx, &c, &d, run);
            // Tensor cores round their inputs to f16: the f16 budget of kernels_attention.
            let tol = match plan.kernel {
                AttentionKernel::Coop | AttentionKernel::CoopSplit => 5e-3,
                _ => TOL,
            };
            assert_close(
                &format!("{} [{}]", c.label(), plan.kernel.name()),
                &got,
                &want,
                tol,
            );
        }
    }
}

fn expect_error(result: unmask_gpu::Result<AttentionPlan>, what: &str, names: &[&str]) {
    match result {
        Err(GpuError::Shape {
            expected, found, ..
        }) => {
            let text = format!("expected {expected}, found {found}");
            for name in names {
                assert!(
                    text.contains(name),
                    "{what}: {text:?} does not name {name:?}"
                );
            }
            eprintln!("[check] {what}: {text}");
        }
        other => panic!("{what}: expected a shape error, got {other:?}"),
    }
}

#[test]
fn rejects_bad_masks_and_head_dims() {
    let ctx = ctx();
    let t = |n: usize| Tensor::zeros(&ctx, DType::F32, &[n], "t").unwrap();
    let (q, k, v, out) = (t(8192), t(8192), t(8192), t(8192));
    let mut step = StepEncoder::new(&ctx, "errors");
    let mut call = |head_dim: usize, keys: usize, m: usize, options: AttentionOptions| {
        let shape = AttentionShape {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim,
        };
        attn::attention_with(
            &mut step,
            &q,
            2 * head_dim,
            0,
            0..m,
            None,
            KvSegment::first(&k, &v, keys),
            &out,
            shape,
            &options,
        )
    };
    let with = |mask: AttentionMask| AttentionOptions {
        mask,
        ..AttentionOptions::default()
    };
    let window_only = AttentionMask {
        window: 4,
        ..AttentionMask::default()
    };
    expect_error(
        call(16, 8, 2, with(window_only)),
        "a window without a causal mask",
        &["mask.window", "mask.causal false"],
    );
    let start_only = AttentionMask {
        query_start: 3,
        ..AttentionMask::default()
    };
    expect_error(
        call(16, 8, 2, with(start_only)),
        "a query start without a causal mask",
        &["mask.query_start 3"],
    );
    expect_error(
        call(16, 8, 3, with(AttentionMask::sliding(2, 6))),
        "causal rows past the last key",
        &["mask.query_start", "keys (8)", "6 + 3 rows"],
    );
    expect_error(
        call(513, 8, 1, AttentionOptions::default()),
        "head_dim 513",
        &["head_dim in 1..=512", "head_dim 513"],
    );
    let register = AttentionOptions {
        kernel: AttentionKernel::Register,
        ..AttentionOptions::default()
    };
    expect_error(
        call(256, 8, 1, register),
        "head_dim 256 on the register kernel",
        &["at most 128 for the register kernel", "head_dim 256"],
    );
    for scale in [f32::NAN, 0.0, -1.0, f32::INFINITY] {
        let bad = AttentionOptions {
            scale: Some(scale),
            ..AttentionOptions::default()
        };
        expect_error(call(16, 8, 1, bad), "a bad scale", &["scale", "finite"]);
    }
    // A causal call whose last row is the last key is valid; so is an empty one.
    call(16, 8, 3, with(AttentionMask::causal(5))).expect("rows at the last keys");
    call(16, 8, 0, with(AttentionMask::causal(8))).expect("no rows");
    assert_eq!(
        step.dispatch_count(),
        1,
        "rejected calls must record nothing"
    );
}
