//! Attention problems for the attention kernel tests: a shape with query rows and two KV
//! segments, its seeded host data and f64 oracle answer, and one run on the GPU with a chosen
//! kernel, K/V format and slice count, reporting the plan it ran.

use super::{assert_close, ctx, random_vec};
use unmask_core::oracle;
use unmask_gpu::ops::attention::{
    self as attn, AttentionKernel, AttentionOptions, AttentionPlan, AttentionShape, KvSegment,
};
use unmask_gpu::{DType, GpuContext, GpuError, StepEncoder, Tensor};

pub const TOL: f64 = 1e-4;

/// f16 K/V against the f32 oracle on the unrounded data: each K/V element is off by up to
/// 2^-11 of itself, which moves scores (keys scaled to 2) and outputs by ~1e-3 relative.
/// Against the oracle on the f16-rounded data the kernels are held to `TOL`.
pub const F16_TOL: f64 = 5e-3;

/// How one run reads its K/V and which kernel it asks for.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub kernel: AttentionKernel,
    pub kv: DType,
    pub native_f16: bool,
    pub slices: Option<usize>,
}

impl Run {
    pub fn f32(kernel: AttentionKernel) -> Self {
        Run {
            kernel,
            kv: DType::F32,
            native_f16: false,
            slices: None,
        }
    }

    pub fn split(slices: usize) -> Self {
        Run {
            slices: Some(slices),
            ..Run::f32(AttentionKernel::WideSplit)
        }
    }

    pub fn f16(kernel: AttentionKernel, native: bool) -> Self {
        Run {
            kv: DType::F16,
            native_f16: native,
            ..Run::f32(kernel)
        }
    }
}

/// Every concrete variant on f32 K/V: the split at a forced 2 and 3 slices and at the count
/// the shape gives.
pub fn f32_variants() -> Vec<Run> {
    vec![
        Run::f32(AttentionKernel::Register),
        Run::f32(AttentionKernel::Wide),
        Run::split(2),
        Run::split(3),
        Run::f32(AttentionKernel::WideSplit),
    ]
}

pub fn describe(plan: &AttentionPlan) -> String {
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
pub struct Case {
    pub shape: AttentionShape,
    pub m: usize,
    pub q_stride: usize,
    pub q_col: usize,
    /// `None`: no segment A; `Some(0)`: an empty one.
    pub len_a: Option<usize>,
    pub len_b: usize,
    pub seed: u64,
}

pub struct Data {
    pub q: Vec<f32>,
    pub ka: Vec<f32>,
    pub va: Vec<f32>,
    pub kb: Vec<f32>,
    pub vb: Vec<f32>,
}

impl Case {
    pub fn mha(
        head_dim: usize,
        n_heads: usize,
        m: usize,
        len_a: Option<usize>,
        len_b: usize,
    ) -> Self {
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

    pub fn kv_width(&self) -> usize {
        self.shape.n_kv_heads * self.shape.head_dim
    }

    pub fn data(&self) -> Data {
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

    pub fn oracle(&self, d: &Data) -> Vec<f32> {
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

    pub fn label(&self) -> String {
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
pub fn upload(ctx: &GpuContext, data: &[f32], label: &str) -> Tensor {
    if data.is_empty() {
        Tensor::zeros(ctx, DType::F32, &[1], label).unwrap()
    } else {
        Tensor::from_f32(ctx, &[data.len()], data, label).unwrap()
    }
}

pub fn run_gpu(ctx: &GpuContext, c: &Case, d: &Data) -> Vec<f32> {
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

pub fn run_with(ctx: &GpuContext, c: &Case, d: &Data, run: Run) -> (Vec<f32>, AttentionPlan) {
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

pub fn check(c: &Case) -> Vec<f32> {
    let ctx = ctx();
    let d = c.data();
    let got = run_gpu(&ctx, c, &d);
    let want = c.oracle(&d);
    assert_close(&c.label(), &got, &want, TOL);
    got
}

pub fn expect_shape_error(result: unmask_gpu::Result<()>, what: &str) {
    match result {
        Err(GpuError::Shape { .. }) => eprintln!("[check] {what}: rejected"),
        other => panic!("{what}: expected a shape error, got {other:?}"),
    }
}
