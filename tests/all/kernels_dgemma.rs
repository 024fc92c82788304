//! DiffusionGemma's own kernels against the host: the per-head norm with RoPE, the
//! soft-embedding product in every weight format, the sampler's row statistics and the f16
//! packing of K/V rows (its attention masks are `kernels_attention_mask`'s).

use unmask_gpu::ops::elementwise::{pack_f16_rows, rope_table};
use unmask_gpu::ops::heads::{HeadLayout, Rotation, head_norm_rope, rope_table_partial};
use unmask_gpu::ops::soft_embed::soft_embed;
use unmask_gpu::{DType, StepEncoder, Tensor, Weight, WeightFormat};

use crate::common::{self, assert_close, random_vec};

#[test]
fn head_norm_with_rope_matches_the_host() {
    let ctx = common::ctx();
    let (rows, heads, hd, stride, col) = (5, 3, 32, 3 * 32 + 8, 8);
    let x = random_vec(7, rows * stride, 2.0);
    let w = random_vec(8, hd, 1.0);
    let positions: Vec<u32> = vec![0, 3, 9, 17, 30];
    let table = rope_table_partial(1e6, hd, 4, 32);
    let tx = Tensor::from_f32(&ctx, &[rows, stride], &x, "x").unwrap();
    let tw = Tensor::from_f32(&ctx, &[hd], &w, "w").unwrap();
    let tp = Tensor::from_u32(&ctx, &[rows], &positions, "positions").unwrap();
    let tt = Tensor::from_f32(&ctx, &[32, hd], &table, "table").unwrap();
    let layout = HeadLayout {
        rows,
        heads,
        head_dim: hd,
        row_stride: stride,
        col_offset: col,
    };
    let mut step = StepEncoder::new(&ctx, "head norm test");
    let rotation = Rotation {
        positions: &tp,
        table: &tt,
        max_pos: 32,
    };
    head_norm_rope(&mut step, &tx, &tw, Some(rotation), layout, 1e-6).unwrap();
    step.submit().unwrap();
    let got = tx.read_f32(&ctx).unwrap();
    let mut want = x.clone();
    let half = hd / 2;
    for r in 0..rows {
        for h in 0..heads {
            let b = r * stride + col + h * hd;
            let ms: f64 = x[b..b + hd]
                .iter()
                .map(|&v| (v as f64).powi(2))
                .sum::<f64>()
                / hd as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            let n: Vec<f64> = (0..hd)
                .map(|c| x[b + c] as f64 * inv * w[c] as f64)
                .collect();
            for j in 0..half {
                let (cos, sin) = (
                    table[(positions[r] as usize * half + j) * 2] as f64,
                    table[(positions[r] as usize * half + j) * 2 + 1] as f64,
                );
                want[b + j] = (n[j] * cos - n[j + half] * sin) as f32;
                want[b + j + half] = (n[j + half] * cos + n[j] * sin) as f32;
            }
        }
    }
    assert_close("head norm + partial RoPE", &got, &want, 1e-5);
    // The columns before the heads are untouched; pairs past the rotated four only normed.
    assert_eq!(got[..col], x[..col]);
    assert_eq!(
        rope_table_partial(10_000.0, hd, half, 4),
        rope_table(10_000.0, hd, 4)
    );
}

