//! DiffusionGemma's expert FFN on the GPU (`docs/models/diffusion-gemma.md` §4.6), after the
//! routing (`moe_route`): `out[r] = Σ_j w[r, j] · down[e_j] · (gelu_tanh(g) ⊙ u)` with
//! `g‖u = gate_up[e_j] · y[r]`, grouped by expert, without a read-back:
//!
//! 1. `moe_plan.wgsl` (one workgroup) counts the tokens each expert got, prefix-sums them and
//!    lists each expert's (row, slot) assignments, and lays out the row tiles of each list;
//! 2. `moe_experts.wgsl` GELU: a grouped matmul whose workgroups take (one row tile of one
//!    expert's list, one tile of columns), gathering the token rows through the list, into
//!    the activated rows `gelu_tanh(g) ⊙ u` `[assignments, I]`;
//! 3. `moe_experts.wgsl` again over those rows with the down projections, `[assignments, D]`;
//! 4. `moe_combine.wgsl`: each token row sums its K slots in slot order (no float atomics, so
//!    the result is the same on every run).
//!
//! The grid of a grouped matmul is sized on the host for the worst case (every expert's last
//! tile partly filled: `ceil(A / TILE_ROWS) + experts` tiles for A assignments), and
//! workgroups past the tiles the plan laid out leave after two loads. Indirect dispatch would
//! save those few empty workgroups but would need an indirect-args buffer and a new command
//! kind in `StepEncoder`, and on a CPU rasteriser an empty workgroup costs next to nothing.
//! Hand-written: no crate runs grouped expert matmuls on wgpu.

use bytemuck::{Pod, Zeroable};

use super::{MAX_EXPERTS, MAX_TOP_K};
use crate::error::{GpuError, Result};
use crate::kernel_source;
use crate::ops::ShaderVariant;
use crate::ops::elementwise::{check, check_f32, check_u32, u32_of};
use crate::ops::matmul::weight_load_flags;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{Binding, StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor, Weight, WeightFormat};

const PLAN: KernelSource = kernel_source!("moe_plan");
const EXPERTS: KernelSource = kernel_source!("moe_experts", "weight_load", "gelu");
const COMBINE: KernelSource = kernel_source!("moe_combine");

/// Assignments per row tile of the grouped matmuls (`TM` in `moe_plan.wgsl` and
/// `moe_experts.wgsl`): about the tokens an expert gets when 256 rows pick 8 of 128 experts.
pub const TILE_ROWS: usize = 16;
/// Output columns per tile of the grouped matmuls (16 invocations x 4 columns).
const TILE_COLS: usize = 64;
/// A tile entry of the plan holds the expert in its low 8 bits and the tile below 2^24.
const MAX_TILES: usize = 1 << 24;

/// The shape of one expert FFN dispatch: `rows` tokens, each routed to `top_k` (K) of
/// `experts` (E) experts with `hidden` (D) inputs and outputs and `inter` (I) activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    pub rows: usize,
    pub experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub inter: usize,
}

impl ExpertShape {
    /// (row, slot) pairs: `rows · K`.
    pub fn assignments(&self) -> usize {
        self.rows * self.top_k
    }

    /// Row tiles the grouped matmuls can need: every expert's last tile may be partial.
    pub fn tile_bound(&self) -> usize {
        tile_rows_bound(self.assignments(), self.experts)
    }

    /// u32 entries of the plan: list offsets and tile starts (`E + 1` each), then the tiles.
    pub fn plan_len(&self) -> usize {
        2 * (self.experts + 1) + self.tile_bound()
    }
}

/// Row tiles of `experts` experts' lists over `assignments` in all.
fn tile_rows_bound(assignments: usize, experts: usize) -> usize {
    assignments.div_ceil(TILE_ROWS) + experts.min(assignments)
}

/// The scratch buffers of `moe_experts`, for up to the `rows` of the shape it was made for
/// (`A = rows · K`): `plan` u32 `[ExpertShape::plan_len]`, `order` and `slot_pos` u32 `[A]`,
/// `act` f32 `[A, I]` (the activated rows), `expert_out` f32 `[A, D]` (each slot's expert
/// output before its weight). Callers may allocate their own of at least these sizes.
pub struct ExpertScratch {
    pub plan: Tensor,
    pub order: Tensor,
    pub slot_pos: Tensor,
    pub act: Tensor,
    pub expert_out: Tensor,
}

