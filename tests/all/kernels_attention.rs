//! Every attention kernel variant against the f64 oracle: register, wide, wide split over
//! keys at several slice counts, and the tensor-core kernels (`coop`, `coop-split`), at odd
//! shapes; f16 K/V (packed, and native where the device has shader-f16); the wide kernel's
//! tiles for the browser's 16 KiB of workgroup memory; the plan `Auto` makes on this device;
//! and the calls a variant cannot run.

use crate::common;

use common::attention::{
    Case, Data, F16_TOL, Run, TOL, describe, expect_shape_error, f32_variants, run_with,
};
use common::{assert_close, ctx, relative_error};
use unmask_gpu::ops::attention::{
    self as attn, AttentionKernel, AttentionOptions, AttentionShape, KvRead, KvSegment,
};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor};

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
/// K/V, at the head dims it serves (8, 16 and 32 fragments) and at one it does not (runs `wide`). Its
/// inputs are rounded to f16: the f16 budget against the oracle on the unrounded data.
/// Without cooperative matrices they run `wide` and `wide-split`, and say so.
#[test]
fn coop_attention_matches_the_oracle() {
    let ctx = ctx();
    let fragment = attn::coop_attention(&ctx, 64)
        .or_else(|| attn::coop_attention(&ctx, 128))
        .map(|c| c.fragment as usize);
    let served = fragment.map(|f| 8 * f);
    eprintln!(
        "[path] coop attention runs {}",
        match fragment {
            Some(f) => {
                let also = |hd: usize| match attn::coop_attention(&ctx, hd) {
                    Some(_) => format!("also at {hd}"),
                    None => format!("not at {hd} (over the workgroup memory)"),
                };
                format!(
                    "cooperative matrices at head dim {}, {}, {}",
                    8 * f,
                    also(16 * f),
                    also(32 * f)
                )
            }
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
    // Heads of 8 fragments, of 16 (its 2 x 4 accumulators per subgroup) on fewer cases, and
    // of 32 (tiles of one fragment, scores summed over 4 planes, 1 x 8 accumulators) on
    // fewer still, one of them with keys across many tiles.
    let wide = cases
        .iter()
        .step_by(2)
        .map(|&(h, kv, m, a, b)| (2 * hd, h, kv, m, a, b));
    let widest = cases
        .iter()
        .skip(1)
        .step_by(2)
        .map(|&(h, kv, m, a, b)| (4 * hd, h, kv, m, a, b));
    let all = cases.iter().map(|&(h, kv, m, a, b)| (hd, h, kv, m, a, b));
    for (hd, heads, kv_heads, m, len_a, len_b) in all.chain(wide).chain(widest) {
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
        let served = attn::coop_attention(&ctx, hd).is_some();
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
            let expected = match (run.kernel, served) {
                (AttentionKernel::Coop, true) => AttentionKernel::Coop,
                (AttentionKernel::Coop, false) => AttentionKernel::Wide,
                (_, true) => AttentionKernel::CoopSplit,
                (_, false) => AttentionKernel::WideSplit,
            };
            assert_eq!(plan.kernel, expected, "{}", c.label());
            let tol = if served || run.kv == DType::F16 {
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
