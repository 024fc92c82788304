//! Kernels reading block-quantized weights (q8, q4) against the CPU oracle applied to the
//! *dequantized* weights, so only the kernel's own error is measured: every matmul kernel,
//! the embedding gather and the LM head + token selection, on shapes that do and do not
//! divide the 32-weight blocks, with weights split over several chunks. `narrow-dot`, which
//! also quantizes x, is checked against a host copy of its x quantization (its own error)
//! and against exact x (the error that quantization adds).

use crate::common;

use common::{assert_close, ctx, ctx_with_binding_limit, random_vec};
use unmask_core::oracle::basic::embed as embed_oracle;
use unmask_core::oracle::matmul::matmul_xwt;
use unmask_core::oracle::sampling::select_token;
use unmask_core::quant::{self, QuantFormat};
use unmask_gpu::ops::elementwise as ew;
use unmask_gpu::ops::matmul::{MatmulKernel, matmul};
use unmask_gpu::ops::sampling::{self as sel, SelectParams};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

/// The kernels' own error (f32 accumulation in another order), as for f32 weights.
const TOL: f64 = 1e-4;

const FORMATS: [(WeightFormat, QuantFormat); 2] = [
    (WeightFormat::Q8, QuantFormat::Q8),
    (WeightFormat::Q4, QuantFormat::Q4),
];

const KERNELS: [MatmulKernel; 4] = [
    MatmulKernel::Naive,
    MatmulKernel::Tiled,
    MatmulKernel::TiledShared,
    MatmulKernel::Auto,
];

/// (M, N, K): K below, across and at block and row-padding boundaries, with every K % 4.
const SHAPES: [(usize, usize, usize); 7] = [
    (1, 1, 1),
    (3, 9, 7),
    (2, 33, 33),
    (33, 65, 64),
    (5, 40, 96),
    (17, 100, 130),
    (70, 40, 257),
];

/// What the kernels should see: the weights after a round trip through the quantizer.
fn dequantized(format: QuantFormat, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut codes = vec![0u8; rows * format.row_code_bytes(cols)];
    let mut scales = vec![0u8; rows * quant::row_scale_bytes(cols)];
    format
        .quantize_rows(w, cols, &mut codes, &mut scales)
        .expect("quantize");
    format.dequantize_rows(&codes, &scales, rows, cols)
}

/// Weights with a spread of block magnitudes, so scales differ from block to block.
fn weights(seed: u64, rows: usize, cols: usize) -> Vec<f32> {
    let mut w = random_vec(seed, rows * cols, 0.5);
    for (i, v) in w.iter_mut().enumerate() {
        *v *= 1.0 + ((i / 32) % 5) as f32;
    }
    w
}

fn run_matmul(ctx: &GpuContext, x: &[f32], w: &Weight, m: usize, kernel: MatmulKernel) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let xt = Tensor::from_f32(ctx, &[m, k], x, "x").expect("x");
    let yt = Tensor::from_f32(ctx, &[m, n], &vec![-7.25; m * n], "y").expect("y");
    let mut step = StepEncoder::new(ctx, "quant matmul test");
    matmul(&mut step, &xt, w, &yt, m, kernel).expect("matmul");
    step.submit().expect("submit");
    yt.read_f32(ctx).expect("read y")
}

#[test]
fn matmul_every_kernel_matches_oracle_on_dequantized_weights() {
    let ctx = ctx();
    for (si, &(m, n, k)) in SHAPES.iter().enumerate() {
        let x = random_vec(100 + si as u64, m * k, 1.0);
        let wd = weights(200 + si as u64, n, k);
        for (format, q) in FORMATS {
            let want = matmul_xwt(&x, &dequantized(q, &wd, n, k), m, n, k);
            let w = Weight::from_f32(&ctx, n, k, &wd, format, "w").expect("weight");
            assert_eq!(w.format, format);
            assert_eq!(w.row_stride % quant::ROW_ALIGN, 0);
            for kernel in KERNELS {
                let got = run_matmul(&ctx, &x, &w, m, kernel);
                assert_close(
                    &format!("{} {} m={m} n={n} k={k}", kernel.name(), format.name()),
                    &got,
                    &want,
                    TOL,
                );
            }
        }
    }
}

