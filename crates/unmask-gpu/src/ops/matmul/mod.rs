//! `y = x · Wᵀ`: activations `x` f32 `[M, K]` times an `nn.Linear` weight `W` `[N, K]` in any
//! `WeightFormat`, into `y` f32 `[M, N]`, accumulating in f32 (`GemmF16`: in f16 within a
//! k-tile). One dispatch per weight chunk, each writing the output columns that belong to
//! its rows. Quantized weights are decoded as each kernel loads them, so every kernel reads
//! every format.

use bytemuck::{Pod, Zeroable};

use super::Kernels;
use crate::context::{AdapterClass, GpuContext};
use crate::error::{GpuError, Result};
use crate::pipeline::{KernelSource, Spec};
use crate::step::{Binding, StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor, Weight, WeightFormat};

mod coop;
mod kernel;
mod measure;
mod variants;

pub use coop::{CoopShape, coop_shape, split_k_tiles};
pub use kernel::MatmulKernel;
use measure::choose;
pub use measure::tune_class;
pub use variants::variants;

pub const KERNEL: KernelSource = crate::kernel_source!(
    "matmul",
    "matmul_tiled",
    "matmul_gemm",
    "matmul_narrow",
    "matmul_coop",
    "weight_load"
);
/// The second pass of `CoopSplit`: sums of the K slices and the epilogue.
pub const SPLIT_REDUCE: KernelSource = crate::kernel_source!("matmul_split");

// Shape of `Tiled`: WGX x WGY invocations of 4 rows x (8 if wide else 4) columns.
const TILED_WIDE: bool = true;
const TILED_WGX: u32 = 8;
const TILED_WGY: u32 = 8;
const TILED_TN: u32 = if TILED_WIDE { 8 } else { 4 };

/// Kernel parameters; mirrors `struct Params` in `shaders/matmul.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
struct MatmulParams {
    m: u32,
    k: u32,
    rows: u32,
    col0: u32,
    n: u32,
    w_stride4: u32,
    tiles_n: u32,
    tiles: u32,
    s_off: u32,
    eps: f32,
    up_off: u32,
    kt_slice: u32,
}

/// What a matmul does around `x · Wᵀ` (see `shaders/matmul.wgsl`): RMSNorm of the x rows
/// before it, adding into y, or SwiGLU of a paired gate|up weight.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fusion<'a> {
    /// RMSNorm with this weight `[K]` and epsilon, applied to x on the way in.
    pub norm: Option<(&'a Tensor, f32)>,
    /// `y += x · Wᵀ` instead of `y = x · Wᵀ`.
    pub residual: bool,
    /// `W` is a gate|up pair (`Weight::zeros_paired`); y gets `silu(gate) * up`, one
    /// column per pair.
    pub swiglu: bool,
}

impl Fusion<'_> {
    fn flags(&self, spec: Spec) -> Spec {
        spec.flag_if(self.norm.is_some(), "NORM")
            .flag_if(self.residual, "RESIDUAL")
            .flag_if(self.swiglu, "SWIGLU")
    }
}

/// Workgroup memory of `Gemm` (`half`: `GemmF16`) with 16-deep k-tiles: two buffers of a
/// 128-row x tile and W tile.
pub fn gemm_bk16_bytes(half: bool) -> u32 {
    2 * 2 * 16 * 128 * if half { 2 } else { 4 }
}

/// Depth of the k-tiles `kernel` (`Gemm` or `GemmF16` as planned) runs on this device: 16
/// where the workgroup memory allows it (natively 32 KiB or more for f32 tiles; the
/// browser's 16 KiB fits f16 tiles), else 8.
pub fn gemm_k_depth(ctx: &GpuContext, kernel: MatmulKernel) -> u32 {
    let half = kernel == MatmulKernel::GemmF16;
    if ctx.limits.max_compute_workgroup_storage_size >= gemm_bk16_bytes(half) {
        16
    } else {
        8
    }
}