#[test]
fn soft_embedding_matches_the_oracle_in_every_format() {
    let ctx = common::ctx();
    let (rows, vocab, d) = (9, 70, 48);
    let table = random_vec(21, vocab * d, 0.5);
    // Rows of a distribution: positive, summing to 1.
    let raw = random_vec(22, rows * vocab, 3.0);
    let mut probs = Vec::new();
    for row in raw.chunks(vocab) {
        let e: Vec<f32> = row.iter().map(|x| x.exp()).collect();
        let s: f32 = e.iter().sum();
        probs.extend(e.iter().map(|x| x / s));
    }
    let scale = 6.5;
    let mut want = vec![0f32; rows * d];
    for r in 0..rows {
        for c in 0..d {
            let acc: f64 = (0..vocab)
                .map(|v| probs[r * vocab + v] as f64 * table[v * d + c] as f64)
                .sum();
            want[r * d + c] = (acc * scale as f64) as f32;
        }
    }
    let tp = Tensor::from_f32(&ctx, &[rows, vocab], &probs, "probs").unwrap();
    for (format, tol) in [
        (WeightFormat::F32, 1e-6),
        (WeightFormat::F16Packed, 2e-3),
        (WeightFormat::F16Native, 2e-3),
        (WeightFormat::Q8, 3e-2),
        (WeightFormat::Q4, 3e-1),
    ] {
        let w = Weight::from_f32(&ctx, vocab, d, &table, format, "table").unwrap();
        let out = Tensor::zeros(&ctx, DType::F32, &[rows, d], "out").unwrap();
        let mut step = StepEncoder::new(&ctx, "soft embed test");
        soft_embed(&mut step, &tp, &w, &out, rows, scale).unwrap();
        step.submit().unwrap();
        let got = out.read_f32(&ctx).unwrap();
        assert_close(
            &format!("soft embedding {}", w.format.name()),
            &got,
            &want,
            tol,
        );
    }
}

/// The sampler's row statistics on the GPU against the host: argmax (first index on ties),
/// entropy and softmax of the temperature-scaled logits, the drawn token of the Gumbel-max
/// stream `hash4(seed, step, row, token)` — the same token the host finds from the same
/// stream — reproducible for a seed and step, moving with either; and the argmax's
/// log-probability under the untempered softmax, at any temperature.
#[test]
fn denoise_rows_match_the_host() {
    use unmask_core::rng::{hash4, uniform_open};
    use unmask_gpu::ops::denoise::{DrawStream, STATS_WORDS, denoise_rows, parse_stats};
    let ctx = common::ctx();
    let (rows, vocab, temperature) = (6, 300, 0.7f32);
    let mut logits = random_vec(31, rows * vocab, 8.0);
    // Row 0: a tie for the largest at 5 and 9 (argmax 5); row 1: one dominant logit.
    logits[5] = 20.0;
    logits[9] = 20.0;
    logits[vocab + 123] = 60.0;
    let tl = Tensor::from_f32(&ctx, &[rows, vocab], &logits, "logits").unwrap();
    let probs = Tensor::zeros(&ctx, DType::F32, &[rows, vocab], "probs").unwrap();
    let stats = Tensor::zeros(&ctx, DType::U32, &[rows, STATS_WORDS], "stats").unwrap();
    let run = |seed: u64, step: u32| {
        let mut enc = StepEncoder::new(&ctx, "denoise rows test");
        let draws = DrawStream { seed, step };
        denoise_rows(
            &mut enc,
            &tl,
            &probs,
            true,
            &stats,
            (rows, vocab),
            temperature,
            draws,
        )
        .unwrap();
        enc.submit().unwrap();
        parse_stats(&stats.read_u32(&ctx).unwrap())
    };
    let got = run(42, 3);
    let got_probs = probs.read_f32(&ctx).unwrap();
    let mut want_probs = Vec::new();
    for (r, row) in logits.chunks(vocab).enumerate() {
        let z: Vec<f64> = row.iter().map(|&x| (x / temperature) as f64).collect();
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = z.iter().map(|v| (v - max).exp()).sum();
        let p: Vec<f64> = z.iter().map(|v| (v - max).exp() / sum).collect();
        let entropy: f64 = -p
            .iter()
            .zip(&z)
            .map(|(p, v)| {
                if *p > 0.0 {
                    p * (v - max - sum.ln())
                } else {
                    0.0
                }
            })
            .sum::<f64>();
        let argmax = z
            .iter()
            .enumerate()
            .fold(0, |b, (i, &v)| if v > z[b] { i } else { b });
        assert_eq!(got[r].argmax as usize, argmax, "row {r}: argmax");
        // The model's own log-probability of the argmax: softmax(x), not softmax(x / T).
        let x_max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
        let lse = x_max
            + row
                .iter()
                .map(|&x| (x as f64 - x_max).exp())
                .sum::<f64>()
                .ln();
        let logprob = row[argmax] as f64 - lse;
        assert!(
            (got[r].logprob as f64 - logprob).abs() < 1e-5 * logprob.abs().max(1.0),
            "row {r}: log-probability {} vs {logprob}",
            got[r].logprob
        );
        assert!(
            (got[r].entropy as f64 - entropy).abs() < 1e-5,
            "row {r}: entropy {} vs {entropy}",
            got[r].entropy
        );
        let gumbel = |v: usize| {
            let u = uniform_open(hash4(42, 0, 3, r as u32, v as u32)) as f64;
            z[v] - (-u.ln()).ln()
        };
        let drawn = (0..vocab).fold(0, |b, v| if gumbel(v) > gumbel(b) { v } else { b });
        assert_eq!(
            got[r].sampled as usize, drawn,
            "row {r}: the host's draw from the same stream"
        );
        want_probs.extend(p.iter().map(|&x| x as f32));
    }
    assert_eq!(got[0].argmax, 5, "ties go to the first index");
    assert_eq!(got[1].sampled, 123, "a dominant token is drawn");
    assert_close("denoise_rows softmax", &got_probs, &want_probs, 1e-5);
    assert_eq!(run(42, 3), got, "same seed and step, same draws");
    let other = run(42, 4);
    assert!(
        other.iter().zip(&got).any(|(a, b)| a.sampled != b.sampled),
        "another step draws anew"
    );
    assert!(other.iter().zip(&got).all(|(a, b)| a.argmax == b.argmax));
    // At T = 1 the model's softmax is the step's: its sum is taken once.
    let mut enc = StepEncoder::new(&ctx, "denoise rows at T = 1");
    let draws = DrawStream { seed: 42, step: 3 };
    denoise_rows(
        &mut enc,
        &tl,
        &probs,
        false,
        &stats,
        (rows, vocab),
        1.0,
        draws,
    )
    .unwrap();
    enc.submit().unwrap();
    let at_one = parse_stats(&stats.read_u32(&ctx).unwrap());
    for (r, (a, b)) in at_one.iter().zip(&got).enumerate() {
        assert_eq!(
            a.argmax, b.argmax,
            "row {r}: the argmax does not move with T"
        );
        assert!(
            (a.logprob - b.logprob).abs() <= 1e-5 * b.logprob.abs().max(1.0),
            "row {r}: log-probability at T = 1 {} vs at T = {temperature} {}",
            a.logprob,
            b.logprob
        );
    }
}