#[test]
fn matmul_over_several_chunks() {
    // 16 KiB bindings: a 300 x 130 weight takes 5 chunks in q8 (204 bytes a row) and 3 in
    // q4 (108 bytes a row); each chunk has its own scales region.
    let ctx = ctx_with_binding_limit(16 * 1024);
    let (m, n, k) = (9, 300, 130);
    let x = random_vec(7, m * k, 1.0);
    let wd = weights(8, n, k);
    for (format, q) in FORMATS {
        let want = matmul_xwt(&x, &dequantized(q, &wd, n, k), m, n, k);
        let w = Weight::from_f32(&ctx, n, k, &wd, format, "w").expect("weight");
        assert!(w.chunks.len() > 1, "{}: one chunk", format.name());
        for c in &w.chunks {
            assert!(c.buffer.size() <= 16 * 1024);
        }
        for kernel in KERNELS {
            let got = run_matmul(&ctx, &x, &w, m, kernel);
            assert_close(
                &format!(
                    "{} {} over {} chunks",
                    kernel.name(),
                    format.name(),
                    w.chunks.len()
                ),
                &got,
                &want,
                TOL,
            );
        }
    }
}

#[test]
fn quantized_weights_are_close_to_the_exact_ones() {
    // Not the kernels' error: what quantization costs on a random matmul, for the record.
    let ctx = ctx();
    let (m, n, k) = (8, 64, 512);
    let x = random_vec(1, m * k, 1.0);
    let wd = random_vec(2, n * k, 0.5);
    let exact = matmul_xwt(&x, &wd, m, n, k);
    for (format, bound) in [(WeightFormat::Q8, 2e-2), (WeightFormat::Q4, 2e-1)] {
        let w = Weight::from_f32(&ctx, n, k, &wd, format, "w").expect("weight");
        let got = run_matmul(&ctx, &x, &w, m, MatmulKernel::Auto);
        assert_close(
            &format!("{} against unquantized weights", format.name()),
            &got,
            &exact,
            bound,
        );
    }
}

fn run_embed(ctx: &GpuContext, rows: usize, cols: usize, n_ids: usize) {
    let table = weights(rows as u64 + cols as u64, rows, cols);
    let ids: Vec<u32> = (0..n_ids as u32)
        .map(|i| (i * 37 + 5) % rows as u32)
        .chain([rows as u32 - 1, 0])
        .collect();
    for (format, q) in FORMATS {
        let want = embed_oracle(&dequantized(q, &table, rows, cols), cols, &ids);
        let w = Weight::from_f32(ctx, rows, cols, &table, format, "table").expect("table");
        let idt = Tensor::from_u32(ctx, &[ids.len()], &ids, "ids").unwrap();
        let out = Tensor::zeros(ctx, DType::F32, &[ids.len(), cols], "out").unwrap();
        let mut step = StepEncoder::new(ctx, "embed");
        ew::embed(&mut step, &idt, &w, &out, ids.len()).unwrap();
        step.submit().unwrap();
        assert_close(
            &format!(
                "embed {} {rows}x{cols} over {} chunk(s)",
                format.name(),
                w.chunks.len()
            ),
            &out.read_f32(ctx).unwrap(),
            &want,
            TOL,
        );
    }
}

#[test]
fn embedding_gather_reads_quantized_tables() {
    let ctx = ctx();
    for (rows, cols) in [(300, 7), (50, 33), (64, 64), (40, 130)] {
        run_embed(&ctx, rows, cols, 25);
    }
    // 4 KiB bindings: a 300 x 40 table (64-column padded rows) needs several chunks.
    let small = ctx_with_binding_limit(4096);
    run_embed(&small, 300, 40, 20);
}

