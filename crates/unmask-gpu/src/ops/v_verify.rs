//! dLLM-Cache's V-verify on the GPU: per response row, the cosine of its new V against the
//! V cached in its arena row; the k rows of lowest cosine as a row list that later
//! dispatches of the layer read (no read-back inside a step).

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::elementwise::{check, check_f32, check_u32, kv_spec, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

const V_VERIFY: KernelSource = kernel_source!("v_verify");
const ENTRIES: [&str; 3] = ["cosine_main", "select_main", "compact_main"];

pub fn variants() -> Vec<ShaderVariant> {
    let mut v = Vec::new();
    for kv_f16 in [false, true] {
        for entry in ENTRIES {
            v.push(ShaderVariant {
                kernel: V_VERIFY,
                entry,
                spec: Spec::new().flag_if(kv_f16, "KV_F16"),
            });
        }
    }
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
    _pad: [u32; 3],
}

/// Where V sits in a pass's QKV rows.
#[derive(Clone, Copy, Debug)]
pub struct QkvLayout {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// The buffers of V-verify for passes of up to `capacity` response rows.
pub struct VVerify {
    pub capacity: usize,
    /// Cosine of each row's new V against its cached V.
    pub cosine: Tensor,
    /// 1 for the rows chosen.
    pub selected: Tensor,
    /// The chosen rows (indices into the pass), in row order; the first k are written.
    pub list: Tensor,
}

impl VVerify {
    pub fn new(ctx: &crate::GpuContext, capacity: usize) -> Result<Self> {
        let cap = capacity.max(1);
        Ok(Self {
            capacity: cap,
            cosine: Tensor::zeros(ctx, DType::F32, &[cap], "v-verify cosine")?,
            selected: Tensor::zeros(ctx, DType::U32, &[cap], "v-verify selected")?,
            list: Tensor::zeros(ctx, DType::U32, &[cap], "v-verify rows")?,
        })
    }

    /// Records V-verify of `rows` QKV rows whose cached V are the `arena_rows` rows of the
    /// V arena `v`: the `k` rows of lowest cosine go to `list`.
    #[allow(clippy::too_many_arguments)] // the buffers of one check and its sizes
    pub fn encode(
        &self,
        step: &mut StepEncoder,
        qkv: &Tensor,
        v: &Tensor,
        arena_rows: &Tensor,
        rows: usize,
        k: usize,
        layout: QkvLayout,
    ) -> Result<()> {
        let kv_w = layout.n_kv_heads * layout.head_dim;
        let stride = (layout.n_heads + 2 * layout.n_kv_heads) * layout.head_dim;
        check(
            "v_verify",
            rows <= self.capacity && k <= rows,
            || format!("at most {} rows and k at most the rows", self.capacity),
            || format!("{rows} rows, k {k}"),
        )?;
        check_f32("v_verify qkv", qkv, rows * stride)?;
        check_u32("v_verify arena rows", arena_rows, rows)?;
        let spec = kv_spec("v_verify arena", &[v], kv_w, 1)?;
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
            _pad: [0; 3],
        };
        let bindings = [
            qkv.into(),
            v.into(),
            arena_rows.into(),
            (&self.cosine).into(),
            (&self.selected).into(),
            (&self.list).into(),
        ];
        let per_row = groups_2d(ctx, u32_of(rows));
        let per_64 = groups_2d(ctx, u32_of(rows.div_ceil(64)));
        for (entry, groups) in [
            ("cosine_main", per_row),
            ("select_main", per_64),
            ("compact_main", per_64),
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
            k
        }
    )]
}
