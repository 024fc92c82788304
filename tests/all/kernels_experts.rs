//! DiffusionGemma's expert FFN (`ops::moe::moe_experts`) and activations (`ops::activation`)
//! against the f64 oracle (`unmask_core::oracle::moe`): routing by `moe_route` on the GPU,
//! then the grouped experts, in every weight format, at tiny shapes (an expert every token
//! chose, experts no token chose, one row) and at 128 experts top 8; weights split over
//! chunks of whole experts; bit-identical reruns; the plan's lists; refused shapes.

use std::time::Instant;

use half::f16;

use crate::common::{assert_close, ctx, ctx_with_binding_limit, random_vec, relative_error};
use unmask_core::oracle::moe::{self as oracle, ExpertDims};
use unmask_core::quant;
use unmask_gpu::ops::activation::{gelu_tanh_gate, scale_in_place, softcap};
use unmask_gpu::ops::moe::{
    ExpertScratch, ExpertShape, ExpertWeights, Route, TILE_ROWS, moe_experts, moe_route,
};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

/// The kernels' own error against the oracle on the weights as stored: f32 sums over D and
/// I terms in another order, through gelu and a second projection (measured at most 4e-7).
const TOL_STORED: f64 = 2e-5;

/// Error against the oracle on the original f32 weights, relative to the largest output: the
/// storage format's rounding. f16 keeps 11 bits (each weight within 2^-12 relative); q8 moves a
/// weight by up to 1/254 of its block's largest, q4 by up to 1/16, about uniformly, so an
/// output moves by roughly that fraction over sqrt(3) of its typical size through each of the
/// two projections (measured at most: f16 5.2e-4, q8 8e-3, q4 1.6e-1 over the shapes here).
fn format_tolerance(format: WeightFormat) -> f64 {
    match format {
        WeightFormat::F32 => TOL_STORED,
        WeightFormat::F16Packed | WeightFormat::F16Native => 2e-3,
        WeightFormat::Q8 => 3e-2,
        WeightFormat::Q4 => 3e-1,
    }
}

/// What a kernel reading `w` in `format` sees: the values after the round trip to storage.
fn stored(format: WeightFormat, w: &[f32], cols: usize) -> Vec<f32> {
    match format.quant() {
        Some(q) => {
            let rows = w.len() / cols;
            let mut codes = vec![0u8; rows * q.row_code_bytes(cols)];
            let mut scales = vec![0u8; rows * quant::row_scale_bytes(cols)];
            q.quantize_rows(w, cols, &mut codes, &mut scales)
                .expect("quantize");
            q.dequantize_rows(&codes, &scales, rows, cols)
        }
        None if format == WeightFormat::F32 => w.to_vec(),
        None => w.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
    }
}

/// Router logits where expert `always` wins every row by far and `never` loses every row.
fn logits(seed: u64, rows: usize, experts: usize, always: usize, never: usize) -> Vec<f32> {
    let mut l = random_vec(seed, rows * experts, 2.0);
    for row in l.chunks_mut(experts) {
        row[always] = 20.0;
        row[never] = -20.0;
    }
    l
}

struct Case {
    shape: ExpertShape,
    y: Vec<f32>,
    logits: Vec<f32>,
    scale: Vec<f32>,
    gate_up: Vec<f32>,
    down: Vec<f32>,
}

impl Case {
    fn new(seed: u64, shape: ExpertShape) -> Self {
        let ExpertShape {
            rows,
            experts: e,
            hidden: d,
            inter: i,
            ..
        } = shape;
        // Block magnitudes that vary, so quantized scales differ block to block.
        let mut gate_up = random_vec(seed + 3, e * 2 * i * d, 0.3);
        for (n, v) in gate_up.iter_mut().enumerate() {
            *v *= 1.0 + ((n / 32) % 3) as f32;
        }
        Self {
            shape,
            y: random_vec(seed, rows * d, 1.0),
            logits: logits(seed + 1, rows, e, 3 % e, 5 % e),
            scale: random_vec(seed + 2, e, 0.5)
                .iter()
                .map(|s| 1.0 + s)
                .collect(),
            gate_up,
            down: random_vec(seed + 4, e * d * i, 0.3),
        }
    }
}

struct Outcome {
    out: Vec<f32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
    plan: Vec<u32>,
    order: Vec<u32>,
}

