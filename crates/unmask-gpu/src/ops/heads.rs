//! Per-head RMSNorm and RoPE in one pass (`shaders/head_norm.wgsl`): DiffusionGemma normalises
//! every q and k head with its own weight before rotating it, and every v head without one
//! (`docs/models/diffusion-gemma.md` §4.4). Hand-written: one workgroup per (row, head).

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::elementwise::{check, check_f32, check_u32, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::Tensor;

const HEAD_NORM: KernelSource = kernel_source!("head_norm");

pub fn variants() -> Vec<ShaderVariant> {
    vec![ShaderVariant {
        kernel: HEAD_NORM,
        entry: "main",
        spec: Spec::new(),
    }]
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct HeadNormParams {
    rows: u32,
    heads: u32,
    head_dim: u32,
    row_stride: u32,
    col_offset: u32,
    max_pos: u32,
    eps: f32,
    rotate: u32,
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "head_norm",
        "main",
        HeadNormParams {
            rows,
            heads,
            head_dim,
            row_stride,
            col_offset,
            max_pos,
            eps,
            rotate
        }
    )]
}

/// Where the heads are: `heads` heads of `head_dim` values from column `col_offset` of each
/// of `rows` rows of `row_stride` floats.
#[derive(Clone, Copy, Debug)]
pub struct HeadLayout {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub row_stride: usize,
    pub col_offset: usize,
}

/// The rotation: each row's absolute position and a `(cos, sin)` table `[max_pos, head_dim / 2]`
/// (`rope_table_partial`).
#[derive(Clone, Copy, Debug)]
pub struct Rotation<'a> {
    pub positions: &'a Tensor,
    pub table: &'a Tensor,
    pub max_pos: usize,
}

/// Every head in place: `h = h / sqrt(mean(h²) + eps) * weight`, then rotated by `rotation`
/// (rotate_half) when given. `weight` has `head_dim` values (ones for a norm without weight).
pub fn head_norm_rope(
    step: &mut StepEncoder,
    x: &Tensor,
    weight: &Tensor,
    rotation: Option<Rotation>,
    s: HeadLayout,
    eps: f32,
) -> Result<()> {
    check(
        "head_norm_rope",
        s.head_dim > 0
            && s.head_dim.is_multiple_of(2)
            && s.col_offset + s.heads * s.head_dim <= s.row_stride,
        || "an even head_dim and every head within the row".into(),
        || {
            format!(
                "head_dim {}, {} heads from column {} of rows of {}",
                s.head_dim, s.heads, s.col_offset, s.row_stride
            )
        },
    )?;
    check_f32("head_norm_rope x", x, s.rows * s.row_stride)?;
    check_f32("head_norm_rope weight", weight, s.head_dim)?;
    // Without a rotation the position and table bindings take the weight (never read).
    let (positions, table, max_pos) = match rotation {
        Some(r) => {
            check_u32("head_norm_rope positions", r.positions, s.rows)?;
            check_f32("head_norm_rope table", r.table, r.max_pos * s.head_dim)?;
            (r.positions, r.table, r.max_pos)
        }
        None => (weight, weight, 1),
    };
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&HEAD_NORM, "main", &Spec::new())?;
    let params = HeadNormParams {
        rows: u32_of(s.rows),
        heads: u32_of(s.heads),
        head_dim: u32_of(s.head_dim),
        row_stride: u32_of(s.row_stride),
        col_offset: u32_of(s.col_offset),
        max_pos: u32_of(max_pos.max(1)),
        eps,
        rotate: u32::from(rotation.is_some()),
    };
    step.dispatch(
        &pipeline,
        &params,
        &[x.into(), weight.into(), positions.into(), table.into()],
        groups_2d(ctx, u32_of(s.rows * s.heads)),
    );
    Ok(())
}

/// Host-side `(cos, sin)` table `[max_pos, head_dim / 2]` for a head of `head_dim` whose first
/// `rotated` pairs turn with frequency `1 / theta^(2i / head_dim)` — the exponent over the
/// whole head, as DiffusionGemma's proportional RoPE has it — and whose other pairs stay
/// put (cos 1, sin 0). Angles in f32 like the reference.
pub fn rope_table_partial(theta: f32, head_dim: usize, rotated: usize, max_pos: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|j| {
            if j < rotated {
                1.0 / theta.powf((2 * j) as f32 / head_dim as f32)
            } else {
                0.0
            }
        })
        .collect();
    let mut table = Vec::with_capacity(max_pos * half * 2);
    for pos in 0..max_pos {
        for f in &inv_freq {
            let angle = (pos as f32 * f) as f64;
            table.push(angle.cos() as f32);
            table.push(angle.sin() as f32);
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotated_pairs_turn_by_the_whole_head_exponent_and_the_rest_stay_put() {
        let (d, rotated, max_pos) = (16, 2, 5);
        let part = rope_table_partial(1e6, d, rotated, max_pos);
        assert_eq!(part.len(), max_pos * d);
        for pos in 0..max_pos {
            for j in 0..d / 2 {
                let at = (pos * d / 2 + j) * 2;
                let got = (part[at], part[at + 1]);
                if j < rotated {
                    // The exponent's denominator is the whole head (16), not the rotated part.
                    let angle =
                        (pos as f32 * (1.0 / 1e6f32.powf((2 * j) as f32 / d as f32))) as f64;
                    assert_eq!(got, (angle.cos() as f32, angle.sin() as f32));
                } else {
                    assert_eq!(got, (1.0, 0.0));
                }
            }
        }
        // Every pair rotated: the table of the shared RoPE.
        assert_eq!(
            rope_table_partial(10_000.0, d, d / 2, 3),
            super::super::elementwise::rope_table(10_000.0, d, 3)
        );
    }
}
