//! ACache's kernels: a stored span's K/V placed at a request's offset (keys re-rotated), and
//! the anchor choice of the probe pass (importance summed over layers, then top-k), all on
//! the GPU; only the chosen anchors are read back, once per request.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::elementwise::{check, check_f32, check_u32, kv_spec, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

const SPAN_PLACE: KernelSource = kernel_source!("span_place");
const ANCHOR_PROBE: KernelSource = kernel_source!("anchor_probe");
const PROBE_ENTRIES: [&str; 3] = ["stats_main", "accumulate_main", "select_main"];

pub fn variants() -> Vec<ShaderVariant> {
    let mut v = Vec::new();
    for kv_f16 in [false, true] {
        let spec = Spec::new().flag_if(kv_f16, "KV_F16");
        v.push(ShaderVariant {
            kernel: SPAN_PLACE,
            entry: "main",
            spec: spec.clone(),
        });
        for entry in PROBE_ENTRIES {
            v.push(ShaderVariant {
                kernel: ANCHOR_PROBE,
                entry,
                spec: spec.clone(),
            });
        }
    }
    v
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct PlaceParams {
    rows: u32,
    n_kv_heads: u32,
    head_dim: u32,
    src_row: u32,
    dst_row: u32,
    offset: u32,
    max_pos: u32,
    _pad: u32,
}

/// The layout of one K/V layer: heads and head width, and its storage.
#[derive(Clone, Copy, Debug)]
pub struct KvShape {
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Rows `src_row..src_row + rows` of a stored span's K/V layer into rows `dst_row..` of an
/// arena layer, each key rotated by `offset` positions (`table`: the model's RoPE rows).
#[allow(clippy::too_many_arguments)] // the buffers of one dispatch and its rows
pub fn place_span(
    step: &mut StepEncoder,
    src: (&Tensor, &Tensor),
    dst: (&Tensor, &Tensor),
    table: &Tensor,
    table_rows: usize,
    shape: KvShape,
    src_row: usize,
    dst_row: usize,
    rows: usize,
    offset: usize,
) -> Result<()> {
    let width = shape.n_kv_heads * shape.head_dim;
    check(
        "place_span",
        shape.head_dim.is_multiple_of(4) && offset < table_rows,
        || format!("head_dim a multiple of 4 and an offset below the table's {table_rows} rows"),
        || format!("head_dim {}, offset {offset}", shape.head_dim),
    )?;
    check_f32("place_span table", table, table_rows * shape.head_dim)?;
    let spec = kv_spec("place_span source", &[src.0, src.1], width, src_row + rows)?;
    kv_spec("place_span arena", &[dst.0, dst.1], width, dst_row + rows)?;
    if src.0.dtype != dst.0.dtype {
        return Err(crate::error::GpuError::Shape {
            op: "place_span",
            expected: format!("a span stored as the arena ({:?})", dst.0.dtype),
            found: format!("{:?}", src.0.dtype),
        });
    }
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&SPAN_PLACE, "main", &spec)?;
    let params = PlaceParams {
        rows: u32_of(rows),
        n_kv_heads: u32_of(shape.n_kv_heads),
        head_dim: u32_of(shape.head_dim),
        src_row: u32_of(src_row),
        dst_row: u32_of(dst_row),
        offset: u32_of(offset),
        max_pos: u32_of(table_rows),
        _pad: 0,
    };
    step.dispatch(
        &pipeline,
        &params,
        &[
            src.0.into(),
            src.1.into(),
            table.into(),
            dst.0.into(),
            dst.1.into(),
        ],
        groups_2d(ctx, u32_of(rows)),
    );
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct ProbeParams {
    n_queries: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    qkv_stride: u32,
    span_start: u32,
    span_len: u32,
    k: u32,
    scale: f32,
    _pad: [u32; 3],
}

/// The buffers of one request's probe: which rows of the pass are its masked positions,
/// where the span's keys are in the arena, and the importance and choice it accumulates.
pub struct AnchorProbe {
    /// Rows of the pass (indices into its QKV rows) whose attention counts.
    pub query_rows: Tensor,
    pub n_queries: usize,
    /// Arena rows of the span's keys.
    pub span_start: usize,
    pub span_len: usize,
    /// Anchors to choose.
    pub k: usize,
    /// (max, sum) of each (query, head) of the current layer.
    pub stats: Tensor,
    /// Summed attention weight of each span key (zeroed when made).
    pub importance: Tensor,
    /// 1 for the chosen anchors, per span key.
    pub selected: Tensor,
}

/// The heads of a pass's QKV rows.
#[derive(Clone, Copy, Debug)]
pub struct ProbeShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AnchorProbe {
    pub fn new(
        ctx: &crate::GpuContext,
        query_rows: &[u32],
        span_start: usize,
        span_len: usize,
        k: usize,
        n_heads: usize,
    ) -> Result<Self> {
        let n_queries = query_rows.len();
        let rows = if query_rows.is_empty() {
            Tensor::zeros(ctx, DType::U32, &[1], "probe query rows")?
        } else {
            Tensor::from_u32(ctx, &[n_queries], query_rows, "probe query rows")?
        };
        let span = span_len.max(1);
        Ok(Self {
            query_rows: rows,
            n_queries,
            span_start,
            span_len,
            k: k.min(span_len),
            stats: Tensor::zeros(
                ctx,
                DType::F32,
                &[n_queries.max(1) * n_heads, 2],
                "probe stats",
            )?,
            importance: Tensor::zeros(ctx, DType::F32, &[span], "anchor importance")?,
            selected: Tensor::zeros(ctx, DType::U32, &[span], "anchors")?,
        })
    }

    fn params(&self, s: ProbeShape) -> ProbeParams {
        ProbeParams {
            n_queries: u32_of(self.n_queries),
            n_heads: u32_of(s.n_heads),
            n_kv_heads: u32_of(s.n_kv_heads),
            head_dim: u32_of(s.head_dim),
            qkv_stride: u32_of((s.n_heads + 2 * s.n_kv_heads) * s.head_dim),
            span_start: u32_of(self.span_start),
            span_len: u32_of(self.span_len),
            k: u32_of(self.k),
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            _pad: [0; 3],
        }
    }

    fn bindings<'t>(&'t self, qkv: &'t Tensor, keys: &'t Tensor) -> [crate::step::Binding; 6] {
        [
            qkv.into(),
            keys.into(),
            (&self.query_rows).into(),
            (&self.stats).into(),
            (&self.importance).into(),
            (&self.selected).into(),
        ]
    }

    /// Adds one layer's attention weights of the masked rows over the span's keys (softmax
    /// over the span alone) to the importance: `qkv` holds the layer's rotated q heads,
    /// `keys` the layer's K arena.
    pub fn encode_layer(
        &self,
        step: &mut StepEncoder,
        qkv: &Tensor,
        keys: &Tensor,
        s: ProbeShape,
    ) -> Result<()> {
        if self.n_queries == 0 || self.span_len == 0 {
            return Ok(());
        }
        let stride = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim;
        check_f32("anchor probe qkv", qkv, stride)?;
        check_u32("anchor probe rows", &self.query_rows, self.n_queries)?;
        let width = s.n_kv_heads * s.head_dim;
        let spec = kv_spec(
            "anchor probe keys",
            &[keys],
            width,
            self.span_start + self.span_len,
        )?;
        let ctx = step.ctx();
        let params = self.params(s);
        let bindings = self.bindings(qkv, keys);
        let stats = ctx.pipeline(&ANCHOR_PROBE, "stats_main", &spec)?;
        let pairs = u32_of(self.n_queries * s.n_heads);
        step.dispatch(&stats, &params, &bindings, groups_2d(ctx, pairs));
        let acc = ctx.pipeline(&ANCHOR_PROBE, "accumulate_main", &spec)?;
        step.dispatch(
            &acc,
            &params,
            &bindings,
            groups_2d(ctx, u32_of(self.span_len)),
        );
        Ok(())
    }

    /// Marks the `k` most important span keys (ties to the lower position) in `selected`;
    /// `keys` is any K layer the probe read (bound, not read).
    pub fn encode_select(
        &self,
        step: &mut StepEncoder,
        qkv: &Tensor,
        keys: &Tensor,
        s: ProbeShape,
    ) -> Result<()> {
        if self.span_len == 0 {
            return Ok(());
        }
        let spec = Spec::new().flag_if(keys.dtype == DType::F16, "KV_F16");
        let ctx = step.ctx();
        let pipeline = ctx.pipeline(&ANCHOR_PROBE, "select_main", &spec)?;
        let groups = u32_of(self.span_len.div_ceil(64));
        step.dispatch(
            &pipeline,
            &self.params(s),
            &self.bindings(qkv, keys),
            groups_2d(ctx, groups),
        );
        Ok(())
    }
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![
        host_params!(
            "span_place",
            "main",
            PlaceParams {
                rows,
                n_kv_heads,
                head_dim,
                src_row,
                dst_row,
                offset,
                max_pos
            }
        ),
        host_params!(
            "anchor_probe",
            "*",
            ProbeParams {
                n_queries,
                n_heads,
                n_kv_heads,
                head_dim,
                qkv_stride,
                span_start,
                span_len,
                k,
                scale
            }
        ),
    ]
}