/// The specialisation of `shaders/matmul.wgsl` for a kernel, a weight format, whether x
/// rows can be read as vec4 (K % 4 == 0) and the tile depth: `Gemm`'s 16-deep k-tiles
/// (`bk16`), `Coop`'s shape (`coop`).
fn spec(
    kernel: MatmulKernel,
    format: WeightFormat,
    x_vec4: bool,
    swiglu: bool,
    bk16: bool,
    coop: CoopShape,
) -> Spec {
    let spec = match kernel {
        MatmulKernel::Naive => Spec::new().flag("NAIVE"),
        MatmulKernel::Tiled | MatmulKernel::Auto => Spec::new()
            .flag("TILED")
            // SwiGLU keeps its up sums in the wide half.
            .flag_if(TILED_WIDE || swiglu, "WIDE")
            .constant("WGX", TILED_WGX)
            .constant("WGY", TILED_WGY),
        MatmulKernel::TiledShared => Spec::new().flag("SHARED"),
        MatmulKernel::Gemm => Spec::new().flag("GEMM").flag_if(bk16, "BK16"),
        MatmulKernel::GemmF16 => Spec::new().flag("GEMM").flag("HALF").flag_if(bk16, "BK16"),
        MatmulKernel::Narrow => Spec::new().flag("NARROW"),
        MatmulKernel::NarrowDot => Spec::new().flag("NDOT"),
        MatmulKernel::Coop | MatmulKernel::CoopSplit => Spec::new()
            .flag("COOP")
            .flag_if(kernel == MatmulKernel::CoopSplit, "SPLITK")
            .constant("SG", coop.subgroup)
            .constant("FR", coop.fragment)
            .constant("BK", coop.k_depth),
    };
    let spec = weight_load_flags(spec, format);
    // The naive kernel reads x one element at a time.
    spec.flag_if(x_vec4 && kernel != MatmulKernel::Naive, "XVEC4")
}

/// The flags of `shaders/weight_load.wgsl` that decode a weight stored in `format`, added
/// to `spec` (every kernel that appends that file takes these).
pub fn weight_load_flags(spec: Spec, format: WeightFormat) -> Spec {
    match format {
        WeightFormat::F32 => spec.flag("WF32"),
        WeightFormat::F16Packed => spec.flag("WPACKED"),
        WeightFormat::F16Native => spec.flag("F16"),
        WeightFormat::Q8 => spec.flag("QUANT").flag("WQ8"),
        WeightFormat::Q4 => spec.flag("QUANT").flag("WQ4"),
    }
}

/// The kernel `Auto` runs for `m` rows on an adapter of this class (one that does not say
/// is taken for a GPU: browsers run on one).
fn auto_kernel(adapter: AdapterClass, m: usize) -> MatmulKernel {
    if adapter == AdapterClass::Software {
        // On lavapipe/llvmpipe register tiling beat shared tiles on every shape.
        MatmulKernel::Tiled
    } else if m >= 64 {
        // Hardware GPUs (not measured yet): 8 x 8 register tiles halve the workgroup memory
        // reads per multiply-add of `TiledShared`, and double buffering hides the loads.
        MatmulKernel::Gemm
    } else {
        // Below 64 rows a row-tiled kernel launches too few workgroups for a big GPU;
        // `Narrow` launches one per 16 columns and splits K inside the workgroup.
        MatmulKernel::Narrow
    }
}

/// Output tile of one workgroup for `kernel` over `rows` rows, with or without SwiGLU (which
/// halves the columns of `Tiled`, `Gemm`, `Narrow` and the others: half of their sums are the
/// up halves); `Coop`'s tile is half as high for few rows (`CoopShape::tile_for_rows`).
fn tile_for(kernel: MatmulKernel, swiglu: bool, coop: CoopShape, rows: u32) -> (u32, u32) {
    let (m, n) = match kernel {
        MatmulKernel::Coop | MatmulKernel::CoopSplit => coop.tile_for_rows(rows),
        _ => kernel.tile(coop),
    };
    match kernel {
        MatmulKernel::Tiled | MatmulKernel::Auto if swiglu => (m, TILED_WGX * 4),
        MatmulKernel::Gemm
        | MatmulKernel::GemmF16
        | MatmulKernel::Narrow
        | MatmulKernel::NarrowDot
        | MatmulKernel::Coop
        | MatmulKernel::CoopSplit
            if swiglu =>
        {
            (m, n / 2)
        }
        _ => (m, n),
    }
}

/// The fusions a dispatch may carry: (norm, residual, swiglu). A projection either reads
/// the normed stream (qkv, gate|up) or adds into it (o-proj, down).
const FUSIONS: [(bool, bool, bool); 5] = [
    (false, false, false),
    (true, false, false),
    (false, true, false),
    (true, false, true),
    (false, false, true),
];

/// A count past what the kernels' u32 indices reach.
fn too_big(what: &str, v: usize) -> GpuError {
    GpuError::TooLarge {
        what: format!("matmul {what}"),
        needed: v as u64,
        limit: u64::from(u32::MAX),
    }
}

