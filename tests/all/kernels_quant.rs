//! Kernels reading block-quantized weights (q8, q4) against the CPU oracle applied to the
//! *dequantized* weights, so only the kernel's own error is measured: every matmul kernel,
//! the embedding gather and the LM head + token selection, on shapes that do and do not
//! divide the 32-weight blocks, with weights split over several chunks.

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
    let out = Tensor::zeros(ctx, DType::U32, &[rows, 2], "out").unwrap();
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
    sel::select_finalize(&mut step, &state, &out, rows, params.confidence).unwrap();
    step.submit().unwrap();
    out.read_u32(ctx)
        .unwrap()
        .chunks(2)
        .map(|w| (w[0], f32::from_bits(w[1])))
        .collect()
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
