//! Attention with a causal mask, a sliding window and a given scale
//! (`shaders/attention_masked.wgsl`): what DiffusionGemma's passes need beyond LLaDA's
//! bidirectional attention — a causal encoder with a window on sliding layers, scale 1 (the
//! q/k norms carry it) and head dims up to 512. One workgroup per (query row, head); f32 K/V.
//! Hand-written: no crate runs attention on wgpu.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::attention::{AttentionShape, KvSegment};
use super::elementwise::{check, check_f32, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

const ATTENTION_MASKED: KernelSource = kernel_source!("attention_masked");
/// Largest head dimension (`MAX_HD` in the shader): DiffusionGemma's full layers use 512.
pub const MAX_MASKED_HEAD_DIM: usize = 512;

pub fn variants() -> Vec<ShaderVariant> {
    vec![ShaderVariant {
        kernel: ATTENTION_MASKED,
        entry: "main",
        spec: Spec::new(),
    }]
}

/// Which keys a query row sees. Keys are indexed over segment A's rows then B's; query row
/// `r` sits at key index `query_start + r`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionMask {
    /// Keys after the row's own index are hidden.
    pub causal: bool,
    /// With `causal`: only the last `window` keys up to the row's own (0: no window).
    pub window: usize,
    pub query_start: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct MaskedParams {
    rows: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    q_stride: u32,
    q_col: u32,
    start_a: u32,
    len_a: u32,
    start_b: u32,
    len_b: u32,
    causal: u32,
    window: u32,
    query_start: u32,
    scale: f32,
    _pad: [u32; 2],
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "attention_masked",
        "main",
        MaskedParams {
            rows,
            n_heads,
            n_kv_heads,
            head_dim,
            q_stride,
            q_col,
            start_a,
            len_a,
            start_b,
            len_b,
            causal,
            window,
            query_start,
            scale
        }
    )]
}

/// Attention of `rows` query rows (row `r`, head `h` at `q[r·q_stride + q_col + h·head_dim]`)
/// over `seg_a` (optional) then `seg_b`, masked by `mask`, scores times `scale`, into `out`
/// f32 `[rows, n_heads·head_dim]`. Query head `h` reads kv head `h / (n_heads / n_kv_heads)`.
#[allow(clippy::too_many_arguments)] // the buffers of one dispatch and its shape
pub fn attention_masked(
    step: &mut StepEncoder,
    q: &Tensor,
    q_stride: usize,
    q_col: usize,
    rows: usize,
    seg_a: Option<KvSegment>,
    seg_b: KvSegment,
    out: &Tensor,
    shape: AttentionShape,
    mask: AttentionMask,
    scale: f32,
) -> Result<()> {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    check(
        "attention_masked",
        (1..=MAX_MASKED_HEAD_DIM).contains(&head_dim)
            && n_kv_heads > 0
            && n_heads.is_multiple_of(n_kv_heads)
            && q_col + n_heads * head_dim <= q_stride,
        || {
            format!(
                "head_dim in 1..={MAX_MASKED_HEAD_DIM}, n_heads a multiple of n_kv_heads, \
                 the heads within q's rows"
            )
        },
        || {
            format!(
                "head_dim {head_dim}, {n_heads} heads over {n_kv_heads} kv heads, \
                 q columns {q_col}.. of {q_stride}"
            )
        },
    )?;
    let seg_a = seg_a.filter(|s| s.len > 0);
    let n_keys = seg_a.map_or(0, |s| s.len) + seg_b.len;
    check(
        "attention_masked",
        n_keys > 0 && scale.is_finite() && (!mask.causal || mask.query_start < n_keys),
        || "at least one key, a finite scale, a causal row's own key among the keys".into(),
        || {
            format!(
                "{n_keys} keys, scale {scale}, query_start {}",
                mask.query_start
            )
        },
    )?;
    check(
        "attention_masked",
        mask.causal || mask.window == 0,
        || "a window only with a causal mask".into(),
        || format!("window {} without causal", mask.window),
    )?;
    if rows == 0 {
        return Ok(());
    }
    let kv_w = n_kv_heads * head_dim;
    check_f32(
        "attention_masked q",
        q,
        (rows - 1) * q_stride + q_col + n_heads * head_dim,
    )?;
    check_f32("attention_masked out", out, rows * n_heads * head_dim)?;
    for (name, s) in [("segment A", seg_a), ("segment B", Some(seg_b))] {
        if let Some(s) = s {
            for t in [s.k, s.v] {
                check(
                    "attention_masked",
                    t.dtype == DType::F32,
                    || format!("{name} K/V in f32"),
                    || format!("{:?}", t.dtype),
                )?;
                check_f32("attention_masked K/V", t, (s.start + s.len) * kv_w)?;
            }
        }
    }
    let a = seg_a.unwrap_or(KvSegment {
        k: seg_b.k,
        v: seg_b.v,
        start: 0,
        len: 0,
    });
    let params = MaskedParams {
        rows: u32_of(rows),
        n_heads: u32_of(n_heads),
        n_kv_heads: u32_of(n_kv_heads),
        head_dim: u32_of(head_dim),
        q_stride: u32_of(q_stride),
        q_col: u32_of(q_col),
        start_a: u32_of(a.start),
        len_a: u32_of(a.len),
        start_b: u32_of(seg_b.start),
        len_b: u32_of(seg_b.len),
        causal: u32::from(mask.causal),
        window: u32_of(mask.window),
        query_start: u32_of(mask.query_start),
        scale,
        _pad: [0; 2],
    };
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&ATTENTION_MASKED, "main", &Spec::new())?;
    step.dispatch(
        &pipeline,
        &params,
        &[
            q.into(),
            a.k.into(),
            a.v.into(),
            seg_b.k.into(),
            seg_b.v.into(),
            out.into(),
        ],
        groups_2d(ctx, u32_of(rows * n_heads)),
    );
    Ok(())
}