/// Routes and runs the experts in one step; reads back the output, the routing and the plan.
fn run(ctx: &GpuContext, case: &Case, gate_up: &Weight, down: &Weight) -> Outcome {
    let s = case.shape;
    let (rows, e, k, d) = (s.rows, s.experts, s.top_k, s.hidden);
    let y = Tensor::from_f32(ctx, &[rows, d], &case.y, "y").unwrap();
    let lt = Tensor::from_f32(ctx, &[rows, e], &case.logits, "logits").unwrap();
    let st = Tensor::from_f32(ctx, &[e], &case.scale, "scale").unwrap();
    let ids = Tensor::zeros(ctx, DType::U32, &[rows, k], "ids").unwrap();
    let w = Tensor::zeros(ctx, DType::F32, &[rows, k], "weights").unwrap();
    let out = Tensor::from_f32(ctx, &[rows, d], &vec![-7.25; rows * d], "out").unwrap();
    let scratch = ExpertScratch::new(ctx, s).unwrap();
    let mut step = StepEncoder::new(ctx, "moe experts test");
    moe_route(&mut step, &lt, &st, &ids, &w, rows, k).unwrap();
    let route = Route {
        ids: &ids,
        weights: &w,
    };
    let experts = ExpertWeights { gate_up, down };
    moe_experts(&mut step, &y, route, experts, &out, &scratch, s).unwrap();
    step.submit().unwrap();
    Outcome {
        out: out.read_f32(ctx).unwrap(),
        ids: ids.read_u32(ctx).unwrap(),
        weights: w.read_f32(ctx).unwrap(),
        plan: scratch.plan.read_u32(ctx).unwrap(),
        order: scratch.order.read_u32(ctx).unwrap(),
    }
}

fn upload(ctx: &GpuContext, case: &Case, format: WeightFormat) -> (Weight, Weight) {
    let ExpertShape {
        experts: e,
        hidden: d,
        inter: i,
        ..
    } = case.shape;
    let gate_up = Weight::zeros_stacked(ctx, e, 2 * i, d, format, "gate_up").unwrap();
    gate_up.write_rows_f32(ctx, 0, &case.gate_up).unwrap();
    let down = Weight::zeros_stacked(ctx, e, d, i, format, "down").unwrap();
    down.write_rows_f32(ctx, 0, &case.down).unwrap();
    (gate_up, down)
}

fn dims(s: ExpertShape) -> ExpertDims {
    ExpertDims {
        hidden: s.hidden,
        inter: s.inter,
        top_k: s.top_k,
    }
}

/// The plan's lists against the routing: each expert's list holds exactly the (row, slot)
/// pairs that chose it, in ascending order, and its tiles cover it.
fn check_plan(s: ExpertShape, o: &Outcome) {
    let e = s.experts;
    let a = s.assignments();
    assert_eq!(o.plan[e] as usize, a, "all assignments listed");
    for x in 0..e {
        let (lo, hi) = (o.plan[x] as usize, o.plan[x + 1] as usize);
        let want: Vec<u32> = (0..a as u32)
            .filter(|&j| o.ids[j as usize] == x as u32)
            .collect();
        assert_eq!(&o.order[lo..hi], &want[..], "list of expert {x}");
        let tiles = o.plan[e + 1 + x + 1] - o.plan[e + 1 + x];
        assert_eq!(
            tiles as usize,
            want.len().div_ceil(TILE_ROWS),
            "tiles of expert {x}"
        );
    }
}

fn check_case(ctx: &GpuContext, name: &str, case: &Case, formats: &[WeightFormat]) {
    let s = case.shape;
    for &format in formats {
        let started = Instant::now();
        let (gate_up, down) = upload(ctx, case, format);
        let o = run(ctx, case, &gate_up, &down);
        check_plan(s, &o);
        let what = format!("{name} {}", format.name());
        // The oracle on the routing the GPU chose (checked against its own oracle in
        // kernels_moe) and the weights as stored.
        let gu = stored(format, &case.gate_up, s.hidden);
        let dn = stored(format, &case.down, s.inter);
        let want = oracle::moe_experts(&case.y, &o.ids, &o.weights, &gu, &dn, dims(s));
        assert_close(
            &format!("{what} (stored weights)"),
            &o.out,
            &want,
            TOL_STORED,
        );
        let exact = oracle::moe_experts(
            &case.y,
            &o.ids,
            &o.weights,
            &case.gate_up,
            &case.down,
            dims(s),
        );
        assert_close(
            &format!("{what} (f32 weights)"),
            &o.out,
            &exact,
            format_tolerance(format),
        );
        eprintln!("[time] {what}: {:.2}s", started.elapsed().as_secs_f64());
    }
}

