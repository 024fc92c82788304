//! The fused matmul forms against the f64 CPU oracle: RMSNorm in front, SwiGLU of a
//! gate|up pair and a residual behind, with every kernel and format, their pairing with the
//! weights checked, and `coop-split`'s slices of K with every fusion.

use crate::common;
use crate::common::matmul::*;

use unmask_core::oracle::matmul::matmul_xwt;
use unmask_gpu::ops::matmul::{MatmulKernel, coop_shape, matmul};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

/// The host reference of the fused forms: RMSNorm of x (weight g) in front, SwiGLU of a
/// gate|up pair behind, a residual added.
fn fused_oracle(
    x: &[f32],
    m: usize,
    k: usize,
    norm: Option<&[f32]>,
    gate: &[f32],
    up: Option<&[f32]>,
    residual: Option<&[f32]>,
) -> Vec<f32> {
    let eps = 1e-5f64;
    let xn: Vec<f32> = match norm {
        Some(g) => x
            .chunks(k)
            .flat_map(|row| {
                let ms = row
                    .iter()
                    .map(|&v| f64::from(v) * f64::from(v))
                    .sum::<f64>()
                    / k as f64;
                let inv = 1.0 / (ms + eps).sqrt();
                row.iter()
                    .zip(g)
                    .map(move |(&v, &w)| (f64::from(v) * inv * f64::from(w)) as f32)
                    .collect::<Vec<_>>()
            })
            .collect(),
        None => x.to_vec(),
    };
    let n = gate.len() / k;
    let mut y = matmul_xwt(&xn, gate, m, n, k);
    if let Some(up) = up {
        let u = matmul_xwt(&xn, up, m, n, k);
        for (g, u) in y.iter_mut().zip(u) {
            let gv = f64::from(*g);
            *g = (gv / (1.0 + (-gv).exp()) * f64::from(u)) as f32;
        }
    }
    if let Some(r) = residual {
        for (v, r) in y.iter_mut().zip(r) {
            *v += r;
        }
    }
    y
}

/// One fused matmul problem: host x `[m, k]`, norm weight g, gate and up rows `[n, k]` and
/// the residual y `[m, n]` (seeds `seed + 1 ..= seed + 5`).
struct FusedCase {
    m: usize,
    n: usize,
    k: usize,
    x: Vec<f32>,
    g: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    resid: Vec<f32>,
}

impl FusedCase {
    fn new(seed: u64, m: usize, n: usize, k: usize) -> Self {
        FusedCase {
            m,
            n,
            k,
            x: common::random_vec(seed + 1, m * k, 1.0),
            g: common::random_vec(seed + 2, k, 1.0),
            gate: common::random_vec(seed + 3, n * k, 0.3),
            up: common::random_vec(seed + 4, n * k, 0.3),
            resid: common::random_vec(seed + 5, m * n, 1.0),
        }
    }

    /// The gate|up pair and the gate rows alone, stored in `format`.
    fn weights(&self, ctx: &GpuContext, format: WeightFormat) -> (Weight, Weight) {
        let (n, k) = (self.n, self.k);
        let pair = Weight::zeros_paired(ctx, n, k, format, "gate_up").unwrap();
        pair.write_rows_f32(ctx, 0, &self.gate).unwrap();
        pair.write_rows_f32(ctx, n, &self.up).unwrap();
        let plain = Weight::from_f32(ctx, n, k, &self.gate, format, "gate").unwrap();
        (pair, plain)
    }

    /// y after `kernel` with the fusions (norm, residual, swiglu) over `weights`, y starting
    /// as the residual; x and g as uploaded in `xt`, `gt`.
    fn run(
        &self,
        ctx: &GpuContext,
        (xt, gt): (&Tensor, &Tensor),
        (pair, plain): (&Weight, &Weight),
        kernel: MatmulKernel,
        (norm, residual, swiglu): (bool, bool, bool),
    ) -> Vec<f32> {
        use unmask_gpu::ops::matmul::{Fusion, matmul_fused};
        let yt = Tensor::from_f32(ctx, &[self.m, self.n], &self.resid, "y").unwrap();
        let mut step = StepEncoder::new(ctx, "fused test");
        let fusion = Fusion {
            norm: norm.then_some((gt, 1e-5)),
            residual,
            swiglu,
        };
        let w = if swiglu { pair } else { plain };
        matmul_fused(&mut step, xt, w, &yt, self.m, kernel, fusion).unwrap();
        step.submit().unwrap();
        yt.read_f32(ctx).unwrap()
    }

    /// The oracle of the same fusions, on the gate and up rows as the format stores them.
    fn want(
        &self,
        gate: &[f32],
        up: &[f32],
        (norm, residual, swiglu): (bool, bool, bool),
    ) -> Vec<f32> {
        fused_oracle(
            &self.x,
            self.m,
            self.k,
            norm.then_some(&self.g[..]),
            gate,
            swiglu.then_some(up),
            residual.then_some(&self.resid[..]),
        )
    }
}

