//! Row-wise kernels against the CPU oracle: embedding (every weight format, chunked),
//! RMSNorm, RoPE, row gather/scatter, SwiGLU, residual add, and dLLM-Cache's V-verify.

use crate::common;

use common::{assert_close, ctx, ctx_with_binding_limit, random_vec};
use unmask_core::oracle;
use unmask_gpu::ops::elementwise::{self as ew, RowWindow};
use unmask_gpu::ops::unfused::{self, RopeShape};
use unmask_gpu::{DType, StepEncoder, Tensor, Weight, WeightFormat};

const F32_TOL: f64 = 1e-4;
// Weights stored as f16 (11-bit mantissa): relative rounding error ~5e-4 per value.
const F16_TOL: f64 = 1e-2;

fn formats(ctx: &unmask_gpu::GpuContext) -> Vec<(WeightFormat, f64)> {
    let mut v = vec![
        (WeightFormat::F32, F32_TOL),
        (WeightFormat::F16Packed, F16_TOL),
    ];
    if ctx.features.shader_f16 {
        v.push((WeightFormat::F16Native, F16_TOL));
    } else {
        eprintln!("[path] shader-f16 absent: native f16 embedding not run, packed f16 covers it");
    }
    v
}

fn run_embed(
    ctx: &unmask_gpu::GpuContext,
    vocab: usize,
    cols: usize,
    n_ids: u32,
    format: WeightFormat,
    tol: f64,
) -> usize {
    let table = random_vec(11, vocab * cols, 1.0);
    let ids: Vec<u32> = (0..n_ids).map(|i| (i * 7919 + 3) % vocab as u32).collect();
    let w = Weight::from_f32(ctx, vocab, cols, &table, format, "embed").unwrap();
    let ids_t = Tensor::from_u32(ctx, &[ids.len()], &ids, "ids").unwrap();
    let out = Tensor::zeros(ctx, DType::F32, &[ids.len(), cols], "out").unwrap();
    let mut step = StepEncoder::new(ctx, "embed");
    ew::embed(&mut step, &ids_t, &w, &out, ids.len()).unwrap();
    step.submit().unwrap();
    let got = out.read_f32(ctx).unwrap();
    let want = oracle::embed(&table, cols, &ids);
    assert_close(
        &format!(
            "embed {}x{} {} chunks={}",
            vocab,
            cols,
            w.format.name(),
            w.chunks.len()
        ),
        &got,
        &want,
        tol,
    );
    w.chunks.len()
}

#[test]
fn embedding_every_format() {
    let ctx = ctx();
    for (format, tol) in formats(&ctx) {
        run_embed(&ctx, 300, 37, 37, format, tol);
    }
}

#[test]
fn embedding_split_over_vocabulary_chunks() {
    // 4 KiB bindings: a 300 x 40 f32 table needs several chunks.
    let ctx = ctx_with_binding_limit(4096);
    for (format, tol) in formats(&ctx) {
        // 20 ids x 40 columns of output still fit one 4 KiB binding.
        let chunks = run_embed(&ctx, 300, 40, 20, format, tol);
        assert!(chunks > 1, "expected a chunked table, got {chunks} chunk");
    }
}

#[test]
fn rms_norm_matches_oracle() {
    let ctx = ctx();
    for (rows, cols) in [(1, 1), (3, 64), (7, 100), (5, 4096)] {
        let x = random_vec(1, rows * cols, 3.0);
        let w = random_vec(2, cols, 1.5);
        let xt = Tensor::from_f32(&ctx, &[rows, cols], &x, "x").unwrap();
        let wt = Tensor::from_f32(&ctx, &[cols], &w, "w").unwrap();
        let out = Tensor::zeros(&ctx, DType::F32, &[rows, cols], "out").unwrap();
        let mut step = StepEncoder::new(&ctx, "rms");
        ew::rms_norm(&mut step, &xt, &wt, &out, rows, cols, 1e-5).unwrap();
        step.submit().unwrap();
        let want = oracle::rms_norm(&x, &w, cols, 1e-5);
        assert_tensor(&ctx, &format!("rms_norm {rows}x{cols}"), &out, &want);
        // The statistics alone (what `coop` with a fused norm reads): 1 / rms per row.
        let inv = Tensor::zeros(&ctx, DType::F32, &[rows], "inv").unwrap();
        let mut step = StepEncoder::new(&ctx, "rms stats");
        ew::rms_stats(&mut step, &xt, &inv, rows, cols, 1e-5).unwrap();
        step.submit().unwrap();
        let want: Vec<f32> = x
            .chunks(cols)
            .map(|r| {
                let ss: f64 = r.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
                (1.0 / (ss / cols as f64 + 1e-5).sqrt()) as f32
            })
            .collect();
        assert_tensor(&ctx, &format!("rms_stats {rows}x{cols}"), &inv, &want);
    }
}