/// LM head over a quantized, chunked table followed by the streaming token choice, as the
/// forward pass runs it: one matmul and one accumulate per vocabulary chunk.
fn run_head(
    ctx: &GpuContext,
    hidden: &[f32],
    head: &Weight,
    rows: usize,
    positions: &[u32],
    params: &SelectParams,
) -> Vec<(u32, f32)> {
    let d = head.cols;
    let widest = head.chunks.iter().map(|c| c.rows).max().unwrap();
    let x = Tensor::from_f32(ctx, &[rows, d], hidden, "hidden").unwrap();
    let logits = Tensor::zeros(ctx, DType::F32, &[rows, widest], "logits").unwrap();
    let pos = Tensor::from_u32(ctx, &[rows], positions, "positions").unwrap();
    let state = Tensor::zeros(ctx, DType::U32, &[sel::state_len(rows)], "state").unwrap();
    let out = Tensor::zeros(ctx, DType::U32, &[rows, sel::OUT_WORDS], "out").unwrap();
    let mut step = StepEncoder::new(ctx, "head");
    sel::select_reset(&mut step, &state, rows).unwrap();
    for (ci, chunk) in head.chunks.iter().enumerate() {
        let part = head.chunk_view(ci);
        matmul(&mut step, &x, &part, &logits, rows, MatmulKernel::Auto).unwrap();
        sel::select_accumulate(
            &mut step,
            &logits,
            None,
            rows,
            chunk.rows,
            chunk.row_start,
            &pos,
            &state,
            params,
        )
        .unwrap();
    }
    sel::select_finalize(&mut step, &state, &out, rows, params).unwrap();
    step.submit().unwrap();
    crate::common::select::pairs(&out.read_u32(ctx).unwrap())
}

#[test]
fn lm_head_token_choice_reads_quantized_tables() {
    // 8 KiB bindings: a 500-token head of width 40 is split over vocabulary chunks.
    let ctx = ctx_with_binding_limit(8 * 1024);
    let (rows, vocab, d) = (6, 500, 40);
    let table = weights(11, vocab, d);
    let hidden = random_vec(12, rows * d, 2.0);
    let positions: Vec<u32> = (0..rows as u32).map(|r| 3 + 7 * r).collect();
    for (format, q) in FORMATS {
        let logits = matmul_xwt(&hidden, &dequantized(q, &table, vocab, d), rows, vocab, d);
        let head = Weight::from_f32(&ctx, vocab, d, &table, format, "head").unwrap();
        assert!(head.chunks.len() > 1, "{}: one chunk", format.name());
        for temperature in [0.0f32, 1.0] {
            let params = SelectParams {
                temperature,
                seed: 77,
                step: 2,
                ..SelectParams::default()
            };
            let got = run_head(&ctx, &hidden, &head, rows, &positions, &params);
            let mut worst = 0f64;
            for (r, g) in got.iter().enumerate() {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let want = select_token(row, None, positions[r], &params);
                assert_eq!(g.0, want.0, "{} T={temperature} row {r}", format.name());
                worst = worst.max(((g.1 as f64 - want.1 as f64) / want.1 as f64).abs());
            }
            eprintln!(
                "[check] lm head {} T={temperature} over {} chunks: tokens equal, confidence relative error {worst:.3e} (tolerance {TOL:.0e})",
                format.name(),
                head.chunks.len()
            );
            assert!(worst <= TOL, "confidence error {worst:.3e}");
        }
    }
}

/// x as `narrow-dot` multiplies it: per row and 32-element block (zero past K), the codes
/// round(x * (127 / max|x_block|)) clamped to -127..=127, times the scale max / 127, with the
/// scale, its inverse and the product in f32 as the kernel computes them. WGSL's `round`
/// takes halves to the even neighbour. Blocks whose largest magnitude is below 1e-30 are
/// zero, as in the kernel.
fn quantize_x_like_narrow_dot(x: &[f32], k: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (row, out_row) in x.chunks(k).zip(out.chunks_mut(k)) {
        for (block, out_block) in row.chunks(32).zip(out_row.chunks_mut(32)) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            if amax < 1e-30 {
                continue;
            }
            let inv = 127.0f32 / amax;
            let sx = amax / 127.0f32;
            for (o, &v) in out_block.iter_mut().zip(block) {
                *o = (v * inv).round_ties_even().clamp(-127.0, 127.0) * sx;
            }
        }
    }
    out
}

