//! Row-wise kernels of the forward pass: embedding gather, RMSNorm, RoPE fused with the
//! arena write, row gather and scatter, residual add (the adaptive step's). The unfused
//! kernels the fused ones replaced are in `unfused`.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use crate::error::{GpuError, Result};
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor, Weight, WeightFormat};

#[cfg(test)]
mod host;

#[cfg(test)]
pub(crate) use host::host_params;

const EMBED: KernelSource = kernel_source!("embed");
const RMSNORM: KernelSource = kernel_source!("rmsnorm");
pub(super) const COPY_ROWS: KernelSource = kernel_source!("copy_rows");
const ROPE_QKV: KernelSource = kernel_source!("rope_qkv");
const ADD: KernelSource = kernel_source!("add");
const PACK_F16: KernelSource = kernel_source!("pack_f16");

/// Spec flags that select how a kernel reads a weight of the given format.
pub fn weight_spec(format: WeightFormat) -> Spec {
    match format {
        WeightFormat::F32 => Spec::new().flag("W_F32"),
        WeightFormat::F16Packed => Spec::new().flag("W_PACKED"),
        WeightFormat::F16Native => Spec::new().flag("F16"),
        WeightFormat::Q8 => Spec::new().flag("W_QUANT").flag("W_Q8"),
        WeightFormat::Q4 => Spec::new().flag("W_QUANT").flag("W_Q4"),
    }
}

pub fn variants() -> Vec<ShaderVariant> {
    let mut v: Vec<ShaderVariant> = WeightFormat::ALL
        .into_iter()
        .map(|f| ShaderVariant {
            kernel: EMBED,
            entry: "main",
            spec: weight_spec(f),
        })
        .collect();
    for (kernel, entry) in [
        (RMSNORM, "main"),
        (COPY_ROWS, "gather"),
        (COPY_ROWS, "scatter"),
        (ADD, "main"),
        (PACK_F16, "main"),
    ] {
        v.push(ShaderVariant {
            kernel,
            entry,
            spec: Spec::new(),
        });
    }
    v.push(ShaderVariant {
        kernel: RMSNORM,
        entry: "main",
        spec: Spec::new().flag("STATS"),
    });
    for entry in ["gather", "scatter"] {
        v.push(ShaderVariant {
            kernel: COPY_ROWS,
            entry,
            spec: Spec::new().flag("U32"),
        });
    }
    for bias in [false, true] {
        for kv_f16 in [false, true] {
            v.push(ShaderVariant {
                kernel: ROPE_QKV,
                entry: "main",
                spec: Spec::new().flag_if(bias, "BIAS").flag_if(kv_f16, "KV_F16"),
            });
        }
    }
    v
}

pub(super) fn check(
    op: &'static str,
    ok: bool,
    expected: impl FnOnce() -> String,
    found: impl FnOnce() -> String,
) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::Shape {
            op,
            expected: expected(),
            found: found(),
        })
    }
}

pub(super) fn check_f32(op: &'static str, t: &Tensor, min_elems: usize) -> Result<()> {
    check(
        op,
        t.dtype == DType::F32 && t.numel() >= min_elems,
        || format!("f32 tensor with at least {min_elems} elements"),
        || format!("{:?} {:?}", t.dtype, t.shape),
    )
}

pub(super) fn check_u32(op: &'static str, t: &Tensor, min_elems: usize) -> Result<()> {
    check(
        op,
        t.dtype == DType::U32 && t.numel() >= min_elems,
        || format!("u32 tensor with at least {min_elems} elements"),
        || format!("{:?} {:?}", t.dtype, t.shape),
    )
}

/// Checks K/V layers (all f32 or all f16, each at least `rows` rows of `width`) and gives
/// the spec flag their storage needs (`KV_F16`).
pub(super) fn kv_spec(
    op: &'static str,
    tensors: &[&Tensor],
    width: usize,
    rows: usize,
) -> Result<Spec> {
    let dtype = tensors[0].dtype;
    check(
        op,
        matches!(dtype, DType::F32 | DType::F16)
            && tensors
                .iter()
                .all(|t| t.dtype == dtype && t.numel() >= width * rows),
        || format!("K/V layers all f32 or all f16 with {rows} rows of {width}"),
        || {
            tensors
                .iter()
                .map(|t| format!("{:?} {:?}", t.dtype, t.shape))
                .collect::<Vec<_>>()
                .join(", ")
        },
    )?;
    Ok(Spec::new().flag_if(dtype == DType::F16, "KV_F16"))
}

