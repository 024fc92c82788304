//! Matmul kernels (`y = x · Wᵀ`) against the f64 CPU oracle: every kernel, every weight
//! format the device has, shapes that do and do not divide the tiles, chunked weights.
//! `gemm-f16` runs f16 arithmetic where the device has shader-f16 and `gemm` otherwise;
//! `coop` runs cooperative matrices where the device has them and `gemm` otherwise; each
//! test prints which.

use crate::common;

use unmask_core::oracle::matmul::matmul_xwt;
use unmask_core::quant::{self, QuantFormat};
use unmask_gpu::ops::matmul::{MatmulKernel, coop_shape, gemm_bk16_bytes, gemm_k_depth, matmul};
use unmask_gpu::{DType, GpuContext, GpuError, StepEncoder, Tensor, Weight, WeightFormat};

const KERNELS: [MatmulKernel; 9] = [
    MatmulKernel::Naive,
    MatmulKernel::Tiled,
    MatmulKernel::TiledShared,
    MatmulKernel::Gemm,
    MatmulKernel::GemmF16,
    MatmulKernel::Narrow,
    MatmulKernel::Coop,
    MatmulKernel::CoopSplit,
    MatmulKernel::Auto,
];

/// (M, N, K): tiles are 16 x 16 (naive), 32 x 32 (tiled), 64 x 64 x 16 (shared), 128 x 128
/// x 8|16 (gemm), 32 x 16 x 64 (narrow); K % 4 takes every value so both the vec4-x and the
/// scalar-x paths run, with every tail length; M = 1, 63 and 65 sit at the small-M edge.
const SHAPES: [(usize, usize, usize); 11] = [
    (1, 1, 1),
    (5, 7, 13),
    (3, 9, 6),
    (2, 33, 7),
    (33, 65, 64),
    (64, 128, 96),
    (17, 300, 130),
    (70, 40, 36),
    (1, 150, 40),
    (63, 37, 70),
    (65, 131, 33),
];

fn formats(ctx: &GpuContext) -> Vec<WeightFormat> {
    let mut f = vec![WeightFormat::F32, WeightFormat::F16Packed];
    if ctx.features.shader_f16 {
        f.push(WeightFormat::F16Native);
    } else {
        eprintln!("[path] no shader-f16 on this device: native f16 weights not tested");
    }
    f
}

fn tolerance(format: WeightFormat) -> f64 {
    match format {
        WeightFormat::F32 => 1e-4,
        // Error of storing the weights in f16, measured against the exact f32 weights.
        WeightFormat::F16Packed | WeightFormat::F16Native => 1e-2,
        WeightFormat::Q8 | WeightFormat::Q4 => unreachable!("tested in kernels_quant.rs"),
    }
}

/// Whether `kernel` rounds its inputs to f16 here (`gemm-f16` with shader-f16, `coop` with
/// cooperative matrices).
fn f16_arithmetic(ctx: &GpuContext, kernel: MatmulKernel) -> bool {
    matches!(
        kernel.plan(ctx, 1, WeightFormat::F32).0,
        MatmulKernel::GemmF16 | MatmulKernel::Coop | MatmulKernel::CoopSplit
    )
}

/// The f16-arithmetic GEMM rounds x and W to f16 (2^-11 relative) and sums 8 or 16 products
/// in f16 before adding them in f32: about 1e-3 of the largest output on these shapes, so
/// it is held to the f16-storage bound; a wrong index or scale is off by O(1).
fn kernel_tolerance(ctx: &GpuContext, kernel: MatmulKernel, tol: f64) -> f64 {
    if f16_arithmetic(ctx, kernel) {
        tol.max(1e-2)
    } else {
        tol
    }
}

