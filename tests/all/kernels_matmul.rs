//! Matmul kernels (`y = x · Wᵀ`) against the f64 CPU oracle: every kernel, every weight
//! format the device has, shapes that do and do not divide the tiles, chunked weights.
//! `gemm-f16` runs f16 arithmetic where the device has shader-f16 and `gemm` otherwise;
//! `coop` runs cooperative matrices where the device has them and `gemm` otherwise; each
//! test prints which.

use crate::common;
use crate::common::matmul::*;

use unmask_core::oracle::matmul::matmul_xwt;
use unmask_core::quant::QuantFormat;
use unmask_gpu::ops::matmul::{MatmulKernel, gemm_bk16_bytes, gemm_k_depth, matmul};
use unmask_gpu::{DType, GpuError, StepEncoder, Tensor, Weight, WeightFormat};

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
