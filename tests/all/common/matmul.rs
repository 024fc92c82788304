//! Helpers of the matmul kernel tests: the kernels and shapes every test covers, the weight
//! formats this device has with their bounds, which kernels round to f16 here, and one
//! matmul run with sentinel rows past M.

use crate::common;

use unmask_core::quant::{self, QuantFormat};
use unmask_gpu::ops::matmul::{MatmulKernel, coop_shape, matmul};
use unmask_gpu::{GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

pub const KERNELS: [MatmulKernel; 9] = [
    MatmulKernel::Naive,
    MatmulKernel::Tiled,
    MatmulKernel::TiledShared,
    MatmulKernel::Gemm,
    MatmulKernel::GemmF16,
    MatmulKernel::Narrow,
    MatmulKernel::Coop,
    MatmulKernel::CoopSplit,
    MatmulKernel::Auto,
];

/// (M, N, K): tiles are 16 x 16 (naive), 32 x 32 (tiled), 64 x 64 x 16 (shared), 128 x 128
/// x 8|16 (gemm), 32 x 16 x 64 (narrow); K % 4 takes every value so both the vec4-x and the
/// scalar-x paths run, with every tail length; M = 1, 63 and 65 sit at the small-M edge.
pub const SHAPES: [(usize, usize, usize); 11] = [
    (1, 1, 1),
    (5, 7, 13),
    (3, 9, 6),
    (2, 33, 7),
    (33, 65, 64),
    (64, 128, 96),
    (17, 300, 130),
    (70, 40, 36),
    (1, 150, 40),
    (63, 37, 70),
    (65, 131, 33),
];

pub fn formats(ctx: &GpuContext) -> Vec<WeightFormat> {
    let mut f = vec![WeightFormat::F32, WeightFormat::F16Packed];
    if ctx.features.shader_f16 {
        f.push(WeightFormat::F16Native);
    } else {
        eprintln!("[path] no shader-f16 on this device: native f16 weights not tested");
    }
    f
}

pub fn tolerance(format: WeightFormat) -> f64 {
    match format {
        WeightFormat::F32 => 1e-4,
        // Error of storing the weights in f16, measured against the exact f32 weights.
        WeightFormat::F16Packed | WeightFormat::F16Native => 1e-2,
        WeightFormat::Q8 | WeightFormat::Q4 => unreachable!("tested in kernels_quant.rs"),
    }
}

/// Whether `kernel` rounds its inputs to f16 here (`gemm-f16` with shader-f16, `coop` with
/// cooperative matrices).
pub fn f16_arithmetic(ctx: &GpuContext, kernel: MatmulKernel) -> bool {
    matches!(
        kernel.plan(ctx, 1, WeightFormat::F32).0,
        MatmulKernel::GemmF16 | MatmulKernel::Coop | MatmulKernel::CoopSplit
    )
}

/// The f16-arithmetic GEMM rounds x and W to f16 (2^-11 relative) and sums 8 or 16 products
/// in f16 before adding them in f32: about 1e-3 of the largest output on these shapes, so
/// it is held to the f16-storage bound; a wrong index or scale is off by O(1).
pub fn kernel_tolerance(ctx: &GpuContext, kernel: MatmulKernel, tol: f64) -> f64 {
    if f16_arithmetic(ctx, kernel) {
        tol.max(1e-2)
    } else {
        tol
    }
}

/// Says which paths `gemm-f16` and `coop` take on this device.
pub fn print_f16_path(ctx: &GpuContext) {
    eprintln!(
        "[path] gemm-f16 runs {}",
        if f16_arithmetic(ctx, MatmulKernel::GemmF16) {
            "f16 arithmetic (shader-f16)"
        } else {
            "the f32 gemm (no shader-f16)"
        }
    );
    let coop = MatmulKernel::Coop.plan(ctx, 1, WeightFormat::F32).0;
    match coop_shape(ctx) {
        Some(shape) => {
            assert_eq!(coop, MatmulKernel::Coop);
            if let Some(side) = common::coop_fragment() {
                assert_eq!(shape.fragment, side, "UNMASK_COOP_FRAGMENT");
            }
            eprintln!(
                "[path] coop runs cooperative matrices ({0}x{0} fragments, subgroup size {1}, \
                 {2}-deep k-tiles)",
                shape.fragment, shape.subgroup, shape.k_depth
            );
        }
        None => {
            assert!(
                common::coop_fragment().is_none(),
                "UNMASK_COOP_FRAGMENT is set but this adapter runs no cooperative matrices"
            );
            assert_eq!(coop, MatmulKernel::Gemm);
            eprintln!(
                "[path] coop runs the f32 gemm (no cooperative matrices: {})",
                if ctx.features.cooperative_configs.is_empty() {
                    "the adapter reports none".to_string()
                } else {
                    format!("{:?}", ctx.features.cooperative_configs)
                }
            );
        }
    }
}

/// Runs one matmul with `x` and `y` allocated `extra` rows bigger than `m`; checks that the
/// extra rows of `y` keep their sentinel and returns the first `m` rows.
pub fn run(
    ctx: &GpuContext,
    x: &[f32],
    w: &Weight,
    m: usize,
    extra: usize,
    kernel: MatmulKernel,
) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let mut x_full = x.to_vec();
    x_full.extend(common::random_vec(99, extra * k, 1.0));
    let xt = Tensor::from_f32(ctx, &[m + extra, k], &x_full, "x").expect("x");
    let sentinel = vec![-7.25f32; (m + extra) * n];
    let yt = Tensor::from_f32(ctx, &[m + extra, n], &sentinel, "y").expect("y");
    let mut step = StepEncoder::new(ctx, "matmul test");
    matmul(&mut step, &xt, w, &yt, m, kernel).expect("matmul");
    step.submit().expect("submit");
    let got = yt.read_f32(ctx).expect("read y");
    assert!(
        got[m * n..].iter().all(|v| *v == -7.25),
        "{}: rows past m were written",
        kernel.name()
    );
    got[..m * n].to_vec()
}

/// The weights after a round trip through the quantizer: what the kernels should see.
pub fn dequantized(format: QuantFormat, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut codes = vec![0u8; rows * format.row_code_bytes(cols)];
    let mut scales = vec![0u8; rows * quant::row_scale_bytes(cols)];
    format
        .quantize_rows(w, cols, &mut codes, &mut scales)
        .expect("quantize");
    format.dequantize_rows(&codes, &scales, rows, cols)
}
