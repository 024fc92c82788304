//! Mixture-of-experts on the GPU (DiffusionGemma, `docs/models/diffusion-gemma.md` §4.6): the
//! routing here (from router logits `[rows, E]`, each row's top-K experts and their weights)
//! and the grouped expert FFN after it (`experts`), without a read-back. Hand-written: no
//! crate routes or runs experts on wgpu.

use bytemuck::{Pod, Zeroable};

mod experts;

pub use experts::{ExpertScratch, ExpertShape, ExpertWeights, Route, TILE_ROWS, moe_experts};

use super::ShaderVariant;
use super::elementwise::{check, check_f32, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

const MOE_ROUTE: KernelSource = kernel_source!("moe_route");
/// Most experts the routing kernel takes (`MAX_E` in `shaders/moe_route.wgsl`).
pub const MAX_EXPERTS: usize = 256;
/// Most experts per token (`MAX_K`).
pub const MAX_TOP_K: usize = 16;

pub fn variants() -> Vec<ShaderVariant> {
    let route = ShaderVariant {
        kernel: MOE_ROUTE,
        entry: "main",
        spec: Spec::new(),
    };
    [vec![route], experts::variants()].concat()
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct RouteParams {
    rows: u32,
    experts: u32,
    top_k: u32,
    _pad: u32,
}

/// Routes `rows` tokens: `p = softmax(logits[r])` over `experts`, the `top_k` largest (ties to
/// the lower expert) into `ids[r]` in descending order, and their weights
/// `p_j / sum(chosen p) * expert_scale[e_j]` into `weights[r]`.
pub fn moe_route(
    step: &mut StepEncoder,
    logits: &Tensor,
    expert_scale: &Tensor,
    ids: &Tensor,
    weights: &Tensor,
    rows: usize,
    top_k: usize,
) -> Result<()> {
    let experts = expert_scale.numel();
    check(
        "moe_route",
        (1..=MAX_EXPERTS).contains(&experts) && (1..=MAX_TOP_K.min(experts)).contains(&top_k),
        || format!("1 to {MAX_EXPERTS} experts and 1 to min({MAX_TOP_K}, experts) per token"),
        || {
            format!(
                "{experts} experts (expert_scale {:?}), top_k {top_k}",
                expert_scale.shape
            )
        },
    )?;
    check_f32("moe_route logits", logits, rows * experts)?;
    check_f32("moe_route expert_scale", expert_scale, experts)?;
    check_f32("moe_route weights", weights, rows * top_k)?;
    check(
        "moe_route ids",
        ids.dtype == DType::U32 && ids.numel() >= rows * top_k,
        || format!("u32 tensor with at least {} elements", rows * top_k),
        || format!("{:?} {:?}", ids.dtype, ids.shape),
    )?;
    if rows == 0 {
        return Ok(());
    }
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&MOE_ROUTE, "main", &Spec::new())?;
    let params = RouteParams {
        rows: u32_of(rows),
        experts: u32_of(experts),
        top_k: u32_of(top_k),
        _pad: 0,
    };
    step.dispatch(
        &pipeline,
        &params,
        &[
            logits.into(),
            expert_scale.into(),
            ids.into(),
            weights.into(),
        ],
        groups_2d(ctx, u32_of(rows)),
    );
    Ok(())
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    let route = host_params!(
        "moe_route",
        "main",
        RouteParams {
            rows,
            experts,
            top_k
        }
    );
    let mut all = vec![route];
    all.extend(experts::host_params());
    all
}