/// The unfused RoPE over rows of `stride` values at `positions`, `heads` heads of `hd`
/// from column `col`, against the oracle; the rows as the kernel left them.
fn rope_case(x: &[f32], positions: &[u32], shape: RopeShape, theta: f32, what: &str) -> Vec<f32> {
    let ctx = ctx();
    let (rows, hd) = (shape.rows, shape.head_dim);
    let xt = Tensor::from_f32(&ctx, &[rows, shape.row_stride], x, "x").unwrap();
    let pt = Tensor::from_u32(&ctx, &[rows], positions, "pos").unwrap();
    let table = ew::rope_table(theta, hd, shape.max_pos);
    let tt = Tensor::from_f32(&ctx, &[shape.max_pos, hd], &table, "table").unwrap();
    let mut step = StepEncoder::new(&ctx, "rope");
    unfused::rope(&mut step, &xt, &pt, &tt, shape).unwrap();
    step.submit().unwrap();
    let got = xt.read_f32(&ctx).unwrap();
    let (stride, col, heads) = (shape.row_stride, shape.col_offset, shape.n_heads);
    let want = oracle::rope(x, stride, col, heads, hd, positions, theta);
    assert_close(what, &got, &want, F32_TOL);
    got
}

#[test]
fn rope_matches_oracle_on_a_column_window() {
    // q (3 heads) and k (2 heads) of head_dim 16 in a fused row of stride 5*16 + 32 (v after).
    let (rows, heads, hd) = (9, 5, 16);
    let stride = heads * hd + 32;
    let x = random_vec(3, rows * stride, 1.0);
    let positions: Vec<u32> = (0..rows as u32).map(|i| i * 431 % 4000).collect();
    let shape = RopeShape {
        rows,
        n_heads: heads,
        head_dim: hd,
        row_stride: stride,
        col_offset: 0,
        max_pos: 4096,
    };
    let got = rope_case(&x, &positions, shape, 500_000.0, "rope theta=5e5 hd=16");
    // The columns after the rotated heads (v) are untouched.
    for r in 0..rows {
        assert_eq!(
            &got[r * stride + heads * hd..(r + 1) * stride],
            &x[r * stride + heads * hd..(r + 1) * stride]
        );
    }
}

#[test]
fn rope_with_small_theta_and_offset() {
    let (rows, stride) = (4, 20);
    let x = random_vec(4, rows * stride, 2.0);
    let shape = RopeShape {
        rows,
        n_heads: 2,
        head_dim: 6,
        row_stride: stride,
        col_offset: 8,
        max_pos: 64,
    };
    let what = "rope theta=1e4 hd=6 offset=8";
    rope_case(&x, &[0, 1, 17, 63], shape, 10_000.0, what);
}

