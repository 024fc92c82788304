//! The matmul kernels by name: what each is for, where it runs, its tiles, and what `Auto`
//! picks without measuring.

use super::*;

/// Which matmul kernel to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum MatmulKernel {
    /// One output per invocation, scalar loads; the baseline.
    Naive,
    /// Register tiles (4 x 8 outputs per invocation), vec4 loads, no workgroup memory.
    Tiled,
    /// 64 x 64 output tiles staged through workgroup memory, 4 x 4 outputs per invocation.
    TiledShared,
    /// 128 x 128 output tiles, 8 x 8 outputs per invocation, double-buffered k-tiles: for
    /// M >= 64 on hardware GPUs.
    Gemm,
    /// `Gemm` with f16 tiles and f16 sums within a k-tile (f32 across them); `Gemm` where
    /// the device has no shader-f16. Never picked by `Auto`: f16 products overflow past
    /// 65504, which raw residual-stream activations can reach.
    GemmF16,
    /// 32 x 16 output tiles with K split over the workgroup's invocations: for M < 64, so
    /// the workgroup count follows N.
    Narrow,
    /// Tensor cores: 64 x 128 output tiles of 16 x 16 cooperative matrices (32 x 64 of
    /// 8 x 8 where the adapter offers only those), f16 inputs and f32 accumulators
    /// (`KernelFeatures::cooperative_matrix`); `Gemm` where the device has none.
    Coop,
    /// `Coop` with K split into slices when its tiles alone are too few to fill a large GPU
    /// (few rows: the cached steps' M = 32): one workgroup per tile and slice writes partial
    /// sums, a second pass adds them and applies the epilogue. `Narrow` where the device has
    /// no cooperative matrices.
    CoopSplit,
    /// `Narrow`'s tiles with integer dot products (`dot4I8Packed`) for q8 / q4 weights: x is
    /// quantized per row and 32-element block as it is staged, the weight codes are never
    /// converted to float. `Narrow` for float weights.
    NarrowDot,
    /// The best measured kernel for the device and shape.
    #[default]
    Auto,
}

impl MatmulKernel {
    /// Every concrete kernel (not `Auto`).
    pub const CONCRETE: [MatmulKernel; 9] = [
        MatmulKernel::Naive,
        MatmulKernel::Tiled,
        MatmulKernel::TiledShared,
        MatmulKernel::Gemm,
        MatmulKernel::GemmF16,
        MatmulKernel::Narrow,
        MatmulKernel::Coop,
        MatmulKernel::CoopSplit,
        MatmulKernel::NarrowDot,
    ];

    /// What `Auto` may choose among when it measures (`tune`): not the naive baseline, and
    /// not `GemmF16`, whose f16 products can overflow. `Coop` only where the device has
    /// cooperative matrices, `NarrowDot` only for quantized weights (`candidates`).
    pub const CANDIDATES: [MatmulKernel; 7] = [
        MatmulKernel::Tiled,
        MatmulKernel::TiledShared,
        MatmulKernel::Gemm,
        MatmulKernel::Narrow,
        MatmulKernel::Coop,
        MatmulKernel::CoopSplit,
        MatmulKernel::NarrowDot,
    ];

    /// The candidates `Auto` measures on this device for weights stored in `format`: those
    /// that run as themselves there (a fallback would only time another candidate again).
    pub fn candidates(ctx: &GpuContext, format: WeightFormat) -> Vec<MatmulKernel> {
        Self::CANDIDATES
            .into_iter()
            .filter(|&k| k.runs_on(ctx, format))
            .collect()
    }

    /// Whether this kernel runs as asked on the device for weights in `format`; where not,
    /// `plan` runs `fallback()` instead: `Gemm` for `GemmF16` without shader-f16 and for
    /// `Coop` without cooperative matrices, `Narrow` for `NarrowDot` with float weights
    /// (integer dot products need integer weight codes).
    pub fn runs_on(self, ctx: &GpuContext, format: WeightFormat) -> bool {
        match self {
            MatmulKernel::GemmF16 => ctx.features.shader_f16,
            MatmulKernel::Coop | MatmulKernel::CoopSplit => coop_shape(ctx).is_some(),
            MatmulKernel::NarrowDot => format.quant().is_some(),
            _ => true,
        }
    }

