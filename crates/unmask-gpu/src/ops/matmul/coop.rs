//! The tensor-core matmul's shape on a device, and the split-K form (`CoopSplit`): pass 1
//! writes each K slice's raw sums to the context's scratch, pass 2
//! (`shaders/matmul_split.wgsl`) adds them and applies the epilogue.

use bytemuck::{Pod, Zeroable};

use super::{Fusion, KERNEL, MatmulParams, SPLIT_REDUCE, too_big};
use crate::context::GpuContext;
use crate::error::Result;
use crate::ops::Kernels;
use crate::pipeline::Spec;
use crate::step::{Binding, StepEncoder, groups_2d};
use crate::tensor::Tensor;

/// How `Coop` is built for a device: its (fixed) subgroup size, the side of its cooperative
/// fragments and the depth of its k-tiles. A workgroup of 8 subgroups computes a
/// 4 `fragment` x 8 `fragment` tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoopShape {
    pub subgroup: u32,
    pub fragment: u32,
    pub k_depth: u32,
}

impl CoopShape {
    /// Output tile of one workgroup: (rows, weight rows).
    pub fn tile(&self) -> (u32, u32) {
        (4 * self.fragment, 8 * self.fragment)
    }

    /// Whether `m` rows take the half-height tile (`TM2`: 2 fragments of rows), so that a
    /// step of at most 2 fragments of rows (32 on an NVIDIA GPU) computes no rows twice.
    pub fn half_rows(&self, m: u32) -> bool {
        m <= 2 * self.fragment
    }

    /// Output tile of one workgroup for `m` rows: (rows, weight rows).
    pub fn tile_for_rows(&self, m: u32) -> (u32, u32) {
        let (tm, tn) = self.tile();
        (if self.half_rows(m) { tm / 2 } else { tm }, tn)
    }

    /// Workgroup memory: two buffers of the tile's x rows and W rows of `k_depth + 8`
    /// halves, the 8 subgroups' f32 output fragments and a scale per tile row.
    pub fn bytes(&self) -> u32 {
        let (tm, tn) = self.tile();
        let fr = self.fragment;
        2 * (tm + tn) * (self.k_depth + 8) * 2 + 8 * fr * fr * 4 + tm * 4
    }
}

/// How `Coop` runs on this device (k-tiles 32 deep where workgroup memory allows, else 16),
/// or `None` where it cannot: no cooperative matrices, or a subgroup size that is not a power
/// of two whose 8 subgroups cover the tile's rows (the NORM prologue gives each row an
/// invocation) and fit a workgroup, or too little workgroup memory.
pub fn coop_shape(ctx: &GpuContext) -> Option<CoopShape> {
    let f = &ctx.features;
    let (subgroup, fragment) = (f.subgroup_max_size, f.cooperative_fragment);
    if !f.cooperative_matrix
        || fragment == 0
        || !subgroup.is_power_of_two()
        || 8 * subgroup < 4 * fragment
        || 8 * subgroup > 8 * fragment * fragment
        || 8 * subgroup > f.max_workgroup_invocations
    {
        return None;
    }
    [32, 16]
        .into_iter()
        .map(|k_depth| CoopShape {
            subgroup,
            fragment,
            k_depth,
        })
        .find(|shape| shape.bytes() <= f.max_workgroup_storage_bytes)
}

/// Parameters of the split-K second pass; mirrors `struct Params` in
/// `shaders/matmul_split.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(super) struct SplitParams {
    m: u32,
    rows: u32,
    col0: u32,
    n: u32,
    stride: u32,
    slice_len: u32,
    slices: u32,
    tile_n: u32,
}

/// Workgroups a split is sized to reach: a few per streaming multiprocessor of a large GPU
/// (an H200 has 132), so each slice streams its weights with others in flight.
const SPLIT_TARGET_WORKGROUPS: u32 = 512;
/// Fewest k-tiles a slice keeps, so the partial sums' traffic stays small next to the weights.
const SPLIT_MIN_K_TILES: u32 = 2;
/// Most slices of K.
const SPLIT_MAX_SLICES: u32 = 16;