/// Says which paths `gemm-f16` and `coop` take on this device.
fn print_f16_path(ctx: &GpuContext) {
    eprintln!(
        "[path] gemm-f16 runs {}",
        if f16_arithmetic(ctx, MatmulKernel::GemmF16) {
            "f16 arithmetic (shader-f16)"
        } else {
            "the f32 gemm (no shader-f16)"
        }
    );
    let coop = MatmulKernel::Coop.plan(ctx, 1, WeightFormat::F32).0;
    match coop_shape(ctx) {
        Some(shape) => {
            assert_eq!(coop, MatmulKernel::Coop);
            if let Some(side) = common::coop_fragment() {
                assert_eq!(shape.fragment, side, "UNMASK_COOP_FRAGMENT");
            }
            eprintln!(
                "[path] coop runs cooperative matrices ({0}x{0} fragments, subgroup size {1}, \
                 {2}-deep k-tiles)",
                shape.fragment, shape.subgroup, shape.k_depth
            );
        }
        None => {
            assert!(
                common::coop_fragment().is_none(),
                "UNMASK_COOP_FRAGMENT is set but this adapter runs no cooperative matrices"
            );
            assert_eq!(coop, MatmulKernel::Gemm);
            eprintln!(
                "[path] coop runs the f32 gemm (no cooperative matrices: {})",
                if ctx.features.cooperative_configs.is_empty() {
                    "the adapter reports none".to_string()
                } else {
                    format!("{:?}", ctx.features.cooperative_configs)
                }
            );
        }
    }
}

/// Runs one matmul with `x` and `y` allocated `extra` rows bigger than `m`; checks that the
/// extra rows of `y` keep their sentinel and returns the first `m` rows.
fn run(
    ctx: &GpuContext,
    x: &[f32],
    w: &Weight,
    m: usize,
    extra: usize,
    kernel: MatmulKernel,
) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let mut x_full = x.to_vec();
    x_full.extend(common::random_vec(99, extra * k, 1.0));
    let xt = Tensor::from_f32(ctx, &[m + extra, k], &x_full, "x").expect("x");
    let sentinel = vec![-7.25f32; (m + extra) * n];
    let yt = Tensor::from_f32(ctx, &[m + extra, n], &sentinel, "y").expect("y");
    let mut step = StepEncoder::new(ctx, "matmul test");
    matmul(&mut step, &xt, w, &yt, m, kernel).expect("matmul");
    step.submit().expect("submit");
    let got = yt.read_f32(ctx).expect("read y");
    assert!(
        got[m * n..].iter().all(|v| *v == -7.25),
        "{}: rows past m were written",
        kernel.name()
    );
    got[..m * n].to_vec()
}

#[test]
fn every_kernel_and_format_matches_oracle() {
    let ctx = common::ctx();
    let formats = formats(&ctx);
    print_f16_path(&ctx);
    for &format in &formats {
        for m in [1, 63, 64, 256] {
            let (kernel, decode) = MatmulKernel::Auto.plan(&ctx, m, format);
            eprintln!(
                "[path] auto, {} weights, m={m}: {} kernel reading {}",
                format.name(),
                kernel.name(),
                decode.name()
            );
        }
    }
    for (si, &(m, n, k)) in SHAPES.iter().enumerate() {
        let x = common::random_vec(10 + si as u64, m * k, 1.0);
        let wd = common::random_vec(20 + si as u64, n * k, 0.5);
        let want = matmul_xwt(&x, &wd, m, n, k);
        for &format in &formats {
            let w = Weight::from_f32(&ctx, n, k, &wd, format, "w").expect("weight");
            assert_eq!(w.format, format, "format was resolved to another path");
            for kernel in KERNELS {
                let got = run(&ctx, &x, &w, m, 2, kernel);
                common::assert_close(
                    &format!("{} {} m={m} n={n} k={k}", kernel.name(), format.name()),
                    &got,
                    &want,
                    kernel_tolerance(&ctx, kernel, tolerance(format)),
                );
            }
        }
    }
}

