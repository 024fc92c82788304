//! Bidirectional attention over two KV segments (DESIGN.md §3): every query row attends to
//! all keys of segment A (a shared or per-request prefix, possibly empty) and of segment B
//! (the request's KV arena), with one online softmax across both. No causal mask.
//!
//! One dispatch, one kernel (`shaders/attention.wgsl`, specialised per head dim): a
//! workgroup takes 8 (query row, query head) pairs of one kv head and walks the keys in
//! tiles, with 8 x 8 register blocks in both products. There is no subgroup variant: the
//! invocations exchange data by broadcast through workgroup memory, not by reductions, and
//! the one reduction (the row max, phase 2) is a few percent of the instructions on lavapipe.

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use crate::error::{GpuError, Result};
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{Binding, StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

const ATTENTION: KernelSource = kernel_source!("attention");

/// Largest head dimension the kernel supports (LLaDA-8B uses 128).
pub const MAX_HEAD_DIM: usize = 128;

/// Browser limit on workgroup memory.
const WORKGROUP_BYTES: usize = 16 * 1024;

/// Head layout of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Keys and values of one segment: f32 rows `[.., n_kv_heads * head_dim]`, contiguous,
/// keys already rotated (RoPE) at their absolute positions. Rows `start..start + len` are
/// read: a batch keeps every sequence's arena in one buffer, one after the other.
#[derive(Clone, Copy, Debug)]
pub struct KvSegment<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub start: usize,
    pub len: usize,
}

impl<'a> KvSegment<'a> {
    /// The first `len` rows of `k` and `v`.
    pub fn first(k: &'a Tensor, v: &'a Tensor, len: usize) -> Self {
        Self {
            k,
            v,
            start: 0,
            len,
        }
    }
}

/// Query units per workgroup (fixed by the kernel's register blocks).
const UNITS_PER_GROUP: usize = 8;

/// Workgroup shape of one head dimension. The kernel gives every invocation 8 keys in the
/// score phase and 8 head dims in the P·V phase, so `wg` covers the head dim 8 at a time
/// (at least 8, the units of phase 2) and a key tile holds `8 * wg` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tile {
    head_dim: usize,
    wg: usize,
}

impl Tile {
    fn for_head_dim(head_dim: usize) -> Self {
        let wg = head_dim
            .div_ceil(8)
            .next_multiple_of(8)
            .max(UNITS_PER_GROUP);
        let tile = Tile { head_dim, wg };
        debug_assert!(tile.is_consistent(), "{tile:?}");
        tile
    }

    fn bk(&self) -> usize {
        8 * self.wg
    }

    fn is_consistent(&self) -> bool {
        8 * self.wg >= self.head_dim
            && self.wg >= UNITS_PER_GROUP
            && self.wg <= 256
            && self.workgroup_bytes() <= WORKGROUP_BYTES
    }

    fn workgroup_bytes(&self) -> usize {
        4 * UNITS_PER_GROUP * (self.head_dim + 2 * self.bk() + 2)
    }

    fn spec(&self) -> Spec {
        Spec::new()
            .constant("HD", self.head_dim)
            .constant("WG", self.wg)
            .constant("QS_LEN", 2 * self.head_dim)
            .constant("PS_LEN", 2 * self.bk())
            .flag_if(self.head_dim.is_multiple_of(4), "VEC4")
    }
}

/// Every attention pipeline the runtime can build: one per head dimension.
pub fn variants() -> Vec<ShaderVariant> {
    (1..=MAX_HEAD_DIM)
        .map(|hd| ShaderVariant {
            kernel: ATTENTION,
            entry: "main",
            spec: Tile::for_head_dim(hd).spec(),
        })
        .collect()
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
struct Params {
    units: u32,
    group: u32,
    q_stride: u32,
    q_col: u32,
    len_a: u32,
    len_b: u32,
    kv_stride: u32,
    out_stride: u32,
    unit_blocks: u32,
    n_kv_heads: u32,
    scale_log2: f32,
    row0: u32,
    b_row0: u32,
    a_row0: u32,
    _pad: u32,
}

fn shape_error(expected: String, found: String) -> GpuError {
    GpuError::Shape {
        op: "attention",
        expected,
        found,
    }
}

fn check_f32(what: &str, t: &Tensor, min_elems: usize) -> Result<()> {
    if t.dtype == DType::F32 && t.numel() >= min_elems {
        Ok(())
    } else {
        Err(shape_error(
            format!("{what}: f32 tensor with at least {min_elems} elements"),
            format!("{:?} {:?}", t.dtype, t.shape),
        ))
    }
}

fn to_u32(what: &str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| shape_error(format!("{what} below 2^32"), x.to_string()))
}

