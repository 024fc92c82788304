//! Attention over two KV segments (DESIGN.md §3): every query row attends to the keys of
//! segment A (a shared or per-request prefix, possibly empty) and of segment B (the
//! request's KV arena), with one online softmax across both. Bidirectional by default
//! (LLaDA); `AttentionMask` makes it causal with an optional sliding window and
//! `AttentionOptions::scale` replaces `1/sqrt(head_dim)` (DiffusionGemma). Key tiles no
//! query unit of a workgroup sees are skipped; only tiles that straddle a mask boundary
//! pay for the per-key test.
//!
//! Three kernels (`AttentionKernel`), chosen per call by `AttentionKernel::plan`:
//! - `Register` (`shaders/attention.wgsl`, specialised per head dim up to
//!   `REGISTER_MAX_HEAD_DIM`): a workgroup takes 8
//!   (query row, query head) pairs of one kv head and walks the keys in tiles, with 8 x 8
//!   register blocks in both products and no workgroup staging of K/V; the fastest on
//!   lavapipe, where loads per FMA decide the speed. f32 K/V, or f16 unpacked from u32
//!   words as they load (head dims that are multiples of 4).
//! - `Wide` (`shaders/attention_wide.wgsl`): 128 invocations, K/V tiles staged through
//!   workgroup memory by coalesced loads, the tile sized from the adapter's workgroup-memory
//!   limit (16 KiB in a browser); K/V in f32 or f16 (packed in u32 words, or native).
//!   Head dims above 128 (up to `MAX_HEAD_DIM`) are staged 128 dims at a time.
//! - `WideSplit`: the wide kernel over slices of the keys (flash-decoding), each writing
//!   partial (max, sum, output) to a scratch buffer, then `shaders/attention_combine.wgsl`
//!   merges the slices: for few query rows over many keys, where one workgroup per
//!   (kv head, query block) would leave most of a GPU idle.
//!
//! There is no subgroup variant: the invocations exchange data by broadcast through
//! workgroup memory, and the one reduction (the row max) is a few percent of the work.

use std::sync::Arc;

use super::ShaderVariant;
use crate::context::GpuContext;
use crate::error::{GpuError, Result};
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{Binding, StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

mod mask;
mod measure;
mod params;
mod plan;

pub use mask::AttentionMask;
use mask::{check_scale, scale_log2};
use measure::measured_kernel;
pub use measure::tune_class;
#[cfg(test)]
pub(crate) use params::host_params;
use params::*;
use plan::*;
pub use plan::{
    AttentionKernel, AttentionOptions, AttentionPlan, KvRead, coop_attention, coop_attention_bytes,
    coop_attention_tile, model_split_floats, split_scratch_floats,
};

const ATTENTION: KernelSource = kernel_source!("attention");
const ATTENTION_WIDE: KernelSource = kernel_source!("attention_wide");
const ATTENTION_COMBINE: KernelSource = kernel_source!("attention_combine");

/// Largest head dimension the wide kernels support (DiffusionGemma's full layers use 512).
pub const MAX_HEAD_DIM: usize = 512;

/// Largest head dimension of the register kernel (LLaDA-8B uses 128): above it its
/// workgroup memory (8 query units of Q, their scores and probabilities over tiles of
/// `8 * WG >= head_dim` keys) outgrows 16 KiB (24 KiB at 256).
pub const REGISTER_MAX_HEAD_DIM: usize = 128;

/// Browser limit on workgroup memory.
const WORKGROUP_BYTES: usize = 16 * 1024;

/// Head layout of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Keys and values of one segment: f32 or f16 rows `[.., n_kv_heads * head_dim]`, contiguous,
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

/// Every attention pipeline the runtime can build: the register kernel per head dim, the
/// wide kernel per head-dim class, tile (workgroup budget), K/V format and split, and the
/// combine pass.
pub fn variants() -> Vec<ShaderVariant> {
    let mut v: Vec<ShaderVariant> = (1..=REGISTER_MAX_HEAD_DIM)
        .flat_map(|hd| {
            // f32 K/V at every head dim; packed f16 where it is a multiple of 4.
            let packed: &[bool] = if hd.is_multiple_of(4) {
                &[false, true]
            } else {
                &[false]
            };
            packed.iter().map(move |&packed| ShaderVariant {
                kernel: ATTENTION,
                entry: "main",
                spec: Tile::for_head_dim(hd).spec(packed),
            })
        })
        .collect();
    let mut tiles = Vec::new();
    for class in HD_CLASSES {
        for budget in WORKGROUP_BUDGETS {
            let t = WideTile::new(class, budget);
            if !tiles.contains(&t) {
                tiles.push(t);
            }
        }
    }
    for t in tiles {
        for read in [KvRead::F32, KvRead::F16Packed, KvRead::F16Native] {
            for split in [false, true] {
                for vec in [false, true] {
                    v.push(ShaderVariant {
                        kernel: ATTENTION_WIDE,
                        entry: "main",
                        spec: t.spec(read, split, vec),
                    });
                }
            }
        }
    }
    // The tensor-core kernel at an NVIDIA GPU's subgroup size and fragments and at
    // lavapipe's (8 x 8, and the 16 x 16 the tests force there).
    for (subgroup, fragment) in [(32, 16), (8, 8), (8, 16)] {
        for fragments in [8, 16, 32] {
            for read in [KvRead::F32, KvRead::F16Packed, KvRead::F16Native] {
                for split in [false, true] {
                    let spec = coop_spec(read, subgroup, fragment, fragments * fragment);
                    v.push(ShaderVariant {
                        kernel: ATTENTION_WIDE,
                        entry: "main",
                        spec: spec.flag_if(split, "SPLIT"),
                    });
                }
            }
        }
    }
    v.push(ShaderVariant {
        kernel: ATTENTION_COMBINE,
        entry: "main",
        spec: Spec::new(),
    });
    v
}

/// The tensor-core variant of `attention_wide.wgsl` for `head_dim` (8, 16 or 32
/// `fragment`s), K/V read as vec4s.
fn coop_spec(read: KvRead, subgroup: u32, fragment: u32, head_dim: u32) -> Spec {
    Spec::new()
        .flag("COOP")
        .flag("KV_VEC")
        .flag(read.flag())
        .flag_if(head_dim == 16 * fragment, "HD16")
        .flag_if(head_dim == 32 * fragment, "HD32")
        .constant("SG", subgroup)
        .constant("FR", fragment)
}

fn shape_error(expected: String, found: String) -> GpuError {
    GpuError::Shape {
        op: "attention",
        expected,
        found,
    }
}

fn check_tensor(what: &str, t: &Tensor, dtypes: &[DType], min_elems: usize) -> Result<()> {
    if dtypes.contains(&t.dtype) && t.numel() >= min_elems {
        Ok(())
    } else {
        Err(shape_error(
            format!("{what}: {dtypes:?} tensor with at least {min_elems} elements"),
            format!("{:?} {:?}", t.dtype, t.shape),
        ))
    }
}

fn to_u32(what: &str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| shape_error(format!("{what} below 2^32"), x.to_string()))
}