#[test]
fn f16_weights_are_rounded_not_truncated() {
    // The f16 error must be the size of f16 rounding (2^-11 relative per weight), far below
    // the 1e-2 tolerance; a wrong half order or unpacking would be off by O(1).
    let ctx = common::ctx();
    let (m, n, k) = (9, 70, 257);
    let x = common::random_vec(5, m * k, 1.0);
    let wd = common::random_vec(6, n * k, 1.0);
    let want = matmul_xwt(&x, &wd, m, n, k);
    for format in formats(&ctx)
        .into_iter()
        .filter(|f| *f != WeightFormat::F32)
    {
        let w = Weight::from_f32(&ctx, n, k, &wd, format, "w").expect("weight");
        for kernel in KERNELS {
            let got = run(&ctx, &x, &w, m, 0, kernel);
            common::assert_close(
                &format!("{} {} m={m} n={n} k={k}", kernel.name(), format.name()),
                &got,
                &want,
                kernel_tolerance(&ctx, kernel, 2e-3),
            );
        }
    }
}

#[test]
fn chunked_weight_writes_each_chunk_columns() {
    // 64 f32 rows of 40 columns fit the limit, so W [200, 40] splits into 64 + 64 + 64 + 8.
    let limit = 64 * 40 * 4;
    let ctx = common::ctx_with_binding_limit(limit);
    let (m, n, k) = (9, 200, 40);
    let x = common::random_vec(31, m * k, 1.0);
    let wd = common::random_vec(32, n * k, 0.5);
    let want = matmul_xwt(&x, &wd, m, n, k);
    for format in formats(&ctx) {
        let w = Weight::from_f32(&ctx, n, k, &wd, format, "w").expect("weight");
        eprintln!(
            "[path] {}: {} chunks of rows {:?}",
            format.name(),
            w.chunks.len(),
            w.chunks.iter().map(|c| c.rows).collect::<Vec<_>>()
        );
        assert!(w.chunks.len() > 1, "weight was not split into chunks");
        for kernel in KERNELS {
            let got = run(&ctx, &x, &w, m, 1, kernel);
            common::assert_close(
                &format!(
                    "chunked {} {} m={m} n={n} k={k}",
                    kernel.name(),
                    format.name()
                ),
                &got,
                &want,
                kernel_tolerance(&ctx, kernel, tolerance(format)),
            );
        }
    }
}

#[test]
fn chunked_weight_with_odd_k() {
    // K % 4 == 3 pads each row to 12 elements; 64 rows of 48 bytes fit the limit.
    let ctx = common::ctx_with_binding_limit(64 * 12 * 4);
    let (m, n, k) = (3, 150, 11);
    let x = common::random_vec(41, m * k, 1.0);
    let wd = common::random_vec(42, n * k, 0.5);
    let want = matmul_xwt(&x, &wd, m, n, k);
    let w = Weight::from_f32(&ctx, n, k, &wd, WeightFormat::F32, "w").expect("weight");
    assert!(w.chunks.len() > 1, "weight was not split into chunks");
    for kernel in KERNELS {
        let got = run(&ctx, &x, &w, m, 0, kernel);
        common::assert_close(
            &format!("chunked {} f32 m={m} n={n} k={k}", kernel.name()),
            &got,
            &want,
            kernel_tolerance(&ctx, kernel, 1e-4),
        );
    }
}

fn expect_shape_error(result: unmask_gpu::Result<()>, what: &str) {
    match result {
        Err(GpuError::Shape {
            op,
            expected,
            found,
        }) => {
            eprintln!("[check] {what}: shape error (expected {expected}, found {found})");
            assert_eq!(op, "matmul");
        }
        other => panic!("{what}: expected a matmul shape error, got {other:?}"),
    }
}