/// Records attention of the query rows `rows` over `seg_a` (optional) and `seg_b`.
///
/// Query row `r`, head `h` is read at `q[r * q_stride + q_col + h * head_dim ..]` (q is
/// usually a slice of the fused QKV projection output, RoPE applied). The result goes to
/// rows `rows` of `out`, f32 `[.., n_heads * head_dim]`. Scale `1/sqrt(head_dim)`; query
/// head `h` uses kv head `h / (n_heads / n_kv_heads)`. A batch calls this once per
/// sequence, each with its own rows and arena window, into one shared `out`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    step: &mut StepEncoder,
    q: &Tensor,
    q_stride: usize,
    q_col: usize,
    rows: std::ops::Range<usize>,
    seg_a: Option<KvSegment>,
    seg_b: KvSegment,
    out: &Tensor,
    shape: AttentionShape,
) -> Result<()> {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(shape_error(
            format!("head_dim in 1..={MAX_HEAD_DIM}"),
            format!("head_dim {head_dim}"),
        ));
    }
    if n_kv_heads == 0 || n_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(shape_error(
            "n_heads a positive multiple of n_kv_heads".into(),
            format!("n_heads {n_heads}, n_kv_heads {n_kv_heads}"),
        ));
    }
    let q_width = n_heads * head_dim;
    if q_col + q_width > q_stride {
        return Err(shape_error(
            format!("q_col + n_heads * head_dim <= q_stride ({q_col} + {q_width})"),
            format!("q_stride {q_stride}"),
        ));
    }
    let seg_a = seg_a.filter(|s| s.len > 0);
    let len_a = seg_a.map_or(0, |s| s.len);
    let n_keys = len_a + seg_b.len;
    if n_keys == 0 {
        return Err(shape_error(
            "at least one key in segment A or B".into(),
            "two empty segments".into(),
        ));
    }
    let m = rows.len();
    if m == 0 {
        return Ok(());
    }
    let kv_stride = n_kv_heads * head_dim;
    check_f32("q", q, (rows.end - 1) * q_stride + q_col + q_width)?;
    check_f32("out", out, rows.end * q_width)?;
    for (name, seg) in [("segment A", seg_a), ("segment B", Some(seg_b))] {
        if let Some(s) = seg {
            let end = (s.start + s.len) * kv_stride;
            check_f32(&format!("{name} keys"), s.k, end)?;
            check_f32(&format!("{name} values"), s.v, end)?;
        }
    }
    let mut inputs = vec![
        ("q", q),
        ("segment B keys", seg_b.k),
        ("segment B values", seg_b.v),
    ];
    if let Some(a) = &seg_a {
        inputs.extend([("segment A keys", a.k), ("segment A values", a.v)]);
    }
    if let Some((name, _)) = inputs
        .iter()
        .find(|(_, t)| Arc::ptr_eq(&t.buffer, &out.buffer))
    {
        return Err(shape_error(
            "out in a buffer of its own".into(),
            format!("out shares its buffer with {name}"),
        ));
    }
    // The vec4 kernel binds K and V as arrays of 16-byte elements (`Tensor` buffers are).
    let misaligned = inputs[1..]
        .iter()
        .find(|(_, t)| !t.buffer.size().is_multiple_of(16));
    if let (true, Some((name, t))) = (head_dim.is_multiple_of(4), misaligned) {
        return Err(shape_error(
            format!("{name}: a buffer size that is a multiple of 16 bytes"),
            format!("{} bytes", t.buffer.size()),
        ));
    }

    let ctx = step.ctx();
    let tile = Tile::for_head_dim(head_dim);
    let group = n_heads / n_kv_heads;
    let units = m * group;
    let unit_blocks = units.div_ceil(UNITS_PER_GROUP);
    let params = Params {
        units: to_u32("query units", units)?,
        group: group as u32,
        q_stride: to_u32("q_stride", q_stride)?,
        q_col: to_u32("q_col", q_col)?,
        len_a: to_u32("segment A length", len_a)?,
        len_b: to_u32("segment B length", seg_b.len)?,
        kv_stride: kv_stride as u32,
        out_stride: q_width as u32,
        unit_blocks: to_u32("query blocks", unit_blocks)?,
        n_kv_heads: n_kv_heads as u32,
        scale_log2: std::f32::consts::LOG2_E / (head_dim as f32).sqrt(),
        row0: to_u32("first query row", rows.start)?,
        b_row0: to_u32("segment B start", seg_b.start)?,
        a_row0: to_u32("segment A start", seg_a.map_or(0, |s| s.start))?,
        _pad: 0,
    };
    let groups = groups_2d(ctx, to_u32("workgroups", unit_blocks * n_kv_heads)?);
    let pipeline = ctx.pipeline(&ATTENTION, "main", &tile.spec())?;
    // Without segment A, B's buffers stand in for it (read-only bindings may alias).
    let (ka, va) = match &seg_a {
        Some(a) => (a.k, a.v),
        None => (seg_b.k, seg_b.v),
    };
    let bindings: [Binding; 6] = [
        q.into(),
        ka.into(),
        va.into(),
        seg_b.k.into(),
        seg_b.v.into(),
        out.into(),
    ];
    step.dispatch(&pipeline, &params, &bindings, groups);
    Ok(())
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "attention",
        "*",
        Params {
            units,
            group,
            q_stride,
            q_col,
            len_a,
            len_b,
            kv_stride,
            out_stride,
            unit_blocks,
            n_kv_heads,
            scale_log2,
            row0,
            b_row0,
            a_row0,
        }
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_browser_limits() {
        for hd in 1..=MAX_HEAD_DIM {
            let t = Tile::for_head_dim(hd);
            assert!(t.is_consistent(), "{t:?}");
        }
    }
}