fn shape_error(expected: String, found: String) -> GpuError {
    GpuError::Shape {
        op: "matmul",
        expected,
        found,
    }
}

/// The kernel a matmul asks for, with the model's kernel choice (`Kernels`: its tuner
/// measures `Auto`, its scratch holds split-K partial sums). A bare `MatmulKernel` runs
/// without one: `Auto` takes the fixed choice, `CoopSplit` a scratch of its own.
#[derive(Clone, Copy)]
pub struct MatmulChoice<'a> {
    pub kernel: MatmulKernel,
    pub kernels: Option<&'a Kernels>,
}

impl From<MatmulKernel> for MatmulChoice<'_> {
    fn from(kernel: MatmulKernel) -> Self {
        Self {
            kernel,
            kernels: None,
        }
    }
}

impl<'a> From<&'a Kernels> for MatmulChoice<'a> {
    fn from(kernels: &'a Kernels) -> Self {
        Self {
            kernel: kernels.matmul,
            kernels: Some(kernels),
        }
    }
}

/// Records `y[0..m] = x[0..m] · Wᵀ`. `x` is f32 `[.., K]` and `y` f32 `[.., N]` with at least
/// `m` rows each (they may be allocated bigger); `W` is `[N, K]`.
pub fn matmul<'k>(
    step: &mut StepEncoder,
    x: &Tensor,
    w: &Weight,
    y: &Tensor,
    m: usize,
    kernel: impl Into<MatmulChoice<'k>>,
) -> Result<()> {
    matmul_fused(step, x, w, y, m, kernel, Fusion::default())
}

