//! Measured kernel choice on a device that measures (`--tune always` here: lavapipe keeps
//! its fixed choice by default): a new shape class is timed once, its winner kept in the
//! tuning file and read back by the next context, and the result is right whatever wins.

use crate::common;

use std::path::Path;

use common::{assert_close, random_vec};
use unmask_core::oracle::matmul::matmul_xwt;
use unmask_gpu::ops::matmul::{Fusion, MatmulKernel, matmul, tune_class};
use unmask_gpu::tune::TunePolicy;
use unmask_gpu::{ContextOptions, DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

fn context(policy: TunePolicy, file: &Path) -> std::sync::Arc<GpuContext> {
    GpuContext::new(&ContextOptions {
        tune: policy,
        tune_file: Some(file.to_path_buf()),
        ..common::options()
    })
    .expect("GPU adapter")
}

/// y = x Wᵀ through `MatmulKernel::Auto` on `ctx`.
fn run(ctx: &GpuContext, x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let xt = Tensor::from_f32(ctx, &[m, k], x, "x").unwrap();
    let wt = Weight::from_f32(ctx, n, k, w, WeightFormat::F32, "w").unwrap();
    let y = Tensor::zeros(ctx, DType::F32, &[m, n], "y").unwrap();
    let mut step = StepEncoder::new(ctx, "tuned matmul");
    matmul(&mut step, &xt, &wt, &y, m, MatmulKernel::Auto).unwrap();
    step.submit().unwrap();
    y.read_f32(ctx).unwrap()
}

#[test]
fn a_new_shape_class_is_measured_once_and_remembered() {
    let dir = std::env::temp_dir().join(format!("unmask-tune-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let file = dir.join("kernels.json");
    let (m, n, k) = (5, 72, 40);
    let x = random_vec(1, m * k, 1.0);
    let w = random_vec(2, n * k, 0.5);
    let want = matmul_xwt(&x, &w, m, n, k);

    let ctx = context(TunePolicy::Always, &file);
    assert!(ctx.tuner.enabled());
    assert_close("tuned matmul", &run(&ctx, &x, &w, m, n, k), &want, 1e-5);
    assert_eq!(ctx.tuner.measurements(), 1, "the new class was timed");
    let class = tune_class(WeightFormat::F32, &Fusion::default(), m, n, k);
    let entries = ctx.tuner.entries();
    let (got_class, measured) = &entries[0];
    assert_eq!(got_class, &class);
    let names: Vec<&str> = MatmulKernel::CANDIDATES.iter().map(|k| k.name()).collect();
    assert_eq!(
        measured
            .times
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        names,
        "every candidate is timed"
    );
    assert!(measured.times.iter().all(|(_, ms)| *ms > 0.0));
    assert!(names.contains(&measured.winner.as_str()));
    eprintln!("[tune] {class}: {measured:?}");

    // The same class again (M 7 rounds up to 8, as 5 does): no new measurement.
    run(&ctx, &random_vec(3, 7 * k, 1.0), &w, 7, n, k);
    assert_eq!(ctx.tuner.measurements(), 1);

    // A second process on the device reads the winner from the file.
    let again = context(TunePolicy::Always, &file);
    assert_eq!(
        again.tuner.winner(&class).as_deref(),
        Some(measured.winner.as_str())
    );
    assert_close("remembered", &run(&again, &x, &w, m, n, k), &want, 1e-5);
    assert_eq!(again.tuner.measurements(), 0);

    // Off: the fixed choice, nothing measured, nothing read.
    let off = context(TunePolicy::Off, &file);
    assert_eq!(off.tuner.winner(&class), None);
    run(&off, &x, &w, m, n, k);
    assert_eq!(off.tuner.measurements(), 0);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains(&class), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