#[test]
fn shape_errors_name_the_op() {
    let ctx = common::ctx();
    let (m, n, k) = (4, 8, 12);
    let w = Weight::from_f32(
        &ctx,
        n,
        k,
        &common::random_vec(1, n * k, 1.0),
        WeightFormat::F32,
        "w",
    )
    .expect("weight");
    let x = Tensor::from_f32(&ctx, &[m, k], &common::random_vec(2, m * k, 1.0), "x").expect("x");
    let y = Tensor::zeros(&ctx, DType::F32, &[m, n], "y").expect("y");
    let x_wrong_k = Tensor::zeros(&ctx, DType::F32, &[m, k + 1], "x").expect("x");
    let y_wrong_n = Tensor::zeros(&ctx, DType::F32, &[m, n - 1], "y").expect("y");
    let x_u32 = Tensor::zeros(&ctx, DType::U32, &[m, k], "x").expect("x");
    let mut step = StepEncoder::new(&ctx, "shape errors");
    for kernel in KERNELS {
        expect_shape_error(
            matmul(&mut step, &x_wrong_k, &w, &y, m, kernel),
            "x with K + 1",
        );
        expect_shape_error(
            matmul(&mut step, &x, &w, &y_wrong_n, m, kernel),
            "y with N - 1",
        );
        expect_shape_error(
            matmul(&mut step, &x, &w, &y, m + 1, kernel),
            "m past x rows",
        );
        expect_shape_error(matmul(&mut step, &x_u32, &w, &y, m, kernel), "x of u32");
    }
    assert_eq!(
        step.dispatch_count(),
        0,
        "a failed call recorded a dispatch"
    );
    // m = 0 is valid and records nothing.
    matmul(&mut step, &x, &w, &y, 0, MatmulKernel::Auto).expect("m = 0");
    assert_eq!(step.dispatch_count(), 0);
}

/// The host reference of the fused forms: RMSNorm of x (weight g) in front, SwiGLU of a
/// gate|up pair behind, a residual added.
fn fused_oracle(
    x: &[f32],
    m: usize,
    k: usize,
    norm: Option<&[f32]>,
    gate: &[f32],
    up: Option<&[f32]>,
    residual: Option<&[f32]>,
) -> Vec<f32> {
    let eps = 1e-5f64;
    let xn: Vec<f32> = match norm {
        Some(g) => x
            .chunks(k)
            .flat_map(|row| {
                let ms = row
                    .iter()
                    .map(|&v| f64::from(v) * f64::from(v))
                    .sum::<f64>()
                    / k as f64;
                let inv = 1.0 / (ms + eps).sqrt();
                row.iter()
                    .zip(g)
                    .map(move |(&v, &w)| (f64::from(v) * inv * f64::from(w)) as f32)
                    .collect::<Vec<_>>()
            })
            .collect(),
        None => x.to_vec(),
    };
    let n = gate.len() / k;
    let mut y = matmul_xwt(&xn, gate, m, n, k);
    if let Some(up) = up {
        let u = matmul_xwt(&xn, up, m, n, k);
        for (g, u) in y.iter_mut().zip(u) {
            let gv = f64::from(*g);
            *g = (gv / (1.0 + (-gv).exp()) * f64::from(u)) as f32;
        }
    }
    if let Some(r) = residual {
        for (v, r) in y.iter_mut().zip(r) {
            *v += r;
        }
    }
    y
}

/// One fused matmul problem: host x `[m, k]`, norm weight g, gate and up rows `[n, k]` and
/// the residual y `[m, n]` (seeds `seed + 1 ..= seed + 5`).
struct FusedCase {
    m: usize,
    n: usize,
    k: usize,
    x: Vec<f32>,
    g: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    resid: Vec<f32>,
}

impl FusedCase {
    fn new(seed: u64, m: usize, n: usize, k: usize) -> Self {
        FusedCase {
            m,
            n,
            k,
            x: common::random_vec(seed + 1, m * k, 1.0),
            g: common::random_vec(seed + 2, k, 1.0),
            gate: common::random_vec(seed + 3, n * k, 0.3),
            up: common::random_vec(seed + 4, n * k, 0.3),
            resid: common::random_vec(seed + 5, m * n, 1.0),
        }
    }

    /// The gate|up pair and the gate rows alone, stored in `format`.
    fn weights(&self, ctx: &GpuContext, format: WeightFormat) -> (Weight, Weight) {
        let (n, k) = (self.n, self.k);
        let pair = Weight::zeros_paired(ctx, n, k, format, "gate_up").unwrap();
        pair.write_rows_f32(ctx, 0, &self.gate).unwrap();
        pair.write_rows_f32(ctx, n, &self.up).unwrap();
        let plain = Weight::from_f32(ctx, n, k, &self.gate, format, "gate").unwrap();
        (pair, plain)
    }