/// What a fused matmul of `narrow-dot` computes, on the host in f64: the norm weight `g`
/// multiplies x (f32, as in the kernel), `quantize_x` then rounds that to the kernel's x
/// codes (or leaves it exact), the sums with the gate (and up) rows are scaled by each
/// row's 1 / rms (from the raw x, eps 1e-5), SwiGLU pairs them and the residual is added.
#[allow(clippy::too_many_arguments)]
fn narrow_dot_reference(
    x: &[f32],
    m: usize,
    k: usize,
    norm: Option<&[f32]>,
    quantize_x: bool,
    gate: &[f32],
    up: Option<&[f32]>,
    residual: Option<&[f32]>,
) -> Vec<f32> {
    let n = gate.len() / k;
    let xg: Vec<f32> = match norm {
        Some(g) => x.iter().enumerate().map(|(i, &v)| v * g[i % k]).collect(),
        None => x.to_vec(),
    };
    let xin = if quantize_x {
        quantize_x_like_narrow_dot(&xg, k)
    } else {
        xg
    };
    let inv_rms: Vec<f64> = x
        .chunks(k)
        .map(|row| match norm {
            Some(_) => {
                let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / k as f64;
                1.0 / (ms + 1e-5).sqrt()
            }
            None => 1.0,
        })
        .collect();
    let scaled = |w: &[f32]| -> Vec<f64> {
        matmul_xwt(&xin, w, m, n, k)
            .iter()
            .enumerate()
            .map(|(i, &v)| f64::from(v) * inv_rms[i / n])
            .collect()
    };
    let mut y = scaled(gate);
    if let Some(up) = up {
        for (g, u) in y.iter_mut().zip(scaled(up)) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
    }
    y.iter()
        .enumerate()
        .map(|(i, &v)| (v + residual.map_or(0.0, |r| f64::from(r[i]))) as f32)
        .collect()
}

/// The fusions of the forward pass: (name, norm, residual, swiglu).
const DOT_FUSIONS: [(&str, bool, bool, bool); 5] = [
    ("plain", false, false, false),
    ("norm", true, false, false),
    ("residual", false, true, false),
    ("swiglu", false, false, true),
    ("norm+swiglu", true, false, true),
];

/// x with block magnitudes that differ from block to block (so a scale kept for the wrong
/// block shows), and some all-zero blocks: block 0 of row 0 (all of row 0 when K = 32) and,
/// from 3 rows on, all of row 2.
fn dot_x(seed: u64, m: usize, k: usize) -> Vec<f32> {
    let mut x = random_vec(seed, m * k, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        *v *= [1.0, 4.0, 0.25][(i % k / 32) % 3];
    }
    x[..k.min(32)].fill(0.0);
    if m >= 3 {
        x[2 * k..3 * k].fill(0.0);
    }
    x
}

/// Runs `narrow-dot` for every fusion on (m, n, k) in both quantized formats and checks it
/// twice: against the host computing with the kernel's own x codes (only summation order
/// and f32 rounding differ: 1e-4), and against exact x (the error of x's 8-bit codes,
/// within `MatmulKernel::NarrowDot.tolerance()`). Weights are the quantized ones in both, so
/// their own quantization error is not counted. Returns the largest error of the second
/// check.
fn check_narrow_dot(ctx: &GpuContext, seed: u64, m: usize, n: usize, k: usize) -> f64 {
    use unmask_gpu::ops::matmul::{Fusion, matmul_fused};
    let x = dot_x(seed, m, k);
    let g = random_vec(seed + 1, k, 1.5);
    let gate = weights(seed + 2, n, k);
    let up = weights(seed + 3, n, k);
    let resid = random_vec(seed + 4, m * n, 1.0);
    let xt = Tensor::from_f32(ctx, &[m, k], &x, "x").unwrap();
    let gt = Tensor::from_f32(ctx, &[k], &g, "g").unwrap();
    let loose = f64::from(MatmulKernel::NarrowDot.tolerance());
    let mut worst = 0f64;
    for (format, q) in FORMATS {
        assert_eq!(
            MatmulKernel::NarrowDot.plan(ctx, m, format).0,
            MatmulKernel::NarrowDot
        );
        let (gate_d, up_d) = (dequantized(q, &gate, n, k), dequantized(q, &up, n, k));
        let plain = Weight::from_f32(ctx, n, k, &gate, format, "gate").unwrap();
        let pair = Weight::zeros_paired(ctx, n, k, format, "gate_up").unwrap();
        pair.write_rows_f32(ctx, 0, &gate).unwrap();
        pair.write_rows_f32(ctx, n, &up).unwrap();
        let chunks = format!("{}+{} chunks", plain.chunks.len(), pair.chunks.len());
        for (what, norm, residual, swiglu) in DOT_FUSIONS {
            let yt = Tensor::from_f32(ctx, &[m, n], &resid, "y").unwrap();
            let fusion = Fusion {
                norm: norm.then_some((&gt, 1e-5)),
                residual,
                swiglu,
            };
            let w = if swiglu { &pair } else { &plain };
            let mut step = StepEncoder::new(ctx, "narrow-dot test");
            matmul_fused(&mut step, &xt, w, &yt, m, MatmulKernel::NarrowDot, fusion).unwrap();
            step.submit().unwrap();
            let got = yt.read_f32(ctx).unwrap();
            let label = format!(
                "narrow-dot {what} {} m={m} n={n} k={k} ({chunks})",
                format.name()
            );
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{label}: non-finite output (zero x blocks?)"
            );
            let want = |quantize_x: bool| {
                narrow_dot_reference(
                    &x,
                    m,
                    k,
                    norm.then_some(&g[..]),
                    quantize_x,
                    &gate_d,
                    swiglu.then_some(&up_d[..]),
                    residual.then_some(&resid[..]),
                )
            };
            assert_close(
                &format!("{label}, x codes as the kernel's"),
                &got,
                &want(true),
                TOL,
            );
            let exact = want(false);
            assert_close(&format!("{label}, exact x"), &got, &exact, loose);
            worst = worst.max(common::relative_error(&got, &exact));
        }
    }
    worst
}