#[test]
fn fused_norm_residual_and_swiglu_match_the_oracle() {
    // A binding limit of 16 KiB splits every paired weight over several chunks (gate and
    // up rows of the same columns stay together), and the plain ones too.
    let probe_ctx = common::ctx();
    for limit in [None, Some(16384u64)] {
        let ctx = match limit {
            Some(b) => common::ctx_with_binding_limit(b),
            None => common::ctx(),
        };
        let mut formats = formats(&ctx);
        formats.extend([WeightFormat::Q8, WeightFormat::Q4]);
        for &(m, n, k) in &[
            (3usize, 9usize, 12usize),
            (33, 70, 64),
            (5, 130, 13),
            (70, 40, 36),
            (65, 21, 32),
        ] {
            let case = FusedCase::new(0, m, n, k);
            let xt = Tensor::from_f32(&ctx, &[m, k], &case.x, "x").unwrap();
            let gt = Tensor::from_f32(&ctx, &[k], &case.g, "g").unwrap();
            for &format in &formats {
                // Quantized formats need whole blocks of 32 columns.
                if matches!(format, WeightFormat::Q8 | WeightFormat::Q4) && k % 32 != 0 {
                    continue;
                }
                // The weights as the format stores them, so only the kernel's error is left.
                let stored = |w: &[f32], rows: usize| -> Vec<f32> {
                    let ctx = &probe_ctx;
                    let t = Weight::from_f32(ctx, rows, k, w, format, "probe").unwrap();
                    let out = Tensor::zeros(ctx, DType::F32, &[k, rows], "probe y").unwrap();
                    let eye: Vec<f32> = (0..k * k)
                        .map(|i| if i / k == i % k { 1.0 } else { 0.0 })
                        .collect();
                    let it = Tensor::from_f32(ctx, &[k, k], &eye, "eye").unwrap();
                    let mut step = StepEncoder::new(ctx, "probe");
                    matmul(&mut step, &it, &t, &out, k, MatmulKernel::Naive).unwrap();
                    step.submit().unwrap();
                    let cols = out.read_f32(ctx).unwrap();
                    // out[i][r] = W[r][i]: transpose back to [rows, k].
                    (0..rows * k)
                        .map(|j| cols[(j % k) * rows + j / k])
                        .collect()
                };
                let (gate_s, up_s) = (stored(&case.gate, n), stored(&case.up, n));
                let (pair, plain) = case.weights(&ctx, format);
                if let Some(limit) = limit.filter(|&l| 2 * n as u64 * format.row_bytes(k) > l) {
                    assert!(
                        pair.chunks.len() > 1,
                        "{format:?} {n}x{k}: one chunk under a {limit}-byte binding"
                    );
                }
                let tol = match format {
                    WeightFormat::F32 => 1e-4,
                    _ => 1e-3,
                };
                for kernel in KERNELS {
                    // The new kernels share one decode path for all formats (`w_quad`),
                    // checked for every format by the tests above; here f32 and q4 (the
                    // hoisted scale) meet each fusion, which keeps shader compiles (most of
                    // this file's time on lavapipe) in bounds.
                    let new_kernel = matches!(
                        kernel,
                        MatmulKernel::Gemm
                            | MatmulKernel::GemmF16
                            | MatmulKernel::Narrow
                            | MatmulKernel::Coop
                            | MatmulKernel::CoopSplit
                    );
                    if new_kernel && !matches!(format, WeightFormat::F32 | WeightFormat::Q4) {
                        continue;
                    }
                    let cases: [(&str, bool, bool, bool); 4] = [
                        ("norm", true, false, false),
                        ("residual", false, true, false),
                        ("norm+swiglu", true, false, true),
                        ("swiglu", false, false, true),
                    ];
                    for (what, norm, residual, swiglu) in cases {
                        // Under the binding limit what is new is the paired gate|up chunking;
                        // the new kernels' other fusions over chunks add only compile time.
                        if new_kernel && limit.is_some() && !swiglu {
                            continue;
                        }
                        let flags = (norm, residual, swiglu);
                        let got = case.run(&ctx, (&xt, &gt), (&pair, &plain), kernel, flags);
                        let want = case.want(&gate_s, &up_s, flags);
                        common::assert_close(
                            &format!(
                                "{what} {} {format:?} m{m} n{n} k{k} limit {limit:?}",
                                kernel.name()
                            ),
                            &got,
                            &want,
                            kernel_tolerance(&ctx, kernel, tol),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn fusion_and_weight_pairing_must_agree() {
    use unmask_gpu::ops::matmul::{Fusion, matmul_fused};
    let ctx = common::ctx();
    let x = Tensor::from_f32(&ctx, &[2, 8], &[0.5; 16], "x").unwrap();
    let y = Tensor::zeros(&ctx, DType::F32, &[2, 8], "y").unwrap();
    let plain = Weight::from_f32(&ctx, 8, 8, &[0.1; 64], WeightFormat::F32, "w").unwrap();
    let pair = Weight::zeros_paired(&ctx, 8, 8, WeightFormat::F32, "pair").unwrap();
    let mut step = StepEncoder::new(&ctx, "bad fusion");
    let swiglu = Fusion {
        swiglu: true,
        ..Fusion::default()
    };
    let e = matmul_fused(&mut step, &x, &plain, &y, 2, MatmulKernel::Tiled, swiglu).unwrap_err();
    assert!(e.to_string().contains("paired"), "{e}");
    let e = matmul(&mut step, &x, &pair, &y, 2, MatmulKernel::Tiled).unwrap_err();
    assert!(e.to_string().contains("paired"), "{e}");
    let g = Tensor::from_f32(&ctx, &[7], &[1.0; 7], "g").unwrap();
    let norm = Fusion {
        norm: Some((&g, 1e-5)),
        ..Fusion::default()
    };
    let e = matmul_fused(&mut step, &x, &plain, &y, 2, MatmulKernel::Tiled, norm).unwrap_err();
    assert!(e.to_string().contains("norm weight of 8"), "{e}");
}

/// `coop-split` sums K in slices over several workgroups, then adds the slices and applies
/// the epilogue in a second pass. Shapes of few rows and long K split (one slice would leave
/// a large GPU idle); the uneven last slice, every fusion, quantized weights and chunked
/// weights (each chunk has its own scratch layout) against the oracle. Without cooperative
/// matrices it runs `narrow`, and says so.
#[test]
fn coop_split_sums_slices_of_k_with_every_fusion() {
    use unmask_gpu::ops::matmul::split_k_tiles;
    let ctx = common::ctx();
    let planned = MatmulKernel::CoopSplit.plan(&ctx, 1, WeightFormat::F32).0;
    let shape = coop_shape(&ctx);
    eprintln!(
        "[path] coop-split runs {}",
        match shape {
            Some(s) => format!("cooperative matrices ({0}x{0} fragments)", s.fragment),
            None => "narrow (no cooperative matrices)".to_string(),
        }
    );
    assert_eq!(
        planned,
        if shape.is_some() {
            MatmulKernel::CoopSplit
        } else {
            MatmulKernel::Narrow
        }
    );
    let chunked = common::ctx_with_binding_limit(16384);
    for (m, n, k) in [
        (1usize, 40usize, 320usize),
        (5, 70, 1000),
        (33, 130, 544),
        (63, 37, 257),
    ] {
        let case = FusedCase::new(30, m, n, k);
        if let Some(s) = shape {
            // The split this shape gets: several slices, the last one shorter where K does
            // not divide evenly.
            let (tm, tn) = s.tile_for_rows(m as u32);
            let tiles = (m as u32).div_ceil(tm) * (n as u32).div_ceil(tn);
            let k_tiles = (k as u32).div_ceil(s.k_depth);
            let per = split_k_tiles(tiles, k_tiles, u32::MAX);
            eprintln!(
                "[split] m={m} n={n} k={k}: {} slices of {per} k-tiles ({k_tiles} in all)",
                k_tiles.div_ceil(per)
            );
            assert!(k_tiles.div_ceil(per) > 1, "m={m} n={n} k={k} is not split");
        }
        // Chunked weights where x itself fits the 16 KiB binding.
        // f16 weights reach the tiles without a conversion; the others are decoded.
        let mut all = formats(&ctx);
        all.extend([WeightFormat::Q8, WeightFormat::Q4]);
        let mut runs = vec![(&ctx, &all[..])];
        if m * k * 4 <= 16384 {
            runs.push((&chunked, &[WeightFormat::F32][..]));
        }
        for (ctx, formats) in runs {
            let xt = Tensor::from_f32(ctx, &[m, k], &case.x, "x").unwrap();
            let gt = Tensor::from_f32(ctx, &[k], &case.g, "g").unwrap();
            for &format in formats {
                if format.quant().is_some() && k % 32 != 0 {
                    continue;
                }
                let (pair, plain) = case.weights(ctx, format);
                // Quantized weights are compared with the oracle on their dequantized values.
                let (gate_s, up_s) = match format.quant() {
                    Some(q) => (
                        dequantized(q, &case.gate, n, k),
                        dequantized(q, &case.up, n, k),
                    ),
                    None => (case.gate.clone(), case.up.clone()),
                };
                for (norm, residual, swiglu) in [
                    (false, false, false),
                    (true, false, false),
                    (false, true, false),
                    (true, true, true),
                    (false, false, true),
                ] {
                    let flags = (norm, residual, swiglu);
                    let got = case.run(
                        ctx,
                        (&xt, &gt),
                        (&pair, &plain),
                        MatmulKernel::CoopSplit,
                        flags,
                    );
                    let want = case.want(&gate_s, &up_s, flags);
                    common::assert_close(
                        &format!(
                            "coop-split {format:?} norm={norm} residual={residual} \
                             swiglu={swiglu} m{m} n{n} k{k} chunks {}",
                            if swiglu { &pair } else { &plain }.chunks.len()
                        ),
                        &got,
                        &want,
                        kernel_tolerance(
                            ctx,
                            MatmulKernel::CoopSplit,
                            if format.quant().is_some() {
                                1e-3
                            } else {
                                tolerance(format).max(1e-3)
                            },
                        ),
                    );
                }
            }
        }
    }
}