/// f32 rows rounded to f16 into rows `dst_row..` of an f16 tensor: each value as the host
/// rounds it (nearest, ties to even), the rows around untouched, a window of wider rows read.
#[test]
fn k_v_rows_pack_into_f16_as_the_host_rounds() {
    let ctx = common::ctx();
    let (rows, cols, src_stride, dst_rows) = (5, 12, 16, 9);
    let mut x = random_vec(21, rows * src_stride, 3.0);
    // Values f16 cannot hold exactly, a tie and an overflow.
    x[0] = 1.0 / 3.0;
    x[1] = 1.0 + 1.0 / 2048.0;
    x[2] = 70_000.0;
    let src = Tensor::from_f32(&ctx, &[rows, src_stride], &x, "src").unwrap();
    let dst = Tensor::zeros(&ctx, DType::F16, &[dst_rows, cols], "dst").unwrap();
    let mut step = StepEncoder::new(&ctx, "pack f16 test");
    pack_f16_rows(&mut step, &src, src_stride, &dst, cols, 3, (rows, cols)).unwrap();
    step.submit().unwrap();
    let got = dst.read_values(&ctx).unwrap();
    for r in 0..dst_rows {
        for c in 0..cols {
            let want = if (3..3 + rows).contains(&r) {
                half::f16::from_f32(x[(r - 3) * src_stride + c]).to_f32()
            } else {
                0.0
            };
            let g = got[r * cols + c];
            assert!(
                g == want || (g.is_infinite() && want.is_infinite()),
                "row {r}, col {c}: {g} vs {want}"
            );
        }
    }
    // An odd width, or a destination too short, is refused by name.
    let mut step = StepEncoder::new(&ctx, "pack f16 refusals");
    let e = pack_f16_rows(&mut step, &src, src_stride, &dst, cols, 0, (rows, 11)).unwrap_err();
    assert!(e.to_string().contains("pack_f16"), "{e}");
    assert!(pack_f16_rows(&mut step, &src, src_stride, &dst, cols, 5, (rows, cols)).is_err());
}