/// Records attention of the query rows `rows` over `seg_a` (optional) and `seg_b`, and
/// returns the plan that ran.
///
/// Query row `r`, head `h` is read at `q[r * q_stride + q_col + h * head_dim ..]` (q is
/// usually a slice of the fused QKV projection output, RoPE applied). The result goes to
/// rows `rows` of `out`, f32 `[.., n_heads * head_dim]`. Scores are scaled by
/// `options.scale` (default `1/sqrt(head_dim)`) and masked by `options.mask` (default none;
/// its key indices run through segment A, then B); query head `h` uses kv head
/// `h / (n_heads / n_kv_heads)`. K and V of both segments are f32, or all f16. A batch calls
/// this once per sequence, each with its own rows, arena window and mask, into one shared
/// `out`.
#[allow(clippy::too_many_arguments)]
pub fn attention_with(
    step: &mut StepEncoder,
    q: &Tensor,
    q_stride: usize,
    q_col: usize,
    rows: std::ops::Range<usize>,
    seg_a: Option<KvSegment>,
    seg_b: KvSegment,
    out: &Tensor,
    shape: AttentionShape,
    options: &AttentionOptions,
) -> Result<AttentionPlan> {
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
    options.mask.check(m, n_keys)?;
    check_scale(options.scale)?;
    let kv_stride = n_kv_heads * head_dim;
    let kv_dtype = seg_b.k.dtype;
    let kv_dtypes = [kv_dtype];
    if !matches!(kv_dtype, DType::F32 | DType::F16) {
        return Err(shape_error(
            "segment B keys: f32 or f16".into(),
            format!("{kv_dtype:?}"),
        ));
    }
    let ctx = step.ctx();
    let measured;
    let options = match measured_kernel(
        ctx, q, q_stride, q_col, &rows, seg_a, seg_b, out, shape, options,
    )? {
        Some(kernel) => {
            measured = AttentionOptions { kernel, ..*options };
            &measured
        }
        None => options,
    };
    let plan = options
        .kernel
        .plan(ctx, shape, m.max(1), n_keys, kv_dtype, options)?;
    if m == 0 {
        return Ok(plan);
    }
    check_tensor(
        "q",
        q,
        &[DType::F32],
        (rows.end - 1) * q_stride + q_col + q_width,
    )?;
    check_tensor("out", out, &[DType::F32], rows.end * q_width)?;
    for (name, seg) in [("segment A", seg_a), ("segment B", Some(seg_b))] {
        if let Some(s) = seg {
            let end = (s.start + s.len) * kv_stride;
            // Both segments in one format: the kernel has one K/V decoding.
            check_tensor(&format!("{name} keys"), s.k, &kv_dtypes, end)?;
            check_tensor(&format!("{name} values"), s.v, &kv_dtypes, end)?;
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
    let scratch = options.scratch.filter(|_| {
        matches!(
            plan.kernel,
            AttentionKernel::WideSplit | AttentionKernel::CoopSplit
        )
    });
    if let Some(sc) = scratch {
        check_tensor("split scratch", sc, &[DType::F32], 1)?;
        inputs.push(("split scratch", sc));
    }
    for (i, (name, t)) in inputs.iter().enumerate() {
        let clash = |o: &Tensor| Arc::ptr_eq(&t.buffer, &o.buffer);
        if clash(out) {
            return Err(shape_error(
                "out in a buffer of its own".into(),
                format!("out shares its buffer with {name}"),
            ));
        }
        if let Some(sc) = scratch
            && i + 1 < inputs.len()
            && clash(sc)
        {
            return Err(shape_error(
                "the split scratch in a buffer of its own".into(),
                format!("the scratch shares its buffer with {name}"),
            ));
        }
    }
    // The vec4 kernels bind K and V as arrays of 16-byte elements (`Tensor` buffers are).
    let misaligned = inputs[1..]
        .iter()
        .find(|(_, t)| !t.buffer.size().is_multiple_of(16));
    let vec4_bindings = match plan.kernel {
        AttentionKernel::Register => head_dim.is_multiple_of(4),
        _ => HD_CLASSES.contains(&head_dim),
    };
    if let (true, Some((name, t))) = (vec4_bindings, misaligned) {
        return Err(shape_error(
            format!("{name}: a buffer size that is a multiple of 16 bytes"),
            format!("{} bytes", t.buffer.size()),
        ));
    }

    let group = n_heads / n_kv_heads;
    let units = m * group;
    let row0 = to_u32("first query row", rows.start)?;
    let (causal, window, query_start) = options.mask.uniforms()?;
    // The kernels differ only in how many query units a workgroup takes.
    let query = |unit_blocks: usize| -> Result<QueryParams> {
        Ok(QueryParams {
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
            scale_log2: scale_log2(options.scale, head_dim),
            row0,
            b_row0: to_u32("segment B start", seg_b.start)?,
            a_row0: to_u32("segment A start", seg_a.map_or(0, |s| s.start))?,
            causal,
            window,
            query_start,
        })
    };
    // Without segment A, B's buffers stand in for it (read-only bindings may alias).
    let (ka, va) = match &seg_a {
        Some(a) => (a.k, a.v),
        None => (seg_b.k, seg_b.v),
    };
    // Both kernels bind q, the two segments' K and V, and where they write.
    let bindings = |target: &Tensor| -> [Binding; 6] {
        [
            q.into(),
            ka.into(),
            va.into(),
            seg_b.k.into(),
            seg_b.v.into(),
            target.into(),
        ]
    };
    if plan.kernel == AttentionKernel::Register {
        let tile = Tile::for_head_dim(head_dim);
        let unit_blocks = units.div_ceil(UNITS_PER_GROUP);
        let params = Params {
            q: query(unit_blocks)?,
            _pad0: 0,
            _pad1: 0,
            _pad2: 0,
        };
        let groups = groups_2d(ctx, to_u32("workgroups", unit_blocks * n_kv_heads)?);
        let packed = plan.read != KvRead::F32;
        let pipeline = ctx.pipeline(&ATTENTION, "main", &tile.spec(packed))?;
        step.dispatch(&pipeline, &params, &bindings(out), groups);
        return Ok(plan);
    }

    let tile = WideTile::new(head_dim, ctx.features.max_workgroup_storage_bytes);
    let coop = coop_attention(ctx, head_dim).filter(|_| {
        matches!(
            plan.kernel,
            AttentionKernel::Coop | AttentionKernel::CoopSplit
        )
    });
    // Both kernel families walk key tiles of their own size, `slices` slices of them.
    let (bq, bk) = match coop {
        Some(_) => plan.tile,
        None => (tile.bq, tile.bk),
    };
    let unit_blocks = units.div_ceil(bq);
    let n_tiles = len_a.div_ceil(bk) + seg_b.len.div_ceil(bk);
    let tiles_per_slice = n_tiles.div_ceil(plan.slices);
    // Every slice gets at least one tile (its max and sum are then finite).
    let slices = n_tiles.div_ceil(tiles_per_slice);
    let plan = AttentionPlan { slices, ..plan };
    let params = WideParams {
        q: query(unit_blocks)?,
        slices: slices as u32,
        tiles_per_slice: tiles_per_slice as u32,
        hd: head_dim as u32,
    };
    let groups = groups_2d(
        ctx,
        to_u32("workgroups", unit_blocks * n_kv_heads * slices)?,
    );
    let split = matches!(
        plan.kernel,
        AttentionKernel::WideSplit | AttentionKernel::CoopSplit
    );
    let spec = match coop {
        Some(c) => {
            coop_spec(plan.read, c.subgroup, c.fragment, head_dim as u32).flag_if(split, "SPLIT")
        }
        None => tile.spec(plan.read, split, head_dim == tile.hd_class),
    };
    let pipeline = ctx.pipeline(&ATTENTION_WIDE, "main", &spec)?;
    let target = match scratch {
        Some(sc) if split => {
            let needed = slices * split_cell_floats(shape, m, tile);
            check_tensor("split scratch", sc, &[DType::F32], needed)?;
            sc
        }
        _ => out,
    };
    step.dispatch(&pipeline, &params, &bindings(target), groups);
    if split {
        let combine = CombineParams {
            units: units as u32,
            group: group as u32,
            n_kv_heads: n_kv_heads as u32,
            slices: slices as u32,
            hd: head_dim as u32,
            pitch: tile.hd_class as u32,
            out_stride: q_width as u32,
            row0,
        };
        let elems = to_u32("combined outputs", units * n_kv_heads * head_dim)?;
        let pipeline = ctx.pipeline(&ATTENTION_COMBINE, "main", &Spec::new())?;
        let bindings: [Binding; 2] = [target.into(), out.into()];
        step.dispatch(
            &pipeline,
            &combine,
            &bindings,
            groups_2d(ctx, elems.div_ceil(256)),
        );
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_check_takes_every_head_dim_the_kernels_take() {
        assert_eq!(unmask_core::config::MAX_HEAD_DIM, MAX_HEAD_DIM);
    }

    #[test]
    fn tiles_fit_browser_limits() {
        for hd in 1..=REGISTER_MAX_HEAD_DIM {
            let t = Tile::for_head_dim(hd);
            assert!(t.is_consistent(), "{t:?}");
        }
    }

    #[test]
    fn wide_tiles_fit_their_budget() {
        for hd in 1..=MAX_HEAD_DIM {
            for budget in WORKGROUP_BUDGETS {
                let t = WideTile::new(hd, budget);
                assert!(t.is_consistent(), "{t:?}");
                assert!(
                    t.workgroup_bytes() <= budget as usize,
                    "{t:?} over {budget}"
                );
                assert!(t.hd_class >= hd, "{t:?} for head dim {hd}");
            }
        }
        // The largest budget buys the largest tile at head dim 128 (more FMAs per load).
        assert_eq!(WideTile::new(128, 48 * 1024).bk, 64);
        assert_eq!(WideTile::new(128, 16 * 1024).bq, 8);
        // Head dims 256 and 512 are staged 128 at a time: the tiles of head dim 128.
        for hd in [256, 512] {
            for budget in WORKGROUP_BUDGETS {
                let (big, t128) = (WideTile::new(hd, budget), WideTile::new(128, budget));
                assert_eq!((big.hd_class, big.chunk()), (hd, 128));
                assert_eq!((big.bq, big.bk), (t128.bq, t128.bk), "at {budget}");
                assert_eq!(big.workgroup_bytes(), t128.workgroup_bytes());
            }
        }
        assert_eq!(WideTile::new(512, 16 * 1024).workgroup_bytes(), 13600);
        assert_eq!(WideTile::new(512, 32 * 1024).workgroup_bytes(), 27712);
    }

    #[test]
    fn split_fills_a_large_gpu_for_few_rows() {
        // LLaDA-8B, 32 query rows, 4096 keys: 2 query blocks x 32 heads = 64 workgroups.
        let tile = WideTile::new(128, 48 * 1024);
        let base = 32usize.div_ceil(tile.bq) * 32;
        let slices = split_slices(base, 4096usize.div_ceil(tile.bk), 64);
        assert!(base * slices >= TARGET_WORKGROUPS, "{base} x {slices}");
        // Many rows fill the GPU alone: no split.
        assert_eq!(split_slices(1024 * 32 / 16, 64, 64), 1);
        // Few keys: no slice below the minimum of tiles.
        assert_eq!(split_slices(64, 5, 64), 1);
    }
}
