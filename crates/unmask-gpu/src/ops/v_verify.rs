//! dLLM-Cache's V-verify on the GPU: per response row, the cosine of its new V against the
//! V cached in its arena row; the k rows of lowest cosine as a row list that later
//! dispatches of the layer read (no read-back inside a step); then every row's new V into
//! the arena.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::elementwise::{check, check_f32, check_u32, kv_spec, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

const V_VERIFY: KernelSource = kernel_source!("v_verify");
const ENTRIES: [&str; 4] = ["cosine_main", "select_main", "compact_main", "store_main"];

pub fn variants() -> Vec<ShaderVariant> {
    let mut v = Vec::new();
    for kv_f16 in [false, true] {
        for bias in [false, true] {
            for entry in ENTRIES {
                v.push(ShaderVariant {
                    kernel: V_VERIFY,
                    entry,
                    spec: Spec::new().flag_if(kv_f16, "KV_F16").flag_if(bias, "BIAS"),
                });
            }
        }
    }
    v.push(ShaderVariant {
        kernel: V_VERIFY,
        entry: "select_main",
        spec: Spec::new().flag("MOST_SIMILAR"),
    });
    v
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct VerifyParams {
    rows: u32,
    kv_w: u32,
    qkv_stride: u32,
    v_col: u32,
    k: u32,
    row0: u32,
    list_base: u32,
    skip_start: u32,
    skip_end: u32,
    _pad: [u32; 3],
}

/// Where V sits in a pass's QKV rows.
#[derive(Clone, Copy, Debug)]
pub struct QkvLayout {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// The scratch of V-verify for up to `capacity` response rows at a time.
pub struct VVerify {
    pub capacity: usize,
    /// Cosine of each row's new V against its cached V.
    pub cosine: Tensor,
    /// 1 for the rows chosen.
    pub selected: Tensor,
}

/// The rows one V-verify checks: pass rows `row0..row0 + rows` (one sequence's response),
/// `k` of them picked into the list from slot `list_base`.
#[derive(Clone, Debug)]
pub struct VerifyRows {
    pub row0: usize,
    pub rows: usize,
    pub k: usize,
    pub list_base: usize,
    /// Pick the rows of highest cosine instead (a deliberately wrong cache).
    pub most_similar: bool,
    /// Rows (counted from `row0`) never picked: rows the step computes anyway.
    pub skip: std::ops::Range<usize>,
}

/// The buffers a V-verify reads and writes: the pass's QKV rows (new V in their V
/// columns, before `bias`), the V arena and each pass row's arena row, and the list.
#[derive(Clone, Copy)]
pub struct VerifyBuffers<'a> {
    pub qkv: &'a Tensor,
    pub bias: Option<&'a Tensor>,
    pub v: &'a Tensor,
    pub arena_rows: &'a Tensor,
    pub list: &'a Tensor,
}

impl VVerify {
    pub fn new(ctx: &crate::GpuContext, capacity: usize) -> Result<Self> {
        let cap = capacity.max(1);
        Ok(Self {
            capacity: cap,
            cosine: Tensor::zeros(ctx, DType::F32, &[cap], "v-verify cosine")?,
            selected: Tensor::zeros(ctx, DType::U32, &[cap], "v-verify selected")?,
        })
    }

    /// Records V-verify of `r.rows` pass rows whose cached V are at their arena rows of
    /// the V arena: the pass rows of the `r.k` of lowest cosine go to the list (in row
    /// order, from slot `r.list_base`), then every row's new V into its arena row.
    pub fn encode(
        &self,
        step: &mut StepEncoder,
        b: VerifyBuffers<'_>,
        r: VerifyRows,
        layout: QkvLayout,
    ) -> Result<()> {
        let kv_w = layout.n_kv_heads * layout.head_dim;
        let stride = (layout.n_heads + 2 * layout.n_kv_heads) * layout.head_dim;
        let (rows, k) = (r.rows, r.k);
        check(
            "v_verify",
            rows <= self.capacity
                && k + r.skip.len() <= rows
                && r.skip.end <= rows
                && kv_w.is_multiple_of(2),
            || {
                format!(
                    "at most {} rows, k at most the rows outside the skipped ones, an even K/V width",
                    self.capacity
                )
            },
            || format!("{rows} rows, k {k}, skipped {:?}, K/V width {kv_w}", r.skip),
        )?;
        check_f32("v_verify qkv", b.qkv, (r.row0 + rows) * stride)?;
        check_u32("v_verify arena rows", b.arena_rows, r.row0 + rows)?;
        check_u32("v_verify list", b.list, r.list_base + k)?;
        if let Some(bias) = b.bias {
            check_f32("v_verify bias", bias, stride)?;
        }
        let spec = kv_spec("v_verify arena", &[b.v], kv_w, 1)?
            .flag_if(b.bias.is_some(), "BIAS")
            .flag_if(r.most_similar, "MOST_SIMILAR");
        if rows == 0 {
            return Ok(());
        }
        let ctx = step.ctx();
        let params = VerifyParams {
            rows: u32_of(rows),
            kv_w: u32_of(kv_w),
            qkv_stride: u32_of(stride),
            v_col: u32_of((layout.n_heads + layout.n_kv_heads) * layout.head_dim),
            k: u32_of(k),
            row0: u32_of(r.row0),
            list_base: u32_of(r.list_base),
            skip_start: u32_of(r.skip.start),
            skip_end: u32_of(r.skip.end),
            _pad: [0; 3],
        };
        let bindings: Vec<_> = [
            b.qkv.into(),
            b.v.into(),
            b.arena_rows.into(),
            (&self.cosine).into(),
            (&self.selected).into(),
            b.list.into(),
        ]
        .into_iter()
        .chain(b.bias.map(Into::into))
        .collect();
        let per_row = groups_2d(ctx, u32_of(rows));
        let per_64 = groups_2d(ctx, u32_of(rows.div_ceil(64)));
        for (entry, groups) in [
            ("cosine_main", per_row),
            ("select_main", per_64),
            ("compact_main", per_64),
            ("store_main", per_row),
        ] {
            let pipeline = ctx.pipeline(&V_VERIFY, entry, &spec)?;
            step.dispatch(&pipeline, &params, &bindings, groups);
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "v_verify",
        "*",
        VerifyParams {
            rows,
            kv_w,
            qkv_stride,
            v_col,
            k,
            row0,
            list_base,
            skip_start,
            skip_end
        }
    )]
}