impl ExpertScratch {
    pub fn new(ctx: &crate::GpuContext, shape: ExpertShape) -> Result<Self> {
        let a = shape.assignments().max(1);
        Ok(Self {
            plan: Tensor::zeros(ctx, DType::U32, &[shape.plan_len()], "moe plan")?,
            order: Tensor::zeros(ctx, DType::U32, &[a], "moe order")?,
            slot_pos: Tensor::zeros(ctx, DType::U32, &[a], "moe slot positions")?,
            act: Tensor::zeros(ctx, DType::F32, &[a, shape.inter], "moe activations")?,
            expert_out: Tensor::zeros(ctx, DType::F32, &[a, shape.hidden], "moe expert outputs")?,
        })
    }
}

/// The routing of `moe_route`: expert ids u32 `[rows, K]` and their weights f32 `[rows, K]`.
#[derive(Clone, Copy)]
pub struct Route<'a> {
    pub ids: &'a Tensor,
    pub weights: &'a Tensor,
}

/// The experts' weights: `gate_up` `[E · 2I, D]` (expert e's rows `e · 2I ..`, its gate rows
/// then its up rows) and `down` `[E · D, I]`, in any `WeightFormat`, each made by
/// `Weight::zeros_stacked` (or chunked on whole experts some other way).
#[derive(Clone, Copy)]
pub struct ExpertWeights<'a> {
    pub gate_up: &'a Weight,
    pub down: &'a Weight,
}

pub fn variants() -> Vec<ShaderVariant> {
    let tm = Spec::new().constant("TM", TILE_ROWS);
    let mut v = vec![
        ShaderVariant {
            kernel: PLAN,
            entry: "main",
            spec: tm.clone(),
        },
        ShaderVariant {
            kernel: COMBINE,
            entry: "main",
            spec: Spec::new(),
        },
    ];
    for format in WeightFormat::ALL {
        for gelu in [false, true] {
            for x_vec4 in [false, true] {
                v.push(ShaderVariant {
                    kernel: EXPERTS,
                    entry: "main",
                    spec: experts_spec(format, gelu, x_vec4),
                });
            }
        }
    }
    v
}