#[test]
fn gather_and_scatter_rows() {
    let ctx = ctx();
    let (rows, stride) = (6, 24);
    let src = random_vec(5, rows * stride, 1.0);
    let st = Tensor::from_f32(&ctx, &[rows, stride], &src, "src").unwrap();
    let idx = vec![4u32, 0, 5, 2];
    let it = Tensor::from_u32(&ctx, &[idx.len()], &idx, "idx").unwrap();
    // Gather columns 8..18 of rows idx into a [4, 10] tensor.
    let g = Tensor::zeros(&ctx, DType::F32, &[idx.len(), 10], "g").unwrap();
    // Scatter the same window of rows 0..4 into rows idx of a [6, 12] tensor at column 2.
    let s = Tensor::from_f32(&ctx, &[rows, 12], &vec![-1.0; rows * 12], "s").unwrap();
    let mut step = StepEncoder::new(&ctx, "copy");
    ew::gather_rows(
        &mut step,
        &st,
        RowWindow { stride, col: 8 },
        &it,
        &g,
        RowWindow { stride: 10, col: 0 },
        idx.len(),
        10,
    )
    .unwrap();
    unfused::scatter_rows(
        &mut step,
        (&st, RowWindow { stride, col: 8 }),
        &it,
        (&s, RowWindow { stride: 12, col: 2 }),
        (idx.len(), 10),
    )
    .unwrap();
    step.submit().unwrap();
    let got_g = g.read_f32(&ctx).unwrap();
    let got_s = s.read_f32(&ctx).unwrap();
    for (r, &i) in idx.iter().enumerate() {
        let i = i as usize;
        assert_eq!(
            &got_g[r * 10..r * 10 + 10],
            &src[i * stride + 8..i * stride + 18]
        );
        assert_eq!(
            &got_s[i * 12 + 2..i * 12 + 12],
            &src[r * stride + 8..r * stride + 18]
        );
    }
    // Rows not named by idx keep their contents.
    for r in [1usize, 3] {
        assert!(got_s[r * 12..r * 12 + 12].iter().all(|&v| v == -1.0));
    }
}

#[test]
fn swiglu_and_add() {
    let ctx = ctx();
    let (rows, cols) = (5, 77);
    let gu = random_vec(6, rows * 2 * cols, 6.0);
    let gut = Tensor::from_f32(&ctx, &[rows, 2 * cols], &gu, "gu").unwrap();
    let out = Tensor::zeros(&ctx, DType::F32, &[rows, cols], "out").unwrap();
    let y = random_vec(7, rows * cols, 1.0);
    let yt = Tensor::from_f32(&ctx, &[rows, cols], &y, "y").unwrap();
    let mut step = StepEncoder::new(&ctx, "swiglu");
    unfused::swiglu(&mut step, &gut, &out, rows, cols).unwrap();
    unfused::add_in_place(&mut step, &out, &yt, rows * cols).unwrap();
    step.submit().unwrap();
    let want = oracle::add(&oracle::swiglu(&gu, cols), &y);
    assert_close("swiglu + add", &out.read_f32(&ctx).unwrap(), &want, F32_TOL);
}

#[test]
fn shape_errors_name_the_op() {
    let ctx = ctx();
    let x = Tensor::zeros(&ctx, DType::F32, &[2, 8], "x").unwrap();
    let w = Tensor::zeros(&ctx, DType::F32, &[4], "w").unwrap();
    let mut step = StepEncoder::new(&ctx, "bad");
    let err = ew::rms_norm(&mut step, &x, &w, &x, 2, 8, 1e-5).unwrap_err();
    assert!(err.to_string().contains("rms_norm weight"), "{err}");
    let ids = Tensor::zeros(&ctx, DType::F32, &[2], "ids").unwrap();
    let table = Weight::zeros(&ctx, 4, 8, WeightFormat::F32, "t").unwrap();
    let err = ew::embed(&mut step, &ids, &table, &x, 2).unwrap_err();
    assert!(err.to_string().contains("u32"), "{err}");
}

