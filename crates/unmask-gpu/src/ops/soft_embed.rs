//! The soft-embedding product of DiffusionGemma's self-conditioning (§4.1 of
//! `docs/models/diffusion-gemma.md`): `out = scale · probs · E`, the token table weighted by a
//! distribution over the vocabulary. Hand-written (`shaders/soft_embed.wgsl`): the matmul
//! kernels multiply by `Wᵀ`, and this reads the table the other way, as `[V, D]` rows.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::elementwise::{check, check_f32, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::ops::matmul::weight_load_flags;
use crate::pipeline::{KernelSource, Spec};
use crate::step::StepEncoder;
use crate::tensor::{Tensor, Weight, WeightFormat};

const SOFT_EMBED: KernelSource = kernel_source!("soft_embed", "weight_load");
/// Rows of `probs` one workgroup takes (`RB` in the shader).
const ROW_BLOCK: usize = 8;

pub fn variants() -> Vec<ShaderVariant> {
    [
        WeightFormat::F32,
        WeightFormat::F16Packed,
        WeightFormat::F16Native,
        WeightFormat::Q8,
        WeightFormat::Q4,
    ]
    .into_iter()
    .map(|f| ShaderVariant {
        kernel: SOFT_EMBED,
        entry: "main",
        spec: weight_load_flags(Spec::new(), f),
    })
    .collect()
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct SoftEmbedParams {
    rows: u32,
    cols: u32,
    row_stride: u32,
    row_start: u32,
    chunk_rows: u32,
    s_off: u32,
    vocab: u32,
    accumulate: u32,
    scale: f32,
    _pad: [u32; 3],
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "soft_embed",
        "main",
        SoftEmbedParams {
            rows,
            cols,
            row_stride,
            row_start,
            chunk_rows,
            s_off,
            vocab,
            accumulate,
            scale
        }
    )]
}

/// `out[r] = scale · Σ_v probs[r, v] · table[v]` for `rows` rows: `probs` f32 `[rows, V]`,
/// `table` `[V, D]` in any weight format, `out` f32 `[rows, D]` (written).
pub fn soft_embed(
    step: &mut StepEncoder,
    probs: &Tensor,
    table: &Weight,
    out: &Tensor,
    rows: usize,
    scale: f32,
) -> Result<()> {
    let (vocab, cols) = (table.rows, table.cols);
    check(
        "soft_embed",
        vocab > 0 && cols > 0,
        || "a table with rows and columns".into(),
        || format!("[{vocab}, {cols}]"),
    )?;
    check_f32("soft_embed probs", probs, rows * vocab)?;
    check_f32("soft_embed out", out, rows * cols)?;
    if rows == 0 {
        return Ok(());
    }
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(
        &SOFT_EMBED,
        "main",
        &weight_load_flags(Spec::new(), table.format),
    )?;
    for (i, chunk) in table.chunks.iter().enumerate() {
        let params = SoftEmbedParams {
            rows: u32_of(rows),
            cols: u32_of(cols),
            row_stride: u32_of(table.row_stride),
            row_start: u32_of(chunk.row_start),
            chunk_rows: u32_of(chunk.rows),
            s_off: u32_of(table.scales_word_offset(chunk.rows)),
            vocab: u32_of(vocab),
            accumulate: u32::from(i > 0),
            scale,
            _pad: [0; 3],
        };
        step.dispatch(
            &pipeline,
            &params,
            &[probs.into(), chunk.into(), out.into()],
            [
                u32_of(cols.div_ceil(64)),
                u32_of(rows.div_ceil(ROW_BLOCK)),
                1,
            ],
        );
    }
    Ok(())
}