    /// What `plan` runs where this kernel does not run (`runs_on`).
    pub fn fallback(self) -> MatmulKernel {
        match self {
            MatmulKernel::NarrowDot | MatmulKernel::CoopSplit => MatmulKernel::Narrow,
            _ => MatmulKernel::Gemm,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MatmulKernel::Naive => "naive",
            MatmulKernel::Tiled => "tiled",
            MatmulKernel::TiledShared => "tiled-shared",
            MatmulKernel::Gemm => "gemm",
            MatmulKernel::GemmF16 => "gemm-f16",
            MatmulKernel::Narrow => "narrow",
            MatmulKernel::Coop => "coop",
            MatmulKernel::CoopSplit => "coop-split",
            MatmulKernel::NarrowDot => "narrow-dot",
            MatmulKernel::Auto => "auto",
        }
    }

    /// The concrete kernel and the weight decoding that run for `m` rows of a weight stored
    /// in `format` on this device. Explicit kernels run as asked where they can (`runs_on`;
    /// else their `fallback`), native f16 falls back to packed without shader-f16; `Auto`
    /// picks what measured fastest. Every kernel supports every fusion, so the choice never
    /// depends on it.
    pub fn plan(
        self,
        ctx: &GpuContext,
        m: usize,
        format: WeightFormat,
    ) -> (MatmulKernel, WeightFormat) {
        let format = format.resolve(ctx);
        if !self.runs_on(ctx, format) {
            return (self.fallback(), format);
        }
        if self != MatmulKernel::Auto {
            return (self, format);
        }
        let kernel = auto_kernel(ctx.features.adapter, m);
        let format = match (kernel, format) {
            // On lavapipe/llvmpipe unpacking the same f16 bytes with integer ops beat native
            // f16 loads by ~1.3x.
            (MatmulKernel::Tiled, WeightFormat::F16Native) => WeightFormat::F16Packed,
            (_, other) => other,
        };
        (kernel, format)
    }

    /// How far this kernel's output may be from an f32 reference, relative to the largest
    /// output: f32 kernels differ by summation order only; `Coop` and `GemmF16` round their
    /// inputs to f16 (a relative error of 2^-11 each).
    ///
    /// `NarrowDot` rounds x to 8-bit codes per 32-element block: each element moves by at
    /// most max|x_block| / 254, about uniformly, so an output moves by a sum of K
    /// independent errors x_err * w, about sqrt(K) * max|x_block| / (254 * sqrt(3)) * rms(w),
    /// while a typical output is sqrt(K) * rms(x) * rms(w). A block's max is a few times its
    /// rms (about 2.5x for 32 Gaussian values, more for heavy-tailed activations), which
    /// makes the typical error about 2.5 / 440 = 0.6% of a typical output; the worst of many
    /// outputs is a few such deviations, and SwiGLU multiplies two perturbed sums, so 2e-2 of
    /// the largest output leaves room (the tests measure 3e-3 to 1.3e-2, the most at small K
    /// with SwiGLU). A wrong index or scale is off by O(1).
    pub fn tolerance(self) -> f32 {
        match self {
            MatmulKernel::Coop | MatmulKernel::CoopSplit | MatmulKernel::GemmF16 => 1e-2,
            MatmulKernel::NarrowDot => 2e-2,
            _ => 1e-3,
        }
    }

    pub(super) fn entry(self) -> &'static str {
        match self {
            MatmulKernel::Naive => "naive",
            MatmulKernel::Tiled | MatmulKernel::Auto => "tiled",
            MatmulKernel::TiledShared => "tiled_shared",
            MatmulKernel::Gemm | MatmulKernel::GemmF16 => "gemm",
            MatmulKernel::Narrow => "narrow",
            MatmulKernel::Coop | MatmulKernel::CoopSplit => "coop",
            MatmulKernel::NarrowDot => "narrow_dot",
        }
    }

    /// Output tile of one workgroup: (rows, columns); `Coop`'s from the device's `coop`.
    pub(super) fn tile(self, coop: CoopShape) -> (u32, u32) {
        match self {
            MatmulKernel::Naive => (16, 16),
            MatmulKernel::Tiled | MatmulKernel::Auto => (TILED_WGY * 4, TILED_WGX * TILED_TN),
            MatmulKernel::TiledShared => (64, 64),
            MatmulKernel::Gemm | MatmulKernel::GemmF16 => (128, 128),
            MatmulKernel::Narrow | MatmulKernel::NarrowDot => (32, 16),
            MatmulKernel::Coop | MatmulKernel::CoopSplit => coop.tile(),
        }
    }
}