fn tiny(rows: usize) -> ExpertShape {
    ExpertShape {
        rows,
        experts: 8,
        top_k: 2,
        hidden: 48,
        inter: 16,
    }
}

#[test]
fn experts_match_the_oracle_at_tiny_shapes_in_every_format() {
    let ctx = ctx();
    for (n, rows) in [1, 5, 37].into_iter().enumerate() {
        let case = Case::new(10 + n as u64, tiny(rows));
        let o_ids = {
            let (g, d) = upload(&ctx, &case, WeightFormat::F32);
            run(&ctx, &case, &g, &d).ids
        };
        // Expert 3 is every row's first choice, expert 5 nobody's.
        for row in o_ids.chunks(2) {
            assert_eq!(row[0], 3, "{o_ids:?}");
        }
        assert!(!o_ids.contains(&5), "{o_ids:?}");
        check_case(&ctx, &format!("rows {rows}"), &case, &WeightFormat::ALL);
    }
}

#[test]
fn experts_match_the_oracle_at_128_experts_top_8() {
    let ctx = ctx();
    let shape = ExpertShape {
        rows: 40,
        experts: 128,
        top_k: 8,
        hidden: 256,
        inter: 64,
    };
    let case = Case::new(40, shape);
    check_case(&ctx, "E 128 K 8", &case, &WeightFormat::ALL);
}

#[test]
fn experts_read_weights_split_over_chunks_and_odd_widths() {
    // D and I not multiples of 4 (scalar x loads, padded weight rows) and bindings that hold
    // three experts' gate|up and seven experts' down rows: several dispatches, each over its
    // own experts.
    let shape = ExpertShape {
        rows: 21,
        experts: 8,
        top_k: 3,
        hidden: 37,
        inter: 13,
    };
    let gate_up_bytes = (2 * 13 * 40 * 4) as u64;
    let ctx = ctx_with_binding_limit(3 * gate_up_bytes + 16);
    let case = Case::new(50, shape);
    for format in [WeightFormat::F32, WeightFormat::Q4] {
        let (g, d) = upload(&ctx, &case, format);
        if format == WeightFormat::F32 {
            assert_eq!(g.chunks.len(), 3, "gate_up over 3 chunks");
            assert!(d.chunks.len() >= 2, "down over chunks");
        }
    }
    check_case(
        &ctx,
        "chunked, D 37 I 13",
        &case,
        &[WeightFormat::F32, WeightFormat::Q4],
    );
}

#[test]
fn experts_take_a_given_routing_with_one_crowded_expert_and_bad_ids() {
    // 300 assignments (two passes of the plan's 256), every row's first slot on expert 3
    // (10 tiles of its list), the second slot spread, and two ids past the experts, which add
    // nothing.
    let ctx = ctx();
    let s = tiny(150);
    let case = Case::new(90, s);
    let mut ids: Vec<u32> = (0..150u32)
        .flat_map(|r| [3, [0, 1, 2, 4, 6, 7][r as usize % 6]])
        .collect();
    ids[7] = 8;
    ids[201] = u32::MAX;
    let weights = random_vec(91, 300, 1.0);
    let (g, d) = upload(&ctx, &case, WeightFormat::F16Packed);
    let y = Tensor::from_f32(&ctx, &[150, 48], &case.y, "y").unwrap();
    let it = Tensor::from_u32(&ctx, &[150, 2], &ids, "ids").unwrap();
    let wt = Tensor::from_f32(&ctx, &[150, 2], &weights, "weights").unwrap();
    let out = Tensor::zeros(&ctx, DType::F32, &[150, 48], "out").unwrap();
    let scratch = ExpertScratch::new(&ctx, s).unwrap();
    let mut step = StepEncoder::new(&ctx, "moe experts given routing");
    let route = Route {
        ids: &it,
        weights: &wt,
    };
    let experts = ExpertWeights {
        gate_up: &g,
        down: &d,
    };
    moe_experts(&mut step, &y, route, experts, &out, &scratch, s).unwrap();
    step.submit().unwrap();
    let got = out.read_f32(&ctx).unwrap();
    let plan = scratch.plan.read_u32(&ctx).unwrap();
    assert_eq!(plan[8], 298, "listed assignments");
    assert_eq!(plan[4] - plan[3], 150, "expert 3's list");
    assert_eq!(plan[9 + 4] - plan[9 + 3], 150u32.div_ceil(TILE_ROWS as u32));
    // The oracle with the bad slots weighted 0 (on any valid expert).
    let (mut oi, mut ow) = (ids.clone(), weights.clone());
    for j in [7, 201] {
        oi[j] = 0;
        ow[j] = 0.0;
    }
    let gu = stored(WeightFormat::F16Packed, &case.gate_up, 48);
    let dn = stored(WeightFormat::F16Packed, &case.down, 16);
    let want = oracle::moe_experts(&case.y, &oi, &ow, &gu, &dn, dims(s));
    assert_close("given routing", &got, &want, TOL_STORED);
}

