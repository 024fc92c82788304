//! Matmul kernels (`y = x · Wᵀ`) against the f64 CPU oracle: every kernel, every weight
//! format the device has, shapes that do and do not divide the tiles, chunked weights.

use crate::common;

use unmask_core::oracle::matmul::matmul_xwt;
use unmask_gpu::ops::matmul::{MatmulKernel, matmul};
use unmask_gpu::{DType, GpuContext, GpuError, StepEncoder, Tensor, Weight, WeightFormat};

const KERNELS: [MatmulKernel; 4] = [
    MatmulKernel::Naive,
    MatmulKernel::Tiled,
    MatmulKernel::TiledShared,
    MatmulKernel::Auto,
];

/// (M, N, K): tiles are 16 x 16 (naive), 32 x 32 (tiled), 64 x 64 x 16 (shared); K % 4 takes
/// every value so both the vec4-x and the scalar-x paths run, with every tail length.
const SHAPES: [(usize, usize, usize); 8] = [
    (1, 1, 1),
    (5, 7, 13),
    (3, 9, 6),
    (2, 33, 7),
    (33, 65, 64),
    (64, 128, 96),
    (17, 300, 130),
    (70, 40, 36),
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
    for &format in &formats {
        for m in [1, 256] {
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
                    tolerance(format),
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
                2e-3,
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
                tolerance(format),
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
            1e-4,
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