/// RoPE + K/V into the arena with a bias (Dream's q/k/v biases are added here) at head dims
/// 256 and 512 (wider than the 128 every published LLaDA/Dream model has), GQA 4/2 heads,
/// against the oracle: q rotated in place, k rotated and v copied into the arena rows at
/// `kv_index`, every value biased first.
#[test]
fn rope_qkv_with_a_bias_matches_the_oracle_at_wide_heads() {
    use ew::QkvShape;
    let ctx = ctx();
    for hd in [256, 512] {
        let (rows, heads, kv_heads, max_pos, theta) = (3, 4, 2, 40, 1_000_000.0);
        let stride = (heads + 2 * kv_heads) * hd;
        let kv_w = kv_heads * hd;
        let x = random_vec(hd as u64, rows * stride, 1.0);
        let bias = random_vec(hd as u64 + 1, stride, 0.5);
        let positions: Vec<u32> = vec![0, 39, 17];
        let kv_index: Vec<u32> = vec![2, 0, 1];
        let table = ew::rope_table(theta, hd, max_pos);
        let tt = Tensor::from_f32(&ctx, &[max_pos, hd], &table, "table").unwrap();
        let pt = Tensor::from_u32(&ctx, &[rows], &positions, "pos").unwrap();
        let it = Tensor::from_u32(&ctx, &[rows], &kv_index, "kv index").unwrap();
        let bt = Tensor::from_f32(&ctx, &[stride], &bias, "bias").unwrap();
        let qkv = Tensor::from_f32(&ctx, &[rows, stride], &x, "qkv").unwrap();
        let k = Tensor::zeros(&ctx, DType::F32, &[rows, kv_w], "k").unwrap();
        let v = Tensor::zeros(&ctx, DType::F32, &[rows, kv_w], "v").unwrap();
        let shape = QkvShape {
            rows,
            n_heads: heads,
            n_kv_heads: kv_heads,
            head_dim: hd,
            max_pos,
        };
        let mut step = StepEncoder::new(&ctx, "rope_qkv wide");
        ew::rope_qkv(&mut step, &qkv, &pt, &tt, &it, &k, &v, Some(&bt), shape).unwrap();
        step.submit().unwrap();

        let biased: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, &a)| a + bias[i % stride])
            .collect();
        let rotated = oracle::rope(&biased, stride, 0, heads + kv_heads, hd, &positions, theta);
        let got_q = qkv.read_f32(&ctx).unwrap();
        let (mut want_q, mut got_q_cols) = (Vec::new(), Vec::new());
        let (mut want_k, mut want_v) = (vec![0.0; rows * kv_w], vec![0.0; rows * kv_w]);
        for (r, &at) in kv_index.iter().enumerate() {
            let row = &rotated[r * stride..(r + 1) * stride];
            want_q.extend_from_slice(&row[..heads * hd]);
            got_q_cols.extend_from_slice(&got_q[r * stride..r * stride + heads * hd]);
            let at = at as usize * kv_w;
            want_k[at..at + kv_w].copy_from_slice(&row[heads * hd..(heads + kv_heads) * hd]);
            let v_cols = r * stride + (heads + kv_heads) * hd;
            want_v[at..at + kv_w].copy_from_slice(&biased[v_cols..v_cols + kv_w]);
        }
        assert_close(
            &format!("rope_qkv q hd={hd}"),
            &got_q_cols,
            &want_q,
            F32_TOL,
        );
        let got_k = k.read_f32(&ctx).unwrap();
        assert_close(&format!("rope_qkv k hd={hd}"), &got_k, &want_k, F32_TOL);
        assert_eq!(
            v.read_f32(&ctx).unwrap(),
            want_v,
            "v hd={hd}: biased, at kv_index"
        );
    }
}