    /// y after `kernel` with the fusions (norm, residual, swiglu) over `weights`, y starting
    /// as the residual; x and g as uploaded in `xt`, `gt`.
    fn run(
        &self,
        ctx: &GpuContext,
        (xt, gt): (&Tensor, &Tensor),
        (pair, plain): (&Weight, &Weight),
        kernel: MatmulKernel,
        (norm, residual, swiglu): (bool, bool, bool),
    ) -> Vec<f32> {
        use unmask_gpu::ops::matmul::{Fusion, matmul_fused};
        let yt = Tensor::from_f32(ctx, &[self.m, self.n], &self.resid, "y").unwrap();
        let mut step = StepEncoder::new(ctx, "fused test");
        let fusion = Fusion {
            norm: norm.then_some((gt, 1e-5)),
            residual,
            swiglu,
        };
        let w = if swiglu { pair } else { plain };
        matmul_fused(&mut step, xt, w, &yt, self.m, kernel, fusion).unwrap();
        step.submit().unwrap();
        yt.read_f32(ctx).unwrap()
    }

    /// The oracle of the same fusions, on the gate and up rows as the format stores them.
    fn want(
        &self,
        gate: &[f32],
        up: &[f32],
        (norm, residual, swiglu): (bool, bool, bool),
    ) -> Vec<f32> {
        fused_oracle(
            &self.x,
            self.m,
            self.k,
            norm.then_some(&self.g[..]),
            gate,
            swiglu.then_some(up),
            residual.then_some(&self.resid[..]),
        )
    }
}