fn experts_spec(format: WeightFormat, gelu: bool, x_vec4: bool) -> Spec {
    let spec = Spec::new()
        .constant("TM", TILE_ROWS)
        .flag_if(gelu, "GELU")
        .flag_if(x_vec4, "XVEC4");
    weight_load_flags(spec, format)
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct PlanParams {
    assignments: u32,
    experts: u32,
    tile_cap: u32,
    _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct ExpertParams {
    k: u32,
    n: u32,
    top_k: u32,
    experts: u32,
    e0: u32,
    e1: u32,
    expert_rows: u32,
    w_stride4: u32,
    s_off: u32,
    tiles_n: u32,
    _pad: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct CombineParams {
    rows: u32,
    cols: u32,
    top_k: u32,
    _pad: u32,
}

/// Checks that `w` is E stacked `[rows_each, cols]` matrices whose chunks hold whole ones.
fn check_stacked(
    what: &'static str,
    w: &Weight,
    s: &ExpertShape,
    rows_each: usize,
    cols: usize,
) -> Result<()> {
    check(
        what,
        w.rows == s.experts * rows_each && w.cols == cols && w.paired.is_none(),
        || {
            format!(
                "[{} x {rows_each}, {cols}] ({} experts)",
                s.experts, s.experts
            )
        },
        || {
            let paired = if w.paired.is_some() {
                " (a paired gate|up weight)"
            } else {
                ""
            };
            format!("[{}, {}]{paired}", w.rows, w.cols)
        },
    )?;
    check(
        what,
        w.chunks
            .iter()
            .all(|c| c.row_start % rows_each == 0 && c.rows % rows_each == 0),
        || format!("chunks of whole {rows_each}-row experts (Weight::zeros_stacked)"),
        || {
            let spans: Vec<String> = w
                .chunks
                .iter()
                .map(|c| format!("{}..{}", c.row_start, c.row_start + c.rows))
                .collect();
            format!("chunks of rows {}", spans.join(", "))
        },
    )
}

/// Checks the shape against the tensors and the limits of the kernels' u32 indices.
fn check_shape(
    s: &ExpertShape,
    y: &Tensor,
    route: Route<'_>,
    w: ExpertWeights<'_>,
    out: &Tensor,
) -> Result<()> {
    check(
        "moe_experts",
        (1..=MAX_EXPERTS).contains(&s.experts)
            && (1..=MAX_TOP_K.min(s.experts)).contains(&s.top_k)
            && s.hidden > 0
            && s.inter > 0,
        || {
            format!(
                "1 to {MAX_EXPERTS} experts, 1 to min({MAX_TOP_K}, experts) per token, \
                 hidden and inter sizes above 0"
            )
        },
        || format!("{s:?}"),
    )?;
    let a = s.assignments();
    let widest = s.hidden.max(2 * s.inter);
    if a.checked_mul(widest).is_none_or(|n| n > u32::MAX as usize) || s.tile_bound() >= MAX_TILES {
        return Err(GpuError::TooLarge {
            what: format!("moe_experts assignments x widest row ({a} x {widest})"),
            needed: a.saturating_mul(widest) as u64,
            limit: u64::from(u32::MAX),
        });
    }
    check_f32("moe_experts y", y, s.rows * s.hidden)?;
    check_u32("moe_experts ids", route.ids, a)?;
    check_f32("moe_experts weights", route.weights, a)?;
    check_f32("moe_experts out", out, s.rows * s.hidden)?;
    check_stacked("moe_experts gate_up", w.gate_up, s, 2 * s.inter, s.hidden)?;
    check_stacked("moe_experts down", w.down, s, s.hidden, s.inter)
}

fn check_scratch(s: &ExpertShape, scratch: &ExpertScratch) -> Result<()> {
    let a = s.assignments();
    check_u32("moe_experts scratch plan", &scratch.plan, s.plan_len())?;
    check_u32("moe_experts scratch order", &scratch.order, a)?;
    check_u32("moe_experts scratch slot_pos", &scratch.slot_pos, a)?;
    check_f32("moe_experts scratch act", &scratch.act, a * s.inter)?;
    check_f32(
        "moe_experts scratch expert_out",
        &scratch.expert_out,
        a * s.hidden,
    )
}

/// Records the expert FFN of `shape.rows` token rows: `out[r] = Σ_j w[r, j] ·
/// down[e_j] · (gelu_tanh(g) ⊙ u)`, `g‖u = gate_up[e_j] · y[r]`, with `y` f32 `[rows, D]` (the
/// pre-FFN-normed input), the routing of `moe_route` and `out` f32 `[rows, D]` (written, not
/// added to). Four kinds of dispatch, no read-back; `scratch` must be sized for at least
/// `shape` (`ExpertScratch::new`).
pub fn moe_experts(
    step: &mut StepEncoder,
    y: &Tensor,
    route: Route<'_>,
    weights: ExpertWeights<'_>,
    out: &Tensor,
    scratch: &ExpertScratch,
    shape: ExpertShape,
) -> Result<()> {
    check_shape(&shape, y, route, weights, out)?;
    check_scratch(&shape, scratch)?;
    if shape.rows == 0 {
        return Ok(());
    }
    let ctx = step.ctx();
    let s = shape;
    let a = s.assignments();
    let plan = ctx.pipeline(&PLAN, "main", &Spec::new().constant("TM", TILE_ROWS))?;
    let params = PlanParams {
        assignments: u32_of(a),
        experts: u32_of(s.experts),
        tile_cap: u32_of(scratch.plan.numel() - 2 * (s.experts + 1)),
        _pad: 0,
    };
    let bindings = [
        route.ids.into(),
        (&scratch.plan).into(),
        (&scratch.order).into(),
        (&scratch.slot_pos).into(),
    ];
    step.dispatch(&plan, &params, &bindings, [1, 1, 1]);

    let gate_up = Grouped {
        w: weights.gate_up,
        x: y,
        y: &scratch.act,
        k: s.hidden,
        n: s.inter,
        gelu: true,
    };
    grouped_matmul(step, &gate_up, scratch, &s)?;
    let down = Grouped {
        w: weights.down,
        x: &scratch.act,
        y: &scratch.expert_out,
        k: s.inter,
        n: s.hidden,
        gelu: false,
    };
    grouped_matmul(step, &down, scratch, &s)?;

    let combine = ctx.pipeline(&COMBINE, "main", &Spec::new())?;
    let params = CombineParams {
        rows: u32_of(s.rows),
        cols: u32_of(s.hidden),
        top_k: u32_of(s.top_k),
        _pad: 0,
    };
    let bindings = [
        (&scratch.expert_out).into(),
        (&scratch.slot_pos).into(),
        route.weights.into(),
        out.into(),
    ];
    step.dispatch(&combine, &params, &bindings, groups_2d(ctx, u32_of(s.rows)));
    Ok(())
}

/// One grouped matmul: `y[pos] = x[row of pos] · W[e]ᵀ` (`gelu`: the gate|up projection
/// with its activation, `W[e]` of `2n` rows).
struct Grouped<'a> {
    w: &'a Weight,
    x: &'a Tensor,
    y: &'a Tensor,
    k: usize,
    n: usize,
    gelu: bool,
}

fn grouped_matmul(
    step: &mut StepEncoder,
    g: &Grouped<'_>,
    scratch: &ExpertScratch,
    s: &ExpertShape,
) -> Result<()> {
    let ctx = step.ctx();
    let format = g.w.format.resolve(ctx);
    let spec = experts_spec(format, g.gelu, g.k.is_multiple_of(4));
    let pipeline = ctx.pipeline(&EXPERTS, "main", &spec)?;
    let expert_rows = if g.gelu { 2 * g.n } else { g.n };
    let tiles_n = g.n.div_ceil(TILE_COLS);
    for chunk in &g.w.chunks {
        let e0 = chunk.row_start / expert_rows;
        let e1 = (e0 + chunk.rows / expert_rows).min(s.experts);
        if e1 <= e0 {
            continue;
        }
        // The chunk's experts may have every assignment between them.
        let tile_rows = tile_rows_bound(s.assignments(), e1 - e0);
        let groups = tile_rows * tiles_n;
        let params = ExpertParams {
            k: u32_of(g.k),
            n: u32_of(g.n),
            top_k: u32_of(s.top_k),
            experts: u32_of(s.experts),
            e0: u32_of(e0),
            e1: u32_of(e1),
            expert_rows: u32_of(expert_rows),
            w_stride4: u32_of(g.w.row_stride / 4),
            s_off: u32_of(g.w.scales_word_offset(chunk.rows)),
            tiles_n: u32_of(tiles_n),
            _pad: [0; 2],
        };
        let mut bindings = vec![
            Binding::from(g.x),
            Binding::from(chunk),
            Binding::from(g.y),
            Binding::from(&scratch.plan),
        ];
        if g.gelu {
            bindings.push(Binding::from(&scratch.order));
        }
        let groups = u32::try_from(groups).map_err(|_| GpuError::TooLarge {
            what: "moe_experts workgroups".into(),
            needed: groups as u64,
            limit: u64::from(u32::MAX),
        })?;
        step.dispatch(&pipeline, &params, &bindings, groups_2d(ctx, groups));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<crate::ops::HostParams> {
    use crate::ops::host_params;
    vec![
        host_params!(
            "moe_plan",
            "main",
            PlanParams {
                assignments,
                experts,
                tile_cap
            }
        ),
        host_params!(
            "moe_experts",
            "main",
            ExpertParams {
                k,
                n,
                top_k,
                experts,
                e0,
                e1,
                expert_rows,
                w_stride4,
                s_off,
                tiles_n
            }
        ),
        host_params!("moe_combine", "main", CombineParams { rows, cols, top_k }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row tiles of lists of these lengths.
    fn tiles(counts: &[usize]) -> usize {
        counts.iter().map(|c| c.div_ceil(TILE_ROWS)).sum()
    }

    #[test]
    fn tile_bound_covers_every_split_of_the_assignments() {
        for (a, e) in [
            (1, 8),
            (10, 8),
            (74, 8),
            (2048, 128),
            (40 * 8, 128),
            (5, 1),
            (17, 2),
        ] {
            let bound = tile_rows_bound(a, e);
            // Everything to one expert; spread evenly; one each and the rest to one;
            // a tile and one more to as many experts as that takes.
            let mut splits = vec![vec![a], vec![a / e + 1; a % e], vec![1; e.min(a)]];
            splits[1].extend(vec![a / e; e - a % e]);
            splits[2][0] += a - e.min(a);
            let n = (a / (TILE_ROWS + 1)).min(e);
            let mut last = vec![TILE_ROWS + 1; n];
            last.push(a - n * (TILE_ROWS + 1));
            splits.push(last);
            for split in &splits {
                assert_eq!(split.iter().sum::<usize>(), a);
                assert!(tiles(split) <= bound, "{a} over {e}: {split:?} > {bound}");
            }
        }
        let s = ExpertShape {
            rows: 37,
            experts: 8,
            top_k: 2,
            hidden: 48,
            inter: 16,
        };
        assert_eq!(s.plan_len(), 18 + 74usize.div_ceil(16) + 8);
    }
}