/// k-tiles per slice of `CoopSplit` for `tiles` output tiles over K of `k_tiles` k-tiles,
/// with at most `max_slices` slices (the scratch must fit a binding); every slice non-empty.
/// `k_tiles` (one slice) when the tiles fill the GPU alone.
pub fn split_k_tiles(tiles: u32, k_tiles: u32, max_slices: u32) -> u32 {
    let k_tiles = k_tiles.max(1);
    if tiles >= SPLIT_TARGET_WORKGROUPS / 2 {
        return k_tiles;
    }
    let slices = SPLIT_TARGET_WORKGROUPS
        .div_ceil(tiles.max(1))
        .min(k_tiles / SPLIT_MIN_K_TILES)
        .min(SPLIT_MAX_SLICES)
        .min(max_slices)
        .max(1);
    k_tiles.div_ceil(slices)
}

/// Records `CoopSplit` for one weight chunk (`params`, `bindings` as the plain `Coop`
/// dispatch would take them; `split_spec` its pass-1 specialisation) when the shape splits
/// K; `false`, recording nothing, when one slice is all it gets (the caller runs `Coop`).
#[allow(clippy::too_many_arguments)] // the plain dispatch's inputs plus the scratch's owner
pub(super) fn dispatch_split(
    step: &mut StepEncoder,
    split_spec: &Spec,
    params: MatmulParams,
    bindings: &[Binding],
    coop: CoopShape,
    kernels: Option<&Kernels>,
    fusion: &Fusion<'_>,
    y: &Tensor,
) -> Result<bool> {
    let ctx = step.ctx();
    let (tm, tn) = coop.tile_for_rows(params.m);
    let tiles_m = params.tiles / params.tiles_n;
    let stride = params.tiles_n as usize * tn as usize;
    let slice_len = tiles_m as usize * tm as usize * stride;
    let max_slices =
        (ctx.features.max_binding_bytes as usize / 4 / slice_len).min(u32::MAX as usize) as u32;
    let k_tiles = params.k.div_ceil(coop.k_depth);
    let kt_slice = split_k_tiles(params.tiles, k_tiles, max_slices);
    let slices = k_tiles.div_ceil(kt_slice);
    if slices < 2 {
        return Ok(false);
    }
    // The model's shared scratch; a caller without one (a kernel test) gets its own.
    let floats = slices as usize * slice_len;
    let scratch = match kernels {
        Some(k) => k.split_scratch(ctx, floats)?,
        None => Tensor::zeros(
            ctx,
            crate::tensor::DType::F32,
            &[floats],
            "split-K partial sums",
        )?,
    };
    // Pass 1: raw partial sums of every tile and slice into the scratch.
    let split = ctx.pipeline(&KERNEL, "coop", split_spec)?;
    let mut pass1 = bindings.to_vec();
    pass1[2] = Binding::from(&scratch);
    let groups = params
        .tiles
        .checked_mul(slices)
        .ok_or_else(|| too_big("workgroups", params.tiles as usize * slices as usize))?;
    step.dispatch(
        &split,
        &MatmulParams { kt_slice, ..params },
        &pass1,
        groups_2d(ctx, groups),
    );
    // Pass 2: the slices' sums and the epilogue into y.
    let reduce_spec = Spec::new()
        .flag_if(fusion.residual, "RESIDUAL")
        .flag_if(fusion.swiglu, "SWIGLU");
    let reduce = ctx.pipeline(&SPLIT_REDUCE, "main", &reduce_spec)?;
    let reduce_params = SplitParams {
        m: params.m,
        rows: params.rows,
        col0: params.col0,
        n: params.n,
        stride: stride as u32,
        slice_len: slice_len as u32,
        slices,
        tile_n: tn,
    };
    step.dispatch(
        &reduce,
        &reduce_params,
        &[Binding::from(&scratch), Binding::from(y)],
        groups_2d(ctx, (params.m * params.rows).div_ceil(64)),
    );
    Ok(true)
}

#[cfg(test)]
pub(super) fn host_params() -> Vec<crate::ops::HostParams> {
    use crate::ops::host_params;
    vec![host_params!(
        "matmul_split",
        "main",
        SplitParams {
            m,
            rows,
            col0,
            n,
            stride,
            slice_len,
            slices,
            tile_n
        }
    )]
}