/// RoPE + K/V into the arena with an f16 arena: every arena value is exactly the f32
/// arena's value rounded to f16 (the same kernel math, words written two halves at a time),
/// q is rotated exactly as with the f32 arena, rows land at `kv_index`, and an arena row no
/// computed row maps to stays zero. GQA 6/2 heads of 12, with a bias; head_dim 6 (not a
/// multiple of 4) is refused for f16 with a shape error.
#[test]
fn rope_qkv_into_an_f16_arena_rounds_the_f32_values() {
    use ew::QkvShape;
    let ctx = ctx();
    let (rows, heads, kv_heads, hd, max_pos) = (5, 6, 2, 12, 64);
    let stride = (heads + 2 * kv_heads) * hd;
    let kv_w = kv_heads * hd;
    let arena_rows = 8;
    let x = random_vec(41, rows * stride, 2.0);
    let bias = random_vec(42, stride, 0.5);
    let positions: Vec<u32> = vec![3, 17, 0, 63, 40];
    let kv_index: Vec<u32> = vec![7, 0, 2, 5, 1];
    let table = ew::rope_table(10_000.0, hd, max_pos);
    let tt = Tensor::from_f32(&ctx, &[max_pos, hd], &table, "table").unwrap();
    let pt = Tensor::from_u32(&ctx, &[rows], &positions, "pos").unwrap();
    let it = Tensor::from_u32(&ctx, &[rows], &kv_index, "kv index").unwrap();
    let bt = Tensor::from_f32(&ctx, &[stride], &bias, "bias").unwrap();
    let shape = QkvShape {
        rows,
        n_heads: heads,
        n_kv_heads: kv_heads,
        head_dim: hd,
        max_pos,
    };
    let run = |dtype: DType| {
        let qkv = Tensor::from_f32(&ctx, &[rows, stride], &x, "qkv").unwrap();
        let k = Tensor::zeros(&ctx, dtype, &[arena_rows, kv_w], "k").unwrap();
        let v = Tensor::zeros(&ctx, dtype, &[arena_rows, kv_w], "v").unwrap();
        let mut step = StepEncoder::new(&ctx, "rope_qkv");
        ew::rope_qkv(&mut step, &qkv, &pt, &tt, &it, &k, &v, Some(&bt), shape).unwrap();
        step.submit().unwrap();
        (
            qkv.read_f32(&ctx).unwrap(),
            k.read_values(&ctx).unwrap(),
            v.read_values(&ctx).unwrap(),
        )
    };
    let (q32, k32, v32) = run(DType::F32);
    let (q16, k16, v16) = run(DType::F16);
    let round =
        |a: &[f32]| -> Vec<f32> { a.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect() };
    assert_eq!(q16, q32, "q is rotated alike whatever the arena holds");
    assert_eq!(k16, round(&k32), "k: the f32 values rounded to f16");
    assert_eq!(v16, round(&v32), "v: the f32 values rounded to f16");
    // v rows are the biased v columns, at kv_index.
    for (r, &at) in kv_index.iter().enumerate() {
        let src = r * stride + (heads + kv_heads) * hd;
        for c in 0..kv_w {
            assert_eq!(
                v32[at as usize * kv_w + c],
                x[src + c] + bias[(heads + kv_heads) * hd + c]
            );
        }
    }
    // Arena rows 3, 4 and 6 receive nothing.
    for row in [3, 4, 6] {
        assert!(k16[row * kv_w..(row + 1) * kv_w].iter().all(|&v| v == 0.0));
    }
    eprintln!("[path] rope_qkv into f32 and f16 arenas: f16 = f32 rounded, {rows} rows");

    // f16 arenas need head_dim % 4 == 0 (a word holds two neighbouring rotated pairs).
    let hd6 = QkvShape {
        head_dim: 6,
        max_pos: 8,
        ..shape
    };
    let qkv = Tensor::zeros(&ctx, DType::F32, &[rows, (heads + 2 * kv_heads) * 6], "q").unwrap();
    let t6 = Tensor::zeros(&ctx, DType::F32, &[8, 6], "t").unwrap();
    let k = Tensor::zeros(&ctx, DType::F16, &[8, kv_heads * 6], "k").unwrap();
    let v = Tensor::zeros(&ctx, DType::F16, &[8, kv_heads * 6], "v").unwrap();
    let mut step = StepEncoder::new(&ctx, "rope_qkv hd6");
    let err = ew::rope_qkv(&mut step, &qkv, &pt, &t6, &it, &k, &v, None, hd6).unwrap_err();
    assert!(err.to_string().contains("multiple of 4"), "{err}");
    // Mixed storage is refused too.
    let v32 = Tensor::zeros(&ctx, DType::F32, &[arena_rows, kv_w], "v32").unwrap();
    let k16 = Tensor::zeros(&ctx, DType::F16, &[arena_rows, kv_w], "k16").unwrap();
    let qkv = Tensor::from_f32(&ctx, &[rows, stride], &x, "qkv").unwrap();
    let err = ew::rope_qkv(&mut step, &qkv, &pt, &tt, &it, &k16, &v32, None, shape).unwrap_err();
    assert!(err.to_string().contains("both f16"), "{err}");
}

/// `t` read back equals `want` within the f32 tolerance.
fn assert_tensor(ctx: &unmask_gpu::GpuContext, what: &str, t: &Tensor, want: &[f32]) {
    assert_close(what, &t.read_f32(ctx).unwrap(), want, F32_TOL);
}

