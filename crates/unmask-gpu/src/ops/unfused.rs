//! Kernels the forward pass no longer runs, kept as references: the standalone RoPE and
//! SwiGLU that `rope_qkv` and the matmul's fused epilogues replaced. Tests check the fused kernels against them and the kernel bench times the
//! difference; the feature `unfused-kernels` builds them (never on by default).

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
/// The row scatter and residual add the adaptive step runs live beside the other row kernels.
pub use super::elementwise::{add_in_place, scatter_rows};
use super::elementwise::{check, check_f32, check_u32, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::Tensor;

const ROPE: KernelSource = kernel_source!("rope");
const SWIGLU: KernelSource = kernel_source!("swiglu");

pub fn variants() -> Vec<ShaderVariant> {
    [(ROPE, "main"), (SWIGLU, "main")]
        .into_iter()
        .map(|(kernel, entry)| ShaderVariant {
            kernel,
            entry,
            spec: Spec::new(),
        })
        .collect()
}

/// The geometry of a RoPE application: which heads of which column window.
#[derive(Clone, Copy, Debug)]
pub struct RopeShape {
    pub rows: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub row_stride: usize,
    pub col_offset: usize,
    pub max_pos: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct RopeParams {
    rows: u32,
    n_heads: u32,
    head_dim: u32,
    row_stride: u32,
    col_offset: u32,
    max_pos: u32,
    _pad: [u32; 2],
}

/// Rotates `n_heads` heads starting at `col_offset` of every row in place, at `positions[r]`.
pub fn rope(
    step: &mut StepEncoder,
    x: &Tensor,
    positions: &Tensor,
    table: &Tensor,
    s: RopeShape,
) -> Result<()> {
    check(
        "rope",
        s.head_dim.is_multiple_of(2) && s.col_offset + s.n_heads * s.head_dim <= s.row_stride,
        || "an even head_dim and heads within the row".into(),
        || {
            format!(
                "head_dim {} heads {} at column {} of rows of {}",
                s.head_dim, s.n_heads, s.col_offset, s.row_stride
            )
        },
    )?;
    check_f32("rope x", x, s.rows * s.row_stride)?;
    check_u32("rope positions", positions, s.rows)?;
    check_f32("rope table", table, s.max_pos * s.head_dim)?;
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&ROPE, "main", &Spec::new())?;
    let params = RopeParams {
        rows: u32_of(s.rows),
        n_heads: u32_of(s.n_heads),
        head_dim: u32_of(s.head_dim),
        row_stride: u32_of(s.row_stride),
        col_offset: u32_of(s.col_offset),
        max_pos: u32_of(s.max_pos),
        _pad: [0; 2],
    };
    step.dispatch(
        &pipeline,
        &params,
        &[x.into(), positions.into(), table.into()],
        groups_2d(ctx, u32_of(s.rows)),
    );
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct SwigluParams {
    rows: u32,
    cols: u32,
    in_stride: u32,
    gate_col: u32,
    up_col: u32,
    out_stride: u32,
    _pad: [u32; 2],
}

/// out[r, c] = silu(gate_up[r, c]) * gate_up[r, cols + c] for a fused `[rows, 2*cols]` input.
pub fn swiglu(
    step: &mut StepEncoder,
    gate_up: &Tensor,
    out: &Tensor,
    rows: usize,
    cols: usize,
) -> Result<()> {
    check_f32("swiglu input", gate_up, rows * 2 * cols)?;
    check_f32("swiglu out", out, rows * cols)?;
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&SWIGLU, "main", &Spec::new())?;
    let params = SwigluParams {
        rows: u32_of(rows),
        cols: u32_of(cols),
        in_stride: u32_of(2 * cols),
        gate_col: 0,
        up_col: u32_of(cols),
        out_stride: u32_of(cols),
        _pad: [0; 2],
    };
    step.dispatch(
        &pipeline,
        &params,
        &[gate_up.into(), out.into()],
        groups_2d(ctx, u32_of(rows)),
    );
    Ok(())
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![
        host_params!(
            "rope",
            "main",
            RopeParams {
                rows,
                n_heads,
                head_dim,
                row_stride,
                col_offset,
                max_pos
            }
        ),
        host_params!(
            "swiglu",
            "main",
            SwigluParams {
                rows,
                cols,
                in_stride,
                gate_col,
                up_col,
                out_stride
            }
        ),
    ]
}