#[test]
fn experts_rerun_to_the_same_bits() {
    let ctx = ctx();
    let case = Case::new(60, tiny(37));
    let (g, d) = upload(&ctx, &case, WeightFormat::Q8);
    let first = run(&ctx, &case, &g, &d).out;
    for _ in 0..3 {
        let again = run(&ctx, &case, &g, &d).out;
        let same = first
            .iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "a rerun changed the output");
    }
}

#[test]
fn bad_expert_shapes_are_refused() {
    let ctx = ctx();
    let s = tiny(4);
    let case = Case::new(70, s);
    let (g, d) = upload(&ctx, &case, WeightFormat::F32);
    let y = Tensor::from_f32(&ctx, &[4, 48], &case.y, "y").unwrap();
    let ids = Tensor::zeros(&ctx, DType::U32, &[4, 2], "ids").unwrap();
    let w = Tensor::zeros(&ctx, DType::F32, &[4, 2], "w").unwrap();
    let out = Tensor::zeros(&ctx, DType::F32, &[4, 48], "out").unwrap();
    let scratch = ExpertScratch::new(&ctx, s).unwrap();
    let route = Route {
        ids: &ids,
        weights: &w,
    };
    let mut step = StepEncoder::new(&ctx, "moe experts errors");
    let mut attempt = |weights: ExpertWeights<'_>, shape: ExpertShape, scratch: &ExpertScratch| {
        moe_experts(&mut step, &y, route, weights, &out, scratch, shape)
            .unwrap_err()
            .to_string()
    };
    let both = ExpertWeights {
        gate_up: &g,
        down: &d,
    };
    // gate_up and down swapped: the gate_up tensor is named, with both shapes.
    let swapped = ExpertWeights {
        gate_up: &d,
        down: &g,
    };
    let err = attempt(swapped, s, &scratch);
    assert!(
        err.contains("moe_experts gate_up") && err.contains("[384, 16]"),
        "{err}"
    );
    // More experts per token than experts.
    let err = attempt(both, ExpertShape { top_k: 9, ..s }, &scratch);
    assert!(err.contains("top_k: 9"), "{err}");
    // Scratch for fewer rows.
    let small = ExpertScratch::new(&ctx, tiny(2)).unwrap();
    let err = attempt(both, s, &small);
    assert!(err.contains("moe_experts scratch"), "{err}");
    // Rows past the routing.
    let err = attempt(both, tiny(5), &ExpertScratch::new(&ctx, tiny(5)).unwrap());
    assert!(err.contains("moe_experts y"), "{err}");
    // A chunk boundary inside an expert (a plain weight over a small binding limit).
    let small_ctx = ctx_with_binding_limit(40 * 48 * 4 + 8);
    let split = Weight::zeros(&small_ctx, 8 * 32, 48, WeightFormat::F32, "gate_up").unwrap();
    let d2 = Weight::zeros_stacked(&small_ctx, 8, 48, 16, WeightFormat::F32, "down").unwrap();
    let scratch2 = ExpertScratch::new(&small_ctx, s).unwrap();
    let t = |data: &[f32], shape: &[usize]| Tensor::from_f32(&small_ctx, shape, data, "t").unwrap();
    let (y2, w2, out2) = (
        t(&case.y, &[4, 48]),
        t(&[0.0; 8], &[4, 2]),
        t(&[0.0; 192], &[4, 48]),
    );
    let ids2 = Tensor::zeros(&small_ctx, DType::U32, &[4, 2], "ids").unwrap();
    let mut step2 = StepEncoder::new(&small_ctx, "moe experts chunk error");
    let route2 = Route {
        ids: &ids2,
        weights: &w2,
    };
    let weights2 = ExpertWeights {
        gate_up: &split,
        down: &d2,
    };
    let err = moe_experts(&mut step2, &y2, route2, weights2, &out2, &scratch2, s)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("zeros_stacked") && err.contains("0..40"),
        "{err}"
    );
}

