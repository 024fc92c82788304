//! Measured kernel choice on a device that measures (`--tune always` here: lavapipe keeps
//! its fixed choice by default): a new shape class is timed once, its winner kept in the
//! tuning file and read back by the next context, and the result is right whatever wins.

use crate::common;

use std::path::Path;

use common::{assert_close, random_vec};
use unmask_core::oracle::matmul::matmul_xwt;
use unmask_gpu::ops::matmul::{Fusion, MatmulKernel, matmul, tune_class};
use unmask_gpu::ops::{KernelOptions, Kernels};
use unmask_gpu::tune::TunePolicy;
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

/// A context and a kernel choice that measures by `policy`, keeping winners in `file`.
fn context(policy: TunePolicy, file: &Path) -> (std::sync::Arc<GpuContext>, Kernels) {
    let ctx = GpuContext::new(&common::options()).expect("GPU adapter");
    let options = KernelOptions {
        tune: policy,
        tune_file: Some(file.to_path_buf()),
        ..KernelOptions::default()
    };
    let kernels = Kernels::new(&ctx, &options);
    (ctx, kernels)
}

/// y = x Wᵀ through `MatmulKernel::Auto` on `ctx`, measured by `kernels`' tuner.
fn run(
    (ctx, kernels): &(std::sync::Arc<GpuContext>, Kernels),
    x: &[f32],
    w: &[f32],
    (m, n, k): (usize, usize, usize),
) -> Vec<f32> {
    let xt = Tensor::from_f32(ctx, &[m, k], x, "x").unwrap();
    let wt = Weight::from_f32(ctx, n, k, w, WeightFormat::F32, "w").unwrap();
    let y = Tensor::zeros(ctx, DType::F32, &[m, n], "y").unwrap();
    let mut step = StepEncoder::new(ctx, "tuned matmul");
    matmul(&mut step, &xt, &wt, &y, m, kernels).unwrap();
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

    let tuned = context(TunePolicy::Always, &file);
    let (ctx, kernels) = (&tuned.0, &tuned.1);
    assert!(kernels.tuner.enabled());
    let tuned_out = run(&tuned, &x, &w, (m, n, k));
    assert_eq!(kernels.tuner.measurements(), 1, "the new class was timed");
    let class = tune_class(WeightFormat::F32, &Fusion::default(), m, n, k);
    let entries = kernels.tuner.entries();
    let (got_class, measured) = &entries[0];
    assert_eq!(got_class, &class);
    let names: Vec<&str> = MatmulKernel::candidates(ctx, WeightFormat::F32)
        .iter()
        .map(|k| k.name())
        .collect();
    eprintln!("[path] measured candidates here: {names:?}");
    // Integer dot products are a candidate for quantized weights only.
    assert!(!names.contains(&MatmulKernel::NarrowDot.name()));
    for format in [WeightFormat::Q8, WeightFormat::Q4] {
        assert!(MatmulKernel::candidates(ctx, format).contains(&MatmulKernel::NarrowDot));
    }
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
    // An f32 winner is held to 1e-5; on a loaded machine a kernel with f16 inputs (tensor
    // cores) can win the timing, and is held to its own tolerance.
    let f16_inputs = [
        MatmulKernel::Coop,
        MatmulKernel::CoopSplit,
        MatmulKernel::GemmF16,
    ];
    let tol = f16_inputs
        .into_iter()
        .find(|k| k.name() == measured.winner)
        .map_or(1e-5, |k| f64::from(k.tolerance()));
    assert_close("tuned matmul", &tuned_out, &want, tol);

    // The same class again (M 7 rounds up to 8, as 5 does): no new measurement.
    run(&tuned, &random_vec(3, 7 * k, 1.0), &w, (7, n, k));
    assert_eq!(kernels.tuner.measurements(), 1);

    // A second process on the device reads the winner from the file.
    let again = context(TunePolicy::Always, &file);
    assert_eq!(
        again.1.tuner.winner(&class).as_deref(),
        Some(measured.winner.as_str())
    );
    assert_close("remembered", &run(&again, &x, &w, (m, n, k)), &want, tol);
    assert_eq!(again.1.tuner.measurements(), 0);

    // Off: the fixed choice, nothing measured, nothing read.
    let off = context(TunePolicy::Off, &file);
    assert_eq!(off.1.tuner.winner(&class), None);
    run(&off, &x, &w, (m, n, k));
    assert_eq!(off.1.tuner.measurements(), 0);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains(&class), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A quantized weight's class also measures `narrow-dot`, whose output passes the check
/// against `tiled` (x quantization stays inside its tolerance); a float class does not.
#[test]
fn quantized_classes_measure_the_integer_dot_kernel() {
    let dir = std::env::temp_dir().join(format!("unmask-tune-dot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (ctx, kernels) = context(TunePolicy::Always, &dir.join("kernels.json"));
    let (m, n, k) = (5, 40, 96);
    let x = random_vec(21, m * k, 1.0);
    let w = random_vec(22, n * k, 0.5);
    let xt = Tensor::from_f32(&ctx, &[m, k], &x, "x").unwrap();
    let y = Tensor::zeros(&ctx, DType::F32, &[m, n], "y").unwrap();
    for format in [WeightFormat::Q8, WeightFormat::Q4] {
        let wt = Weight::from_f32(&ctx, n, k, &w, format, "w").unwrap();
        let mut step = StepEncoder::new(&ctx, "tuned quantized matmul");
        matmul(&mut step, &xt, &wt, &y, m, &kernels).unwrap();
        step.submit().unwrap();
        let class = tune_class(format, &Fusion::default(), m, n, k);
        let entries = kernels.tuner.entries();
        let (_, measured) = entries.iter().find(|(c, _)| *c == class).unwrap();
        eprintln!("[tune] {class}: {measured:?}");
        let dot = measured
            .times
            .iter()
            .find(|(name, _)| name == MatmulKernel::NarrowDot.name())
            .expect("narrow-dot is measured for quantized weights");
        assert!(dot.1.is_finite(), "narrow-dot was rejected: {measured:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Attention's `Auto` with a split scratch measures register, wide and wide-split once per
/// shape class, and the output is right whatever wins.
#[test]
fn attention_shape_classes_are_measured_too() {
    use unmask_core::oracle::attention::attention as oracle;
    use unmask_gpu::ops::attention::{
        self as attn, AttentionKernel, AttentionOptions, AttentionShape, KvSegment,
    };
    let dir = std::env::temp_dir().join(format!("unmask-tune-attn-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (ctx, kernels) = context(TunePolicy::Always, &dir.join("kernels.json"));
    // The tensor-core kernels are candidates at a head dim they serve (8 fragments here).
    let coop_hd = [64, 128]
        .into_iter()
        .find(|&hd| attn::coop_attention(&ctx, hd).is_some());
    let hd = coop_hd.unwrap_or(32);
    let shape = AttentionShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: hd,
    };
    let (m, len_a, len_b) = (6, 40, 9);
    let (width, kv_width) = (4 * hd, 2 * hd);
    let qd = random_vec(11, m * width, 1.0);
    let (ka, va) = (
        random_vec(12, len_a * kv_width, 1.0),
        random_vec(13, len_a * kv_width, 1.0),
    );
    let (kb, vb) = (
        random_vec(14, len_b * kv_width, 1.0),
        random_vec(15, len_b * kv_width, 1.0),
    );
    let up = |d: &[f32], l| Tensor::from_f32(&ctx, &[d.len()], d, l).unwrap();
    let (q, kat, vat, kbt, vbt) = (
        up(&qd, "q"),
        up(&ka, "ka"),
        up(&va, "va"),
        up(&kb, "kb"),
        up(&vb, "vb"),
    );
    let out = Tensor::zeros(&ctx, DType::F32, &[m, width], "out").unwrap();
    let floats = attn::split_scratch_floats(&ctx, shape, m, 64);
    let scratch = Tensor::zeros(&ctx, DType::F32, &[floats], "split scratch").unwrap();
    let options = AttentionOptions {
        kernel: AttentionKernel::Auto,
        tuner: Some(&kernels.tuner),
        scratch: Some(&scratch),
        ..AttentionOptions::default()
    };
    let run = || {
        let mut step = StepEncoder::new(&ctx, "tuned attention");
        let seg_a = Some(KvSegment::first(&kat, &vat, len_a));
        let plan = attn::attention_with(
            &mut step,
            &q,
            width,
            0,
            0..m,
            seg_a,
            KvSegment::first(&kbt, &vbt, len_b),
            &out,
            shape,
            &options,
        )
        .unwrap();
        step.submit().unwrap();
        (plan, out.read_f32(&ctx).unwrap())
    };
    let want = oracle(
        &qd,
        width,
        0,
        m,
        Some((&ka, &va, len_a)),
        (&kb, &vb, len_b),
        4,
        2,
        hd,
    );
    let (plan, got) = run();
    // The tensor-core kernels round to f16 (the f16 K/V budget) and may win.
    let tol = if plan.kernel.name().starts_with("coop") {
        5e-3
    } else {
        1e-4
    };
    assert_close("tuned attention", &got, &want, tol);
    assert_eq!(kernels.tuner.measurements(), 1);
    let (class, measured) = &kernels.tuner.entries()[0];
    assert!(
        class.starts_with("attention@") && class.ends_with("/split"),
        "{class}"
    );
    let names: Vec<&str> = measured.times.iter().map(|(n, _)| n.as_str()).collect();
    let mut expected = vec!["register", "wide", "wide-split"];
    if coop_hd.is_some() {
        expected.extend(["coop", "coop-split"]);
    }
    assert_eq!(names, expected);
    // Every candidate agreed with the reference kernel (one that disagrees is timed NaN).
    assert!(
        measured.times.iter().all(|(_, ms)| ms.is_finite()),
        "{measured:?}"
    );
    assert_eq!(plan.kernel.name(), measured.winner, "the winner ran");
    eprintln!("[tune] {class}: {measured:?}");
    let (again, _) = run();
    assert_eq!(again.kernel, plan.kernel);
    assert_eq!(kernels.tuner.measurements(), 1, "measured once");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A candidate whose output disagrees with the reference is left out of the measurement and
/// never wins, however fast it is; an erroring one likewise.
#[test]
fn candidates_that_compute_wrong_outputs_never_win() {
    use unmask_gpu::tune::{outputs_agree, time_verified_candidates};
    let dir = std::env::temp_dir().join(format!("unmask-tune-verify-{}", std::process::id()));
    let (ctx, kernels) = context(TunePolicy::Always, &dir.join("kernels.json"));
    let times = time_verified_candidates(
        &ctx,
        &["right", "wrong", "failing"],
        |name| match name {
            "right" => Ok(true),
            "wrong" => Ok(false),
            _ => Err(unmask_gpu::GpuError::Validation {
                context: "test".into(),
                message: "no such kernel".into(),
            }),
        },
        |_step, _name| Ok(()),
    )
    .unwrap();
    let by_name = |n: &str| times.iter().find(|(name, _)| name == n).unwrap().1;
    assert!(by_name("right").is_finite(), "{times:?}");
    assert!(by_name("wrong").is_nan(), "{times:?}");
    assert!(by_name("failing").is_nan(), "{times:?}");
    assert_eq!(kernels.tuner.record("c", times).as_deref(), Some("right"));

    let reference = [1.0f32, -2.0, 4.0];
    assert!(outputs_agree(&reference, &[1.01, -2.0, 4.0], 1e-2));
    assert!(!outputs_agree(&reference, &[1.05, -2.0, 4.0], 1e-2));
    assert!(!outputs_agree(&reference, &[1.0, -2.0], 1e-2));
    assert!(!outputs_agree(&reference, &[f32::NAN, -2.0, 4.0], 1e-2));
    let _ = std::fs::remove_dir_all(&dir);
}