/// dLLM-Cache's V-verify: the cosine of each row's new V (its QKV row's V columns) against
/// the V its arena row holds, and the k rows of lowest cosine as a row list in row order,
/// against the CPU; with an f32 and an f16 V arena.
#[test]
fn v_verify_picks_the_rows_whose_v_moved_most() {
    use unmask_gpu::ops::v_verify::{QkvLayout, VVerify, VerifyBuffers, VerifyRows};
    let ctx = ctx();
    let layout = QkvLayout {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
    };
    let (rows, k) = (37, 9);
    let stride = (4 + 2 * 2) * 8;
    let kv_w = 2 * 8;
    let v_col = (4 + 2) * 8;
    let arena_len = 50;
    // Cached V: random; new V: the cached one plus noise of growing size per row (shuffled).
    let cached = random_vec(3, arena_len * kv_w, 1.0);
    let arena_rows: Vec<u32> = (0..rows as u32)
        .map(|r| (r * 7 + 3) % arena_len as u32)
        .collect();
    let mut qkv = random_vec(4, rows * stride, 1.0);
    let noise = random_vec(5, rows * kv_w, 1.0);
    for r in 0..rows {
        let scale = ((r * 13) % rows) as f32 / rows as f32;
        for c in 0..kv_w {
            let old = cached[arena_rows[r] as usize * kv_w + c];
            qkv[r * stride + v_col + c] = old + scale * noise[r * kv_w + c];
        }
    }
    let cos: Vec<f64> = (0..rows)
        .map(|r| {
            let a = &qkv[r * stride + v_col..r * stride + v_col + kv_w];
            let o = arena_rows[r] as usize * kv_w;
            let b = &cached[o..o + kv_w];
            let dot: f64 = a
                .iter()
                .zip(b)
                .map(|(x, y)| (*x as f64) * (*y as f64))
                .sum();
            let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            dot / (na * nb)
        })
        .collect();
    // Rows 5..9 are computed anyway (a pinned block): never picked.
    let skip = 5..9;
    let mut order: Vec<usize> = (0..rows).filter(|r| !skip.contains(r)).collect();
    order.sort_by(|&i, &j| cos[i].total_cmp(&cos[j]).then(i.cmp(&j)));
    let mut want: Vec<u32> = order[..k].iter().map(|&r| r as u32).collect();
    want.sort_unstable();
    let qkv_t = Tensor::from_f32(&ctx, &[rows, stride], &qkv, "qkv").unwrap();
    let rows_t = Tensor::from_u32(&ctx, &[rows], &arena_rows, "arena rows").unwrap();
    for (what, v) in [
        (
            "f32",
            Tensor::from_f32(&ctx, &[arena_len, kv_w], &cached, "v").unwrap(),
        ),
        (
            "f16",
            Tensor::from_f32_as_f16(&ctx, &[arena_len, kv_w], &cached, "v").unwrap(),
        ),
    ] {
        let verify = VVerify::new(&ctx, 64).unwrap();
        // The list's first slots belong to rows the step computes anyway.
        let base = 3;
        let list_t = Tensor::zeros(&ctx, DType::U32, &[base + k], "list").unwrap();
        let mut step = StepEncoder::new(&ctx, "v-verify");
        let buffers = VerifyBuffers {
            qkv: &qkv_t,
            bias: None,
            v: &v,
            arena_rows: &rows_t,
            list: &list_t,
        };
        let checked = VerifyRows {
            row0: 0,
            rows,
            k,
            list_base: base,
            most_similar: false,
            skip: skip.clone(),
        };
        verify.encode(&mut step, buffers, checked, layout).unwrap();
        step.submit().unwrap();
        let got_cos = verify.cosine.read_f32(&ctx).unwrap();
        let tol = if what == "f16" { 2e-3 } else { 1e-5 };
        for r in 0..rows {
            assert!((got_cos[r] as f64 - cos[r]).abs() < tol, "{what} row {r}");
        }
        let list = list_t.read_u32(&ctx).unwrap();
        assert_eq!(
            &list[base..],
            &want[..],
            "{what}: the rows of lowest cosine"
        );
        let selected = verify.selected.read_u32(&ctx).unwrap();
        assert_eq!(selected[..rows].iter().sum::<u32>(), k as u32);
        // The V cache then holds every row's new V.
        let stored = pollster::block_on(v.read_values_async(&ctx, arena_len * kv_w)).unwrap();
        for r in 0..rows {
            let o = arena_rows[r] as usize * kv_w;
            for c in 0..kv_w {
                let (got, new) = (stored[o + c], qkv[r * stride + v_col + c]);
                let tol = if what == "f16" {
                    2e-3 * new.abs().max(1.0)
                } else {
                    0.0
                };
                assert!(
                    (got - new).abs() <= tol,
                    "{what} row {r} col {c}: {got} != {new}"
                );
            }
        }
    }
}