#[test]
fn gelu_gate_softcap_and_scale_match_the_oracle() {
    let ctx = ctx();
    let (rows, inter) = (7, 37);
    let mut gu = random_vec(80, rows * 2 * inter, 6.0);
    // Saturated gates both ways, a zero gate, huge and zero up values.
    gu[0] = 1e4;
    gu[1] = -1e4;
    gu[2] = 0.0;
    gu[inter + 3] = 0.0;
    gu[2 * inter + 4] = -30.0;
    gu[3 * inter + 5] = 1e4;
    let gt = Tensor::from_f32(&ctx, &[rows, 2 * inter], &gu, "gu").unwrap();
    let out = Tensor::from_f32(&ctx, &[rows, inter], &vec![-7.25; rows * inter], "out").unwrap();
    let mut x = random_vec(81, 1000, 100.0);
    x[..6].copy_from_slice(&[1e4, -1e4, 0.0, 30.0, -3e38, 1e-3]);
    let xt = Tensor::from_f32(&ctx, &[1000], &x, "x").unwrap();
    let z = random_vec(82, 300, 5.0);
    let zt = Tensor::from_f32(&ctx, &[300], &z, "z").unwrap();
    let mut step = StepEncoder::new(&ctx, "activations");
    gelu_tanh_gate(&mut step, &gt, &out, rows, inter).unwrap();
    softcap(&mut step, &xt, 1000, 30.0).unwrap();
    scale_in_place(&mut step, &zt, 299, 0.734375).unwrap();
    step.submit().unwrap();

    let got = out.read_f32(&ctx).unwrap();
    let want = oracle::gelu_tanh_gate(&gu, inter);
    // f32 evaluation of a smooth function: a few ulp of the largest output.
    assert_close("gelu_tanh_gate", &got, &want, 1e-6);
    let through = 1e4 * gu[inter];
    assert!(
        (got[0] - through).abs() <= 1e-6 * through.abs(),
        "gate 1e4: {}",
        got[0]
    );
    assert!(
        got[1].abs() <= 1e-30,
        "a gate of -1e4 gives 0, not {}",
        got[1]
    );
    let got = xt.read_f32(&ctx).unwrap();
    let want = oracle::softcap(&x, 30.0);
    assert!(
        got.iter().all(|v| v.is_finite()),
        "softcap gave a non-finite value"
    );
    assert!(
        (got[0] - 30.0).abs() < 1e-5 && (got[1] + 30.0).abs() < 1e-5,
        "{:?}",
        &got[..2]
    );
    assert_eq!(got[2], 0.0, "softcap(0)");
    assert_close("softcap", &got, &want, 1e-6);
    let got = zt.read_f32(&ctx).unwrap();
    let want: Vec<f32> = z[..299].iter().map(|v| v * 0.734375).collect();
    assert_eq!(&got[..299], &want[..], "scale_in_place is one f32 product");
    assert_eq!(got[299], z[299], "past n is untouched");
    assert!(relative_error(&got[..299], &oracle::scale(&z[..299], 0.734375)) == 0.0);
}

#[test]
fn bad_activation_arguments_are_refused() {
    let ctx = ctx();
    let x = Tensor::zeros(&ctx, DType::F32, &[10], "x").unwrap();
    let mut step = StepEncoder::new(&ctx, "activation errors");
    let err = softcap(&mut step, &x, 10, 0.0).unwrap_err().to_string();
    assert!(err.contains("cap 0"), "{err}");
    let err = softcap(&mut step, &x, 11, 30.0).unwrap_err().to_string();
    assert!(err.contains("softcap x"), "{err}");
    let err = gelu_tanh_gate(&mut step, &x, &x, 2, 3)
        .unwrap_err()
        .to_string();
    assert!(err.contains("gelu_tanh_gate gu"), "{err}");
    let err = scale_in_place(&mut step, &x, 20, 2.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("scale_in_place x"), "{err}");
}