#[test]
fn narrow_dot_matches_host_x_quantization_and_exact_x() {
    let ctx = ctx();
    let f32_plan = MatmulKernel::NarrowDot.plan(&ctx, 5, WeightFormat::F32).0;
    eprintln!(
        "[path] narrow-dot: q8 and q4 run {} (dot4I8Packed), f32 weights run {}",
        MatmulKernel::NarrowDot
            .plan(&ctx, 5, WeightFormat::Q8)
            .0
            .name(),
        f32_plan.name()
    );
    assert_eq!(f32_plan, MatmulKernel::Narrow);
    // M at 1, 5, 33 and 63 (one and two 32-row tiles, partial ones); K of 1, 3 and 5 blocks
    // (one 256-deep chunk, part of it idle) and 45 (x rows read as scalars, a block cut off
    // by K); N past a multiple of 16.
    let mut worst = 0f64;
    for (si, &(m, n, k)) in [
        (1usize, 19usize, 96usize),
        (5, 37, 160),
        (33, 21, 32),
        (63, 23, 96),
        (5, 17, 45),
    ]
    .iter()
    .enumerate()
    {
        worst = worst.max(check_narrow_dot(&ctx, 1000 + 10 * si as u64, m, n, k));
    }
    eprintln!(
        "[check] narrow-dot against exact x: largest relative error {worst:.3e} (tolerance {:.0e})",
        MatmulKernel::NarrowDot.tolerance()
    );
}

#[test]
fn narrow_dot_over_chunks_and_its_fallback() {
    // 16 KiB bindings split a [150, 288] weight (340 bytes a row in q8, 180 in q4) and its
    // gate|up pair over several chunks; K = 288 is two 256-deep stages (9 blocks).
    let small = ctx_with_binding_limit(16 * 1024);
    let (m, n, k) = (9, 150, 288);
    for format in [WeightFormat::Q8, WeightFormat::Q4] {
        let w = Weight::zeros(&small, n, k, format, "w").unwrap();
        assert!(w.chunks.len() > 1, "{}: one chunk", format.name());
    }
    let worst = check_narrow_dot(&small, 77, m, n, k);
    eprintln!("[check] narrow-dot over chunks against exact x: {worst:.3e}");
    // Float weights run `narrow`, output for output.
    let ctx = ctx();
    let (m, n, k) = (5, 40, 70);
    let x = random_vec(5, m * k, 1.0);
    let w = Weight::from_f32(&ctx, n, k, &weights(6, n, k), WeightFormat::F32, "w").unwrap();
    assert_eq!(
        run_matmul(&ctx, &x, &w, m, MatmulKernel::NarrowDot),
        run_matmul(&ctx, &x, &w, m, MatmulKernel::Narrow),
        "narrow-dot with f32 weights is narrow"
    );
}