pub(super) fn u32_of(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct EmbedParams {
    rows: u32,
    cols: u32,
    row_stride: u32,
    row_start: u32,
    chunk_rows: u32,
    s_off: u32,
    _pad: [u32; 2],
}

/// out[r, :] = table[ids[r], :] for r < rows. Ids must be below `table.rows` (checked by callers
/// that own the ids; an id outside every chunk leaves its row untouched).
pub fn embed(
    step: &mut StepEncoder,
    ids: &Tensor,
    table: &Weight,
    out: &Tensor,
    rows: usize,
) -> Result<()> {
    check_u32("embed ids", ids, rows)?;
    check_f32("embed out", out, rows * table.cols)?;
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&EMBED, "main", &weight_spec(table.format))?;
    for chunk in &table.chunks {
        let params = EmbedParams {
            rows: u32_of(rows),
            cols: u32_of(table.cols),
            row_stride: u32_of(table.row_stride),
            row_start: u32_of(chunk.row_start),
            chunk_rows: u32_of(chunk.rows),
            s_off: u32_of(table.scales_word_offset(chunk.rows)),
            _pad: [0; 2],
        };
        step.dispatch(
            &pipeline,
            &params,
            &[ids.into(), chunk.into(), out.into()],
            groups_2d(ctx, u32_of(rows)),
        );
    }
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct NormParams {
    rows: u32,
    cols: u32,
    eps: f32,
    _pad: u32,
}

/// out = weight * x / sqrt(mean(x^2) + eps) over rows of `cols` values.
pub fn rms_norm(
    step: &mut StepEncoder,
    x: &Tensor,
    weight: &Tensor,
    out: &Tensor,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<()> {
    check_f32("rms_norm x", x, rows * cols)?;
    check_f32("rms_norm weight", weight, cols)?;
    check_f32("rms_norm out", out, rows * cols)?;
    dispatch_norm(step, Spec::new(), &[x, weight, out], rows, cols, eps)
}

/// out[r] = 1 / sqrt(mean(x[r]^2) + eps) for each of `rows` rows of `cols` values: the row
/// statistics of an RMSNorm that a matmul folds into its loads (`Coop` with a norm).
pub fn rms_stats(
    step: &mut StepEncoder,
    x: &Tensor,
    out: &Tensor,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<()> {
    check_f32("rms_stats x", x, rows * cols)?;
    check_f32("rms_stats out", out, rows)?;
    dispatch_norm(step, Spec::new().flag("STATS"), &[x, out], rows, cols, eps)
}

/// One workgroup per row of `shaders/rmsnorm.wgsl` (`spec`: with or without STATS).
fn dispatch_norm(
    step: &mut StepEncoder,
    spec: Spec,
    bindings: &[&Tensor],
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<()> {
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&RMSNORM, "main", &spec)?;
    let params = NormParams {
        rows: u32_of(rows),
        cols: u32_of(cols),
        eps,
        _pad: 0,
    };
    let bindings: Vec<_> = bindings.iter().map(|t| (*t).into()).collect();
    step.dispatch(&pipeline, &params, &bindings, groups_2d(ctx, u32_of(rows)));
    Ok(())
}

/// Host-side cos/sin table `[max_pos, head_dim / 2]` of (cos, sin) pairs, computed like the
/// reference: inverse frequencies and angles in f32, sin/cos of the f32 angle.
pub fn rope_table(theta: f32, head_dim: usize, max_pos: usize) -> Vec<f32> {
    super::heads::rope_table_partial(theta, head_dim, head_dim / 2, max_pos)
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct RopeQkvParams {
    rows: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    row_stride: u32,
    max_pos: u32,
    _pad: [u32; 2],
}

/// The heads of fused QKV rows `[rows, (n_heads + 2 n_kv_heads) head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct QkvShape {
    pub rows: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Rows of the RoPE table.
    pub max_pos: usize,
}

/// RoPE of the q heads in place, and the rotated k heads and the v heads of each row into
/// row `kv_index[r]` of the K and V arenas `[.., n_kv_heads head_dim]`: one dispatch for
/// what RoPE and two row scatters did. `bias` (one value per QKV column) is added to q, k
/// and v before anything else.
#[allow(clippy::too_many_arguments)] // the buffers of one dispatch (bias optional) and its shape
pub fn rope_qkv(
    step: &mut StepEncoder,
    qkv: &Tensor,
    positions: &Tensor,
    table: &Tensor,
    kv_index: &Tensor,
    k_arena: &Tensor,
    v_arena: &Tensor,
    bias: Option<&Tensor>,
    s: QkvShape,
) -> Result<()> {
    check(
        "rope_qkv",
        s.head_dim.is_multiple_of(2),
        || "an even head_dim".into(),
        || format!("head_dim {}", s.head_dim),
    )?;
    let row_stride = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim;
    let kv_w = s.n_kv_heads * s.head_dim;
    check_f32("rope_qkv qkv", qkv, s.rows * row_stride)?;
    check_u32("rope_qkv positions", positions, s.rows)?;
    check_f32("rope_qkv table", table, s.max_pos * s.head_dim)?;
    check_u32("rope_qkv kv_index", kv_index, s.rows)?;
    // The arenas: f32, or f16 (two per word, written a word at a time).
    let kv_f16 = k_arena.dtype == DType::F16;
    check(
        "rope_qkv arenas",
        matches!(k_arena.dtype, DType::F32 | DType::F16)
            && v_arena.dtype == k_arena.dtype
            && k_arena.numel() >= kv_w
            && v_arena.numel() >= kv_w
            && (!kv_f16 || s.head_dim.is_multiple_of(4)),
        || {
            format!(
                "K and V arenas both f32 or both f16 with at least {kv_w} elements (f16: \
                 head_dim a multiple of 4, head_dim {})",
                s.head_dim
            )
        },
        || {
            format!(
                "K {:?} {:?}, V {:?} {:?}",
                k_arena.dtype, k_arena.shape, v_arena.dtype, v_arena.shape
            )
        },
    )?;
    if let Some(bias) = bias {
        check_f32("rope_qkv bias", bias, row_stride)?;
    }
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(
        &ROPE_QKV,
        "main",
        &Spec::new()
            .flag_if(bias.is_some(), "BIAS")
            .flag_if(kv_f16, "KV_F16"),
    )?;
    let params = RopeQkvParams {
        rows: u32_of(s.rows),
        n_heads: u32_of(s.n_heads),
        n_kv_heads: u32_of(s.n_kv_heads),
        head_dim: u32_of(s.head_dim),
        row_stride: u32_of(row_stride),
        max_pos: u32_of(s.max_pos),
        _pad: [0; 2],
    };
    step.dispatch(
        &pipeline,
        &params,
        &[
            qkv.into(),
            positions.into(),
            table.into(),
            kv_index.into(),
            k_arena.into(),
            v_arena.into(),
        ]
        .into_iter()
        .chain(bias.map(Into::into))
        .collect::<Vec<_>>(),
        groups_2d(ctx, u32_of(s.rows)),
    );
    Ok(())
}

/// A column window of rows: `cols` values starting at `col` in rows of `stride` values.
#[derive(Clone, Copy, Debug)]
pub struct RowWindow {
    pub stride: usize,
    pub col: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(super) struct CopyParams {
    rows: u32,
    cols: u32,
    src_stride: u32,
    src_col: u32,
    dst_stride: u32,
    dst_col: u32,
    _pad: [u32; 2],
}

#[allow(clippy::too_many_arguments)]
pub(super) fn copy_rows(
    step: &mut StepEncoder,
    entry: &'static str,
    src: &Tensor,
    src_w: RowWindow,
    idx: &Tensor,
    dst: &Tensor,
    dst_w: RowWindow,
    rows: usize,
    cols: usize,
) -> Result<()> {
    // f32 rows, or u32 rows (positions, arena rows) copied bit for bit.
    let words = src.dtype == DType::U32;
    if words {
        check_u32("copy_rows src", src, 0)?;
        check_u32("copy_rows dst", dst, 0)?;
    } else {
        check_f32("copy_rows src", src, 0)?;
        check_f32("copy_rows dst", dst, 0)?;
    }
    check_u32("copy_rows index", idx, rows)?;
    check(
        "copy_rows",
        src_w.col + cols <= src_w.stride && dst_w.col + cols <= dst_w.stride,
        || "column windows inside their rows".into(),
        || {
            format!(
                "{cols} columns at {} of {} -> at {} of {}",
                src_w.col, src_w.stride, dst_w.col, dst_w.stride
            )
        },
    )?;
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&COPY_ROWS, entry, &Spec::new().flag_if(words, "U32"))?;
    let params = CopyParams {
        rows: u32_of(rows),
        cols: u32_of(cols),
        src_stride: u32_of(src_w.stride),
        src_col: u32_of(src_w.col),
        dst_stride: u32_of(dst_w.stride),
        dst_col: u32_of(dst_w.col),
        _pad: [0; 2],
    };
    step.dispatch(
        &pipeline,
        &params,
        &[src.into(), idx.into(), dst.into()],
        groups_2d(ctx, u32_of(rows)),
    );
    Ok(())
}

/// dst row r (window `dst_w`) = src row idx[r] (window `src_w`), for r < rows; f32 rows,
/// or u32 rows when both tensors are u32.
#[allow(clippy::too_many_arguments)]
pub fn gather_rows(
    step: &mut StepEncoder,
    src: &Tensor,
    src_w: RowWindow,
    idx: &Tensor,
    dst: &Tensor,
    dst_w: RowWindow,
    rows: usize,
    cols: usize,
) -> Result<()> {
    copy_rows(step, "gather", src, src_w, idx, dst, dst_w, rows, cols)
}

/// dst row idx[r] (window `dst.1`) = src row r (window `src.1`), for r < rows of `cols`
/// values (`shape`).
pub fn scatter_rows(
    step: &mut StepEncoder,
    src: (&Tensor, RowWindow),
    idx: &Tensor,
    dst: (&Tensor, RowWindow),
    (rows, cols): (usize, usize),
) -> Result<()> {
    copy_rows(step, "scatter", src.0, src.1, idx, dst.0, dst.1, rows, cols)
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct AddParams {
    n: u32,
    _pad: [u32; 3],
}

/// x[i] += y[i] for i < n.
pub fn add_in_place(step: &mut StepEncoder, x: &Tensor, y: &Tensor, n: usize) -> Result<()> {
    check_f32("add x", x, n)?;
    check_f32("add y", y, n)?;
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&ADD, "main", &Spec::new())?;
    let params = AddParams {
        n: u32_of(n),
        _pad: [0; 3],
    };
    step.dispatch(
        &pipeline,
        &params,
        &[x.into(), y.into()],
        groups_2d(ctx, u32_of(n.div_ceil(256))),
    );
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct PackParams {
    rows: u32,
    cols: u32,
    src_stride: u32,
    dst_stride: u32,
    dst_row: u32,
    _pad: [u32; 3],
}

/// Rows `dst_row..dst_row + rows` of the f16 tensor `dst` (`[.., dst_stride]`) = the first
/// `cols` values of `src`'s f32 rows (`src_stride` apart), rounded to nearest: how K/V
/// computed in f32 enter an f16 cache. `cols` and `dst_stride` even (rows start on a word).
pub fn pack_f16_rows(
    step: &mut StepEncoder,
    src: &Tensor,
    src_stride: usize,
    dst: &Tensor,
    dst_stride: usize,
    dst_row: usize,
    (rows, cols): (usize, usize),
) -> Result<()> {
    check_f32(
        "pack_f16 src",
        src,
        rows.saturating_sub(1) * src_stride + cols,
    )?;
    check(
        "pack_f16 dst",
        dst.dtype == DType::F16
            && cols.is_multiple_of(2)
            && dst_stride.is_multiple_of(2)
            && cols <= dst_stride
            && cols <= src_stride
            && dst.numel() >= (dst_row + rows) * dst_stride,
        || {
            format!(
                "an f16 tensor of at least {} rows of {dst_stride} (even) taking {cols} (even) \
                 of {src_stride} values per row",
                dst_row + rows
            )
        },
        || format!("{:?} {:?}", dst.dtype, dst.shape),
    )?;
    if rows == 0 {
        return Ok(());
    }
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&PACK_F16, "main", &Spec::new())?;
    let params = PackParams {
        rows: u32_of(rows),
        cols: u32_of(cols),
        src_stride: u32_of(src_stride),
        dst_stride: u32_of(dst_stride),
        dst_row: u32_of(dst_row),
        _pad: [0; 3],
    };
    step.dispatch(
        &pipeline,
        &params,
        &[src.into(), dst.into()],
        groups_2d(ctx, u32_of(rows)),
    );
    Ok(())
}