#[test]
fn fused_norm_residual_and_swiglu_match_the_oracle() {
    // A binding limit of 16 KiB splits every paired weight over several chunks (gate and
    // up rows of the same columns stay together), and the plain ones too.
    let probe_ctx = common::ctx();
    for limit in [None, Some(16384u64)] {
        let ctx = match limit {
            Some(b) => common::ctx_with_binding_limit(b),
            None => common::ctx(),
        };
        let mut formats = formats(&ctx);
        formats.extend([WeightFormat::Q8, WeightFormat::Q4]);
        for &(m, n, k) in &[
            (3usize, 9usize, 12usize),
            (33, 70, 64),
            (5, 130, 13),
            (70, 40, 36),
            (65, 21, 32),
        ] {
            let case = FusedCase::new(0, m, n, k);
            let xt = Tensor::from_f32(&ctx, &[m, k], &case.x, "x").unwrap();
            let gt = Tensor::from_f32(&ctx, &[k], &case.g, "g").unwrap();
            for &format in &formats {
                // Quantized formats need whole blocks of 32 columns.
                if matches!(format, WeightFormat::Q8 | WeightFormat::Q4) && k % 32 != 0 {
                    continue;
                }
                // The weights as the format stores them, so only the kernel's error is left.
                let stored = |w: &[f32], rows: usize| -> Vec<f32> {
                    let ctx = &probe_ctx;
                    let t = Weight::from_f32(ctx, rows, k, w, format, "probe").unwrap();
                    let out = Tensor::zeros(ctx, DType::F32, &[k, rows], "probe y").unwrap();
                    let eye: Vec<f32> = (0..k * k)
                        .map(|i| if i / k == i % k { 1.0 } else { 0.0 })
                        .collect();
                    let it = Tensor::from_f32(ctx, &[k, k], &eye, "eye").unwrap();
                    let mut step = StepEncoder::new(ctx, "probe");
                    matmul(&mut step, &it, &t, &out, k, MatmulKernel::Naive).unwrap();
                    step.submit().unwrap();
                    let cols = out.read_f32(ctx).unwrap();
                    // out[i][r] = W[r][i]: transpose back to [rows, k].
                    (0..rows * k)
                        .map(|j| cols[(j % k) * rows + j / k])
                        .collect()
                };
                let (gate_s, up_s) = (stored(&case.gate, n), stored(&case.up, n));
                let (pair, plain) = case.weights(&ctx, format);
                if let Some(limit) = limit.filter(|&l| 2 * n as u64 * format.row_bytes(k) > l) {
                    assert!(
                        pair.chunks.len() > 1,
                        "{format:?} {n}x{k}: one chunk under a {limit}-byte binding"
                    );
                }
                let tol = match format {
                    WeightFormat::F32 => 1e-4,
                    _ => 1e-3,
                };
                for kernel in KERNELS {
                    // The new kernels share one decode path for all formats (`w_quad`),
                    // checked for every format by the tests above; here f32 and q4 (the
                    // hoisted scale) meet each fusion, which keeps shader compiles (most of
                    // this file's time on lavapipe) in bounds.
                    let new_kernel = matches!(
                        kernel,
                        MatmulKernel::Gemm
                            | MatmulKernel::GemmF16
                            | MatmulKernel::Narrow
                            | MatmulKernel::Coop
                            | MatmulKernel::CoopSplit
                    );
                    if new_kernel && !matches!(format, WeightFormat::F32 | WeightFormat::Q4) {
                        continue;
                    }
                    let cases: [(&str, bool, bool, bool); 4] = [
                        ("norm", true, false, false),
                        ("residual", false, true, false),
                        ("norm+swiglu", true, false, true),
                        ("swiglu", false, false, true),
                    ];
                    for (what, norm, residual, swiglu) in cases {
                        // Under the binding limit what is new is the paired gate|up chunking;
                        // the new kernels' other fusions over chunks add only compile time.
                        if new_kernel && limit.is_some() && !swiglu {
                            continue;
                        }
                        let flags = (norm, residual, swiglu);
                        let got = case.run(&ctx, (&xt, &gt), (&pair, &plain), kernel, flags);
                        let want = case.want(&gate_s, &up_s, flags);
                        common::assert_close(
                            &format!(
                                "{what} {} {format:?} m{m} n{n} k{k} limit {limit:?}",
                                kernel.name()
                            ),
                            &got,
                            &want,
                            kernel_tolerance(&ctx, kernel, tol),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn fusion_and_weight_pairing_must_agree() {
    use unmask_gpu::ops::matmul::{Fusion, matmul_fused};
    let ctx = common::ctx();
    let x = Tensor::from_f32(&ctx, &[2, 8], &[0.5; 16], "x").unwrap();
    let y = Tensor::zeros(&ctx, DType::F32, &[2, 8], "y").unwrap();
    let plain = Weight::from_f32(&ctx, 8, 8, &[0.1; 64], WeightFormat::F32, "w").unwrap();
    let pair = Weight::zeros_paired(&ctx, 8, 8, WeightFormat::F32, "pair").unwrap();
    let mut step = StepEncoder::new(&ctx, "bad fusion");
    let swiglu = Fusion {
        swiglu: true,
        ..Fusion::default()
    };
    let e = matmul_fused(&mut step, &x, &plain, &y, 2, MatmulKernel::Tiled, swiglu).unwrap_err();
    assert!(e.to_string().contains("paired"), "{e}");
    let e = matmul(&mut step, &x, &pair, &y, 2, MatmulKernel::Tiled).unwrap_err();
    assert!(e.to_string().contains("paired"), "{e}");
    let g = Tensor::from_f32(&ctx, &[7], &[1.0; 7], "g").unwrap();
    let norm = Fusion {
        norm: Some((&g, 1e-5)),
        ..Fusion::default()
    };
    let e = matmul_fused(&mut step, &x, &plain, &y, 2, MatmulKernel::Tiled, norm).unwrap_err();
    assert!(e.to_string().contains("norm weight of 8"), "{e}");
}

/// The weights after a round trip through the quantizer: what the kernels should see.
fn dequantized(format: QuantFormat, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut codes = vec![0u8; rows * format.row_code_bytes(cols)];
    let mut scales = vec![0u8; rows * quant::row_scale_bytes(cols)];
    format
        .quantize_rows(w, cols, &mut codes, &mut scales)
        .expect("quantize");
    format.dequantize_rows(&codes, &scales, rows, cols)
}

#[test]
fn quantized_weights_with_hoisted_scales() {
    // Block magnitudes differ from block to block, so a scale kept for the wrong block shows.
    // K = 96 has an odd number of blocks per row (a row's scales start mid-word), 257 ends in a
    // partial block; 16 KiB bindings split the last weight over several chunks.
    print_f16_path(&common::ctx());
    let cases = [
        (None, (1usize, 40usize, 96usize)),
        (None, (63, 33, 257)),
        (None, (65, 70, 64)),
        (Some(16384u64), (9, 300, 130)),
    ];
    for (si, &(limit, (m, n, k))) in cases.iter().enumerate() {
        let ctx = match limit {
            Some(b) => common::ctx_with_binding_limit(b),
            None => common::ctx(),
        };
        let x = common::random_vec(300 + si as u64, m * k, 1.0);
        let mut wd = common::random_vec(400 + si as u64, n * k, 0.5);
        for (i, v) in wd.iter_mut().enumerate() {
            *v *= 1.0 + ((i / 32) % 5) as f32;
        }
        for (format, q) in [
            (WeightFormat::Q8, QuantFormat::Q8),
            (WeightFormat::Q4, QuantFormat::Q4),
        ] {
            let want = matmul_xwt(&x, &dequantized(q, &wd, n, k), m, n, k);
            let w = Weight::from_f32(&ctx, n, k, &wd, format, "w").expect("weight");
            if limit.is_some() {
                assert!(w.chunks.len() > 1, "{}: one chunk", format.name());
            }
            for kernel in KERNELS {
                let got = run(&ctx, &x, &w, m, 1, kernel);
                common::assert_close(
                    &format!(
                        "{} {} m={m} n={n} k={k} over {} chunks",
                        kernel.name(),
                        format.name(),
                        w.chunks.len()
                    ),
                    &got,
                    &want,
                    kernel_tolerance(&ctx, kernel, 1e-4),
                );
            }
        }
    }
}

#[test]
fn gemm_fits_the_browser_workgroup_memory() {
    // A device that allows the browser's 16 KiB must get 8-deep f32 tiles (16-deep ones need
    // 32 KiB, which a browser refuses to build) and may keep 16-deep f16 ones.
    let native = common::ctx();
    eprintln!(
        "[path] this device: {} bytes of workgroup memory, gemm k-tiles {} deep, gemm-f16 {}",
        native.limits.max_compute_workgroup_storage_size,
        gemm_k_depth(&native, MatmulKernel::Gemm),
        gemm_k_depth(&native, MatmulKernel::GemmF16)
    );
    let ctx = common::ctx_with_workgroup_storage(16 * 1024);
    assert!(ctx.limits.max_compute_workgroup_storage_size <= 16 * 1024);
    assert!(gemm_bk16_bytes(false) > 16 * 1024);
    assert_eq!(gemm_k_depth(&ctx, MatmulKernel::Gemm), 8);
    assert_eq!(gemm_k_depth(&ctx, MatmulKernel::GemmF16), 16);
    for (si, &(m, n, k)) in [(65usize, 131usize, 33usize), (130, 20, 64)]
        .iter()
        .enumerate()
    {
        let x = common::random_vec(500 + si as u64, m * k, 1.0);
        let wd = common::random_vec(600 + si as u64, n * k, 0.5);
        let want = matmul_xwt(&x, &wd, m, n, k);
        let w = Weight::from_f32(&ctx, n, k, &wd, WeightFormat::F32, "w").expect("weight");
        for kernel in [MatmulKernel::Gemm, MatmulKernel::GemmF16] {
            let got = run(&ctx, &x, &w, m, 1, kernel);
            common::assert_close(
                &format!(
                    "16 KiB: {} ({}-deep) m={m} n={n} k={k}",
                    kernel.name(),
                    gemm_k_depth(&ctx, kernel)
                ),
                &got,
                &want,
                kernel_tolerance(&ctx, kernel, 1e-4),
            );
        }
    }
}

/// `coop-split` sums K in slices over several workgroups, then adds the slices and applies
/// the epilogue in a second pass. Shapes of few rows and long K split (one slice would leave
/// a large GPU idle); the uneven last slice, every fusion, quantized weights and chunked
/// weights (each chunk has its own scratch layout) against the oracle. Without cooperative
/// matrices it runs `narrow`, and says so.
#[test]
fn coop_split_sums_slices_of_k_with_every_fusion() {
    use unmask_gpu::ops::matmul::split_k_tiles;
    let ctx = common::ctx();
    let planned = MatmulKernel::CoopSplit.plan(&ctx, 1, WeightFormat::F32).0;
    let shape = coop_shape(&ctx);
    eprintln!(
        "[path] coop-split runs {}",
        match shape {
            Some(s) => format!("cooperative matrices ({0}x{0} fragments)", s.fragment),
            None => "narrow (no cooperative matrices)".to_string(),
        }
    );
    assert_eq!(
        planned,
        if shape.is_some() {
            MatmulKernel::CoopSplit
        } else {
            MatmulKernel::Narrow
        }
    );
    let chunked = common::ctx_with_binding_limit(16384);
    for (m, n, k) in [
        (1usize, 40usize, 320usize),
        (5, 70, 1000),
        (33, 130, 544),
        (63, 37, 257),
    ] {
        let case = FusedCase::new(30, m, n, k);
        if let Some(s) = shape {
            // The split this shape gets: several slices, the last one shorter where K does
            // not divide evenly.
            let (tm, tn) = s.tile_for_rows(m as u32);
            let tiles = (m as u32).div_ceil(tm) * (n as u32).div_ceil(tn);
            let k_tiles = (k as u32).div_ceil(s.k_depth);
            let per = split_k_tiles(tiles, k_tiles, u32::MAX);
            eprintln!(
                "[split] m={m} n={n} k={k}: {} slices of {per} k-tiles ({k_tiles} in all)",
                k_tiles.div_ceil(per)
            );
            assert!(k_tiles.div_ceil(per) > 1, "m={m} n={n} k={k} is not split");
        }
        // Chunked weights where x itself fits the 16 KiB binding.
        // f16 weights reach the tiles without a conversion; the others are decoded.
        let mut all = formats(&ctx);
        all.extend([WeightFormat::Q8, WeightFormat::Q4]);
        let mut runs = vec![(&ctx, &all[..])];
        if m * k * 4 <= 16384 {
            runs.push((&chunked, &[WeightFormat::F32][..]));
        }
        for (ctx, formats) in runs {
            let xt = Tensor::from_f32(ctx, &[m, k], &case.x, "x").unwrap();
            let gt = Tensor::from_f32(ctx, &[k], &case.g, "g").unwrap();
            for &format in formats {
                if format.quant().is_some() && k % 32 != 0 {
                    continue;
                }
                let (pair, plain) = case.weights(ctx, format);
                // Quantized weights are compared with the oracle on their dequantized values.
                let (gate_s, up_s) = match format.quant() {
                    Some(q) => (
                        dequantized(q, &case.gate, n, k),
                        dequantized(q, &case.up, n, k),
                    ),
                    None => (case.gate.clone(), case.up.clone()),
                };
                for (norm, residual, swiglu) in [
                    (false, false, false),
                    (true, false, false),
                    (false, true, false),
                    (true, true, true),
                    (false, false, true),
                ] {
                    let flags = (norm, residual, swiglu);
                    let got = case.run(
                        ctx,
                        (&xt, &gt),
                        (&pair, &plain),
                        MatmulKernel::CoopSplit,
                        flags,
                    );
                    let want = case.want(&gate_s, &up_s, flags);
                    common::assert_close(
                        &format!(
                            "coop-split {format:?} norm={norm} residual={residual} \
                             swiglu={swiglu} m{m} n{n} k{k} chunks {}",
                            if swiglu { &pair } else { &plain }.chunks.len()
                        ),
                        &got,
                        &want,
                        kernel_tolerance(
                            ctx,
                            MatmulKernel::CoopSplit,
                            if format.quant().is_some() {
                                1e-3
                            } else {
                                tolerance(format).max(1e-3)
                            },
                        ),
                    );
                }
            }
        }
    }
}