/// `matmul` with a fused prologue or epilogue (`Fusion`). With `swiglu`, `W` is a paired
/// gate|up weight of `2N` logical rows and y has N columns.
pub fn matmul_fused<'k>(
    step: &mut StepEncoder,
    x: &Tensor,
    w: &Weight,
    y: &Tensor,
    m: usize,
    kernel: impl Into<MatmulChoice<'k>>,
    fusion: Fusion<'_>,
) -> Result<()> {
    let choice = kernel.into();
    let ctx = step.ctx();
    if fusion.swiglu != w.paired.is_some() {
        return Err(shape_error(
            "a paired gate|up weight exactly when SwiGLU is fused".into(),
            format!(
                "swiglu = {} with a weight that is {}paired",
                fusion.swiglu,
                if w.paired.is_some() { "" } else { "not " }
            ),
        ));
    }
    let k = w.cols;
    let n = w.paired.unwrap_or(w.rows);
    if let Some((g, _)) = fusion.norm
        && (g.dtype != DType::F32 || g.numel() != k)
    {
        return Err(shape_error(
            format!("a norm weight of {k} f32 values"),
            format!("{:?} {:?}", g.dtype, g.shape),
        ));
    }
    if k == 0 || w.row_stride < k || !w.row_stride.is_multiple_of(4) {
        return Err(shape_error(
            "a weight with K > 0 columns and a row stride that is a multiple of 4 and >= K".into(),
            format!("K = {k}, row stride {}", w.row_stride),
        ));
    }
    if x.dtype != DType::F32 || x.shape.last() != Some(&k) || x.numel() < m * k {
        return Err(shape_error(
            format!("x f32 [>= {m}, {k}] (W is [{n}, {k}])"),
            format!("x {:?} {:?}", x.dtype, x.shape),
        ));
    }
    // y is written as rows of N values; a bigger scratch buffer (e.g. logits sized for the
    // largest vocabulary chunk) may serve smaller chunks, so only its size is checked.
    if y.dtype != DType::F32 || y.numel() < m * n {
        return Err(shape_error(
            format!("y f32 with at least {m} x {n} elements (W is [{n}, {k}])"),
            format!("y {:?} {:?}", y.dtype, y.shape),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let m32 = u32::try_from(m).map_err(|_| too_big("rows", m))?;
    let k32 = u32::try_from(k).map_err(|_| too_big("K", k))?;
    let n32 = u32::try_from(n).map_err(|_| too_big("N", n))?;
    if m.checked_mul(n.max(k))
        .is_none_or(|e| e > u32::MAX as usize)
    {
        return Err(too_big("elements of x or y", m.saturating_mul(n.max(k))));
    }

    let (kernel, format) = choose(ctx, choice, x, w, m, n, fusion)?;
    let x_vec4 = k.is_multiple_of(4);
    let bk16 = gemm_k_depth(ctx, kernel) == 16;
    // `plan` runs `Coop` only where it has a shape.
    let coop = coop_shape(ctx).unwrap_or(CoopShape {
        subgroup: 32,
        fragment: 16,
        k_depth: 16,
    });
    // `CoopSplit` runs the plain `Coop` kernel where K is not split.
    let direct = if kernel == MatmulKernel::CoopSplit {
        MatmulKernel::Coop
    } else {
        kernel
    };
    let is_coop = direct == MatmulKernel::Coop;
    let half_rows = is_coop && coop.half_rows(m32);
    let spec_of =
        |kernel| spec(kernel, format, x_vec4, fusion.swiglu, bk16, coop).flag_if(half_rows, "TM2");
    let pipeline = ctx.pipeline(&KERNEL, direct.entry(), &fusion.flags(spec_of(direct)))?;
    let (tile_m, tile_n) = tile_for(direct, fusion.swiglu, coop, m32);
    let tiles_m = m32.div_ceil(tile_m);
    // `Coop` reads each row's 1 / rms, found once here, instead of every workgroup
    // re-reading its rows over all of K for them.
    let row_inv = match fusion.norm {
        Some((_, eps)) if is_coop => {
            let t = match choice.kernels {
                Some(k) => k.norm_scratch(ctx, m)?,
                None => Tensor::zeros(ctx, DType::F32, &[m], "rows' 1 / rms")?,
            };
            crate::ops::elementwise::rms_stats(step, x, &t, m, k, eps)?;
            Some(t)
        }
        _ => None,
    };
    for chunk in &w.chunks {
        // Output columns of the chunk: a paired chunk holds two rows per column.
        let width = if fusion.swiglu {
            chunk.rows / 2
        } else {
            chunk.rows
        };
        // The last chunk of an empty weight holds a padding row; never write past N.
        let rows = width.min(n.saturating_sub(chunk.row_start));
        if rows == 0 {
            continue;
        }
        let rows32 = rows as u32;
        let tiles_n = rows32.div_ceil(tile_n);
        let tiles = tiles_m
            .checked_mul(tiles_n)
            .ok_or_else(|| too_big("workgroups", tiles_m as usize * tiles_n as usize))?;
        let params = MatmulParams {
            m: m32,
            k: k32,
            rows: rows32,
            col0: chunk.row_start as u32,
            n: n32,
            w_stride4: (w.row_stride / 4) as u32,
            tiles_n,
            tiles,
            s_off: w.scales_word_offset(chunk.rows) as u32,
            eps: fusion.norm.map_or(0.0, |(_, eps)| eps),
            up_off: width as u32,
            kt_slice: 0,
        };
        let mut bindings = vec![Binding::from(x), Binding::from(chunk), Binding::from(y)];
        if let Some((g, _)) = fusion.norm {
            bindings.push(Binding::from(g));
        }
        if let Some(t) = &row_inv {
            bindings.push(Binding::from(t));
        }
        if kernel == MatmulKernel::CoopSplit {
            // Pass 1 without the residual add, which waits for pass 2.
            let split_spec = spec_of(kernel)
                .flag_if(fusion.norm.is_some(), "NORM")
                .flag_if(fusion.swiglu, "SWIGLU");
            let kernels = choice.kernels;
            if coop::dispatch_split(
                step,
                &split_spec,
                params,
                &bindings,
                coop,
                kernels,
                &fusion,
                y,
            )? {
                continue;
            }
        }
        step.dispatch(&pipeline, &params, &bindings, groups_2d(ctx, tiles));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "matmul",
        "*",
        MatmulParams {
            m,
            k,
            rows,
            col0,
            n,
            w_stride4,
            tiles_n,
            tiles,
            s_off,
            eps,
            up_off,
            kt_slice
        }
    )]
    .into_iter()
    .chain(coop::host_params())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An NVIDIA GPU's `Coop`: 32-wide subgroups, 16 x 16 fragments.
    const NVIDIA: CoopShape = CoopShape {
        subgroup: 32,
        fragment: 16,
        k_depth: 32,
    };

    #[test]
    fn auto_picks_by_device_and_rows() {
        for device in [AdapterClass::Gpu, AdapterClass::Unknown] {
            for m in [1, 32, 63] {
                assert_eq!(
                    auto_kernel(device, m),
                    MatmulKernel::Narrow,
                    "{device:?} m={m}"
                );
            }
            for m in [64, 65, 256, 4096] {
                assert_eq!(
                    auto_kernel(device, m),
                    MatmulKernel::Gemm,
                    "{device:?} m={m}"
                );
            }
        }
        for m in [1, 63, 64, 4096] {
            assert_eq!(auto_kernel(AdapterClass::Software, m), MatmulKernel::Tiled);
        }
    }

    #[test]
    fn workgroup_counts_follow_n_for_small_m() {
        // A T = 32 step's o-proj (N = 4096): the small-M tile launches a workgroup per 16
        // columns whatever M < 64 is (two row tiles past 32), the row tiles of `Tiled` 64.
        let count = |kernel: MatmulKernel, m: u32, n: u32| {
            let (tm, tn) = tile_for(kernel, false, NVIDIA, m);
            m.div_ceil(tm) * n.div_ceil(tn)
        };
        assert_eq!(count(MatmulKernel::Narrow, 32, 4096), 256);
        assert_eq!(count(MatmulKernel::Narrow, 1, 4096), 256);
        assert_eq!(count(MatmulKernel::Narrow, 32, 12288), 768);
        assert_eq!(count(MatmulKernel::Narrow, 63, 4096), 512);
        assert_eq!(count(MatmulKernel::Tiled, 32, 4096), 64);
        // SwiGLU halves the output columns of a tile, not the workgroups per weight row.
        assert_eq!(tile_for(MatmulKernel::Narrow, true, NVIDIA, 32), (32, 8));
        assert_eq!(tile_for(MatmulKernel::Gemm, true, NVIDIA, 32), (128, 64));
        // The integer-dot kernel shares `Narrow`'s tiles.
        assert_eq!(count(MatmulKernel::NarrowDot, 63, 4096), 512);
        assert_eq!(tile_for(MatmulKernel::NarrowDot, true, NVIDIA, 32), (32, 8));
        // `Coop` at M <= 2 fragments: half-height tiles, so 32 rows fill one tile exactly.
        assert_eq!(tile_for(MatmulKernel::Coop, false, NVIDIA, 32), (32, 128));
        assert_eq!(
            tile_for(MatmulKernel::CoopSplit, true, NVIDIA, 33),
            (64, 64)
        );
    }

    #[test]
    fn split_k_fills_a_large_gpu_for_few_rows() {
        // LLaDA-8B at M = 32 with 64 x 128 tiles and 32-deep k-tiles: the o-proj (N = K =
        // 4096) has 32 tiles over 128 k-tiles, the down projection (K = 12288) 384 k-tiles.
        assert_eq!(split_k_tiles(32, 128, u32::MAX), 8); // 16 slices: 512 workgroups
        assert_eq!(split_k_tiles(32, 384, u32::MAX), 24);
        // gate|up (192 tiles): 3 slices.
        assert_eq!(128u32.div_ceil(split_k_tiles(192, 128, u32::MAX)), 3);
        // Enough tiles alone (M = 1344): no split.
        assert_eq!(split_k_tiles(21 * 32, 128, u32::MAX), 128);
        assert_eq!(split_k_tiles(256, 128, u32::MAX), 128);
        // Short K keeps 2 k-tiles a slice; a scratch that fits 3 slices caps them.
        assert_eq!(split_k_tiles(1, 5, u32::MAX), 3);
        assert_eq!(split_k_tiles(1, 1, u32::MAX), 1);
        assert_eq!(split_k_tiles(1, 0, u32::MAX), 1);
        assert_eq!(128u32.div_ceil(split_k_tiles(32, 128, 3)), 3);
        assert_eq!(split_k_tiles(32, 128, 0), 128);
        // Every slice has work: the last starts before K ends.
        for tiles in [1, 7, 32, 100, 255] {
            for k_tiles in 1..200 {
                let per = split_k_tiles(tiles, k_tiles, u32::MAX);
                let slices = k_tiles.div_ceil(per);
                assert!((slices - 1) * per < k_tiles, "{tiles} {k_tiles}");
                assert!(slices <= 16);
            }
        }
    }

    #[test]
    fn narrow_dot_variants_read_quantized_weights_only() {
        let dot: Vec<_> = variants()
            .into_iter()
            .filter(|v| v.entry == MatmulKernel::NarrowDot.entry())
            .collect();
        // q8 and q4, x scalar and vec4, five fusions.
        assert_eq!(dot.len(), 2 * 2 * FUSIONS.len());
        assert!(
            dot.iter()
                .all(|v| v.spec.has("QUANT") && v.spec.has("NDOT"))
        );
    }
}
