//! Which attention kernel runs, with what tile and how many key slices: the variants, the
//! fixed choice per device and shape, and the sizes the split's scratch needs.

use super::*;
use crate::context::AdapterClass;

/// Query units per workgroup (fixed by the kernel's register blocks).
pub(super) const UNITS_PER_GROUP: usize = 8;

/// Workgroup shape of one head dimension. The kernel gives every invocation 8 keys in the
/// score phase and 8 head dims in the P·V phase, so `wg` covers the head dim 8 at a time
/// (at least 8, the units of phase 2) and a key tile holds `8 * wg` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tile {
    pub(super) head_dim: usize,
    pub(super) wg: usize,
}

impl Tile {
    pub(super) fn for_head_dim(head_dim: usize) -> Self {
        let wg = head_dim
            .div_ceil(8)
            .next_multiple_of(8)
            .max(UNITS_PER_GROUP);
        let tile = Tile { head_dim, wg };
        debug_assert!(tile.is_consistent(), "{tile:?}");
        tile
    }

    pub(super) fn bk(&self) -> usize {
        8 * self.wg
    }

    pub(super) fn is_consistent(&self) -> bool {
        8 * self.wg >= self.head_dim
            && self.wg >= UNITS_PER_GROUP
            && self.wg <= 256
            && self.workgroup_bytes() <= WORKGROUP_BYTES
    }

    pub(super) fn workgroup_bytes(&self) -> usize {
        4 * UNITS_PER_GROUP * (self.head_dim + 2 * self.bk() + 2)
    }

    /// `packed`: K/V in f16, four per vec2<u32> (needs a head dim that is a multiple of 4).
    pub(super) fn spec(&self, packed: bool) -> Spec {
        Spec::new()
            .constant("HD", self.head_dim)
            .constant("WG", self.wg)
            .constant("QS_LEN", 2 * self.head_dim)
            .constant("PS_LEN", 2 * self.bk())
            .flag_if(self.head_dim.is_multiple_of(4), "VEC4")
            .flag_if(packed, "KV_PACKED")
    }
}

/// Which attention kernel runs (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum AttentionKernel {
    /// 8 x 8 register blocks, no K/V staging; head dims up to `REGISTER_MAX_HEAD_DIM`; f32
    /// K/V, or f16 (packed) where the head dim is a multiple of 4.
    Register,
    /// 128 invocations, coalesced K/V tiles through workgroup memory; head dims up to
    /// `MAX_HEAD_DIM`.
    Wide,
    /// `Wide` over slices of the keys, then a combine pass; needs a scratch buffer.
    WideSplit,
    /// Tensor cores: Q K^T and P V as cooperative-matrix products (f16 inputs, f32 sums),
    /// for a head dim of 8, 16 or 32 fragments (128, 256 or 512 at NVIDIA's 16 x 16); `Wide`
    /// elsewhere.
    Coop,
    /// `Coop` over slices of the keys, then `WideSplit`'s combine pass; needs its scratch.
    /// `WideSplit` where `Coop` does not run.
    CoopSplit,
    /// `plan` picks one for the device and shape.
    #[default]
    Auto,
}

impl AttentionKernel {
    /// Every concrete kernel (not `Auto`).
    pub const CONCRETE: [AttentionKernel; 5] = [
        AttentionKernel::Register,
        AttentionKernel::Wide,
        AttentionKernel::WideSplit,
        AttentionKernel::Coop,
        AttentionKernel::CoopSplit,
    ];

    /// How far this kernel's output may be from another's, relative to the largest output:
    /// the f32 kernels differ in summation order only; the tensor-core kernels round Q, K,
    /// V and the probabilities to f16 (2^-11 relative each), the budget of f16 K/V
    /// (`kernels_attention` measures 2.4-4.8e-4 against the oracle).
    pub fn tolerance(self) -> f32 {
        match self {
            AttentionKernel::Coop | AttentionKernel::CoopSplit => 5e-3,
            _ => 1e-3,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Register => "register",
            AttentionKernel::Wide => "wide",
            AttentionKernel::WideSplit => "wide-split",
            AttentionKernel::Coop => "coop",
            AttentionKernel::CoopSplit => "coop-split",
            AttentionKernel::Auto => "auto",
        }
    }

    /// The concrete kernel, K/V decoding and key slices for `m` query rows over `n_keys`
    /// keys stored as `kv`. Explicit kernels run as asked (`Register` serves head dims up
    /// to `REGISTER_MAX_HEAD_DIM` and reads f16 K/V only with a head dim that is a multiple
    /// of 4, always packed; `WideSplit` needs a scratch). `Auto`: on hardware GPUs
    /// (discrete or integrated) `Wide`, split when the (kv head, query block) workgroups
    /// alone would leave the GPU idle and a scratch was given; elsewhere (lavapipe,
    /// browsers) `Register` where it can read the K/V at this head dim, else `Wide`.
    /// Every kernel honours `options.mask` and `options.scale`.
    pub fn plan(
        self,
        ctx: &GpuContext,
        shape: AttentionShape,
        m: usize,
        n_keys: usize,
        kv: DType,
        options: &AttentionOptions,
    ) -> Result<AttentionPlan> {
        let read = match kv {
            DType::F32 => KvRead::F32,
            DType::F16 if options.native_f16 && ctx.features.shader_f16 => KvRead::F16Native,
            DType::F16 => KvRead::F16Packed,
            DType::U32 => {
                return Err(shape_error("K/V in f32 or f16".into(), "u32 K/V".into()));
            }
        };
        let AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        } = shape;
        if head_dim == 0
            || head_dim > MAX_HEAD_DIM
            || n_kv_heads == 0
            || !n_heads.is_multiple_of(n_kv_heads)
        {
            return Err(shape_error(
                format!("head_dim in 1..={MAX_HEAD_DIM}, n_heads a multiple of n_kv_heads"),
                format!("{shape:?}"),
            ));
        }
        options.mask.check_form()?;
        check_scale(options.scale)?;
        let tile = WideTile::new(head_dim, ctx.features.max_workgroup_storage_bytes);
        let group = n_heads / n_kv_heads;
        let scratch_slices = options
            .scratch
            .map_or(0, |t| t.numel() / split_cell_floats(shape, m, tile));
        let register_fits = head_dim <= REGISTER_MAX_HEAD_DIM;
        let register_reads = read == KvRead::F32 || head_dim.is_multiple_of(4);
        let coop = coop_attention(ctx, head_dim);
        let kernel = match self {
            AttentionKernel::Auto => {
                let hardware = ctx.features.adapter == AdapterClass::Gpu;
                if register_fits && register_reads && !hardware {
                    // lavapipe: the register kernel beat the wide one 4-7x (kernel bench,
                    // ratios within one run); staging through workgroup memory is a copy
                    // there. A browser's adapter has no device type (Other): unknown, so
                    // today's kernel stays.
                    AttentionKernel::Register
                } else if hardware
                    && scratch_slices >= 2
                    && split_slices(
                        (m * group).div_ceil(tile.bq) * n_kv_heads,
                        n_keys.div_ceil(tile.bk),
                        scratch_slices,
                    ) >= 2
                {
                    AttentionKernel::WideSplit
                } else {
                    AttentionKernel::Wide
                }
            }
            AttentionKernel::Register if !register_fits => {
                return Err(shape_error(
                    format!(
                        "head_dim at most {REGISTER_MAX_HEAD_DIM} for the register kernel \
                         (the wide kernels serve up to {MAX_HEAD_DIM})"
                    ),
                    format!("head_dim {head_dim}"),
                ));
            }
            AttentionKernel::Register if !register_reads => {
                return Err(shape_error(
                    "f32 K/V for the register kernel, or f16 with a head_dim that is a \
                     multiple of 4"
                        .into(),
                    format!("{kv:?} K/V, head_dim {head_dim}"),
                ));
            }
            AttentionKernel::Coop if coop.is_none() => AttentionKernel::Wide,
            AttentionKernel::CoopSplit if coop.is_none() => AttentionKernel::WideSplit,
            other => other,
        };
        // The register kernel reads f16 K/V packed, whatever the device has.
        let read = match (kernel, read) {
            (AttentionKernel::Register, KvRead::F16Native) => KvRead::F16Packed,
            (_, read) => read,
        };
        // The chosen kernel's tile: the split sizes its slices by it.
        let (bq, bk) = match (kernel, coop) {
            (AttentionKernel::Register, _) => (UNITS_PER_GROUP, Tile::for_head_dim(head_dim).bk()),
            (AttentionKernel::Coop | AttentionKernel::CoopSplit, Some(c)) => {
                let (bq, bk) = coop_attention_tile(c.fragment, head_dim as u32);
                (bq as usize, bk as usize)
            }
            _ => (tile.bq, tile.bk),
        };
        let base_groups = (m * group).div_ceil(bq) * n_kv_heads;
        let n_tiles = n_keys.div_ceil(bk);
        let slices = match kernel {
            AttentionKernel::WideSplit | AttentionKernel::CoopSplit => {
                if scratch_slices == 0 {
                    return Err(shape_error(
                        format!(
                            "a scratch of at least {} f32 for the split kernel",
                            split_cell_floats(shape, m, tile)
                        ),
                        match options.scratch {
                            Some(t) => format!("{:?} {:?}", t.dtype, t.shape),
                            None => "no scratch".into(),
                        },
                    ));
                }
                // Asked for by name, the split splits wherever there are two tiles.
                let wanted = options.slices.unwrap_or_else(|| {
                    let shape_says = split_slices(base_groups, n_tiles, scratch_slices);
                    if matches!(
                        self,
                        AttentionKernel::WideSplit | AttentionKernel::CoopSplit
                    ) {
                        shape_says.max(2)
                    } else {
                        shape_says
                    }
                });
                // Two segments may take one tile more than their keys together;
                // `attention_with` trims the count to the real tiles.
                wanted.clamp(1, n_tiles + 1).min(scratch_slices)
            }
            _ => 1,
        };
        Ok(AttentionPlan {
            kernel,
            read,
            slices,
            tile: (bq, bk),
        })
    }
}

/// How the tensor-core attention runs here for `head_dim`: the matmul's cooperative shape
/// (subgroup size and fragment side), or `None` where it cannot: no cooperative matrices, a
/// head dim other than 8, 16 or 32 fragments (128, 256 or 512 with NVIDIA's 16 x 16
/// fragments), its tiles over the workgroup memory, or 4 subgroups too few for a unit each
/// of the workgroup's query units or too many for a workgroup.
pub fn coop_attention(ctx: &GpuContext, head_dim: usize) -> Option<crate::ops::matmul::CoopShape> {
    crate::ops::matmul::coop_shape(ctx).filter(|c| {
        let fragments = head_dim / c.fragment as usize;
        let (bq, _) = coop_attention_tile(c.fragment, head_dim as u32);
        head_dim.is_multiple_of(c.fragment as usize)
            && matches!(fragments, 8 | 16 | 32)
            && coop_attention_bytes(c.fragment, c.subgroup, head_dim as u32)
                <= ctx.features.max_workgroup_storage_bytes
            && 4 * c.subgroup >= bq
            && 4 * c.subgroup <= ctx.features.max_workgroup_invocations
    })
}

/// The tensor-core attention's tile at fragment side `fragment` and head dim `hd`: query
/// units and keys, 2 fragments of each, or 1 at 32 fragments of head dim (so that Q and a
/// K/V tile of 512 dims fit in 48 KiB with 16 x 16 fragments).
pub fn coop_attention_tile(fragment: u32, hd: u32) -> (u32, u32) {
    if hd == 32 * fragment {
        (fragment, fragment)
    } else {
        (2 * fragment, 2 * fragment)
    }
}

/// Workgroup memory of the tensor-core attention at fragment side `fragment`, subgroup size
/// `subgroup` and head dim `hd`: the staged Q and K/V tiles (`coop_attention_tile`'s rows,
/// `hd` + 8 halves of pitch), the f32 scores (4 floats of pitch; 4 planes of partial sums at
/// 32 fragments), the f16 probabilities (8 halves of pitch), two f32 per query unit and two
/// per invocation (4 subgroups).
pub fn coop_attention_bytes(fragment: u32, subgroup: u32, hd: u32) -> u32 {
    let (bq, bk) = coop_attention_tile(fragment, hd);
    let planes = if hd == 32 * fragment { 4 } else { 1 };
    (bq + bk) * (hd + 8) * 2
        + planes * bq * (bk + 4) * 4
        + bq * (bk + 8) * 2
        + 2 * bq * 4
        + 2 * 4 * subgroup * 4
}

/// How the kernel reads K and V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvRead {
    F32,
    /// f16 pairs in u32 words, unpacked in the shader (no shader-f16 needed).
    F16Packed,
    /// Native f16 loads (shader-f16).
    F16Native,
}

impl KvRead {
    pub fn name(self) -> &'static str {
        match self {
            KvRead::F32 => "f32",
            KvRead::F16Packed => "f16-packed",
            KvRead::F16Native => "f16-native",
        }
    }

    pub(super) fn flag(self) -> &'static str {
        match self {
            KvRead::F32 => "KV_F32",
            KvRead::F16Packed => "KV_PACKED",
            KvRead::F16Native => "F16",
        }
    }
}

/// What `AttentionKernel::plan` chose for one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionPlan {
    pub kernel: AttentionKernel,
    pub read: KvRead,
    /// Key slices (1 unless `kernel` is `WideSplit`).
    pub slices: usize,
    /// (query units, keys) of one workgroup's tile.
    pub tile: (usize, usize),
}

/// Per-call choices of `attention_with`.
#[derive(Clone, Copy, Debug)]
pub struct AttentionOptions<'a> {
    pub kernel: AttentionKernel,
    /// Measures `Auto`'s candidates (`Kernels::tuner`); without one `Auto` takes the fixed
    /// choice.
    pub tuner: Option<&'a crate::tune::KernelTuner>,
    /// Read f16 K/V with native f16 loads where the device has shader-f16 (else packed).
    pub native_f16: bool,
    /// f32 scratch for the split kernel's partial results (`split_scratch_floats` per
    /// slice); without one there is no split.
    pub scratch: Option<&'a Tensor>,
    /// Forces the number of key slices of the split kernel (clamped to the key tiles and
    /// to what the scratch holds); `None`: chosen from the shape.
    pub slices: Option<usize>,
    /// What the scores `q·k` are multiplied by; `None`: `1/sqrt(head_dim)` (LLaDA).
    /// DiffusionGemma uses 1.0 (its q and k are RMS-normed per head).
    pub scale: Option<f32>,
    /// Which keys each query row sees; the default sees all of them (bidirectional).
    pub mask: AttentionMask,
}

impl Default for AttentionOptions<'_> {
    fn default() -> Self {
        Self {
            kernel: AttentionKernel::Auto,
            tuner: None,
            native_f16: true,
            scratch: None,
            slices: None,
            scale: None,
            mask: AttentionMask::default(),
        }
    }
}

/// Workgroups the split aims for: about 4 per SM on GPUs of 100-150 SMs, enough to hide
/// the latency of the K/V loads.
pub(super) const TARGET_WORKGROUPS: usize = 512;

/// Fewest key tiles per slice: below it the partial writes and the combine pass cost more
/// than the extra parallelism gains.
pub(super) const MIN_TILES_PER_SLICE: usize = 4;

/// Key slices for `base_groups` (kv head, query block) workgroups over `n_tiles` key tiles,
/// at most `cap`.
pub(super) fn split_slices(base_groups: usize, n_tiles: usize, cap: usize) -> usize {
    if base_groups >= TARGET_WORKGROUPS / 2 {
        return 1;
    }
    let want = TARGET_WORKGROUPS.div_ceil(base_groups.max(1));
    want.min(n_tiles / MIN_TILES_PER_SLICE).min(cap).max(1)
}

/// f32 of scratch one key slice needs: output, max and sum of every (query row, head).
pub(super) fn split_cell_floats(shape: AttentionShape, m: usize, tile: WideTile) -> usize {
    (m * shape.n_heads * (tile.hd_class + 2)).max(1)
}

/// f32 a scratch needs for `slices` key slices of `m` query rows on this device.
pub fn split_scratch_floats(
    ctx: &GpuContext,
    shape: AttentionShape,
    m: usize,
    slices: usize,
) -> usize {
    let tile = WideTile::new(shape.head_dim, ctx.features.max_workgroup_storage_bytes);
    slices * split_cell_floats(shape, m, tile)
}

/// Query rows a model's split scratch is sized for (a block under a dual cache is 32).
const SPLIT_ROWS: usize = 64;
/// Slices at `SPLIT_ROWS` rows; fewer rows may take more.
const SPLIT_SLICES: usize = 32;

/// f32 of the scratch that lets a model's attention split over keys, for passes of up to
/// `rows` query rows with heads of any of `shapes`: on hardware GPUs, for up to
/// `SPLIT_ROWS` rows at `SPLIT_SLICES` slices (the split pays only for few rows; more rows
/// fill the GPU without it). 0 elsewhere (lavapipe, browsers), where the plan never splits
/// unless `kernel` pins a split kernel.
pub fn model_split_floats(
    ctx: &GpuContext,
    kernel: AttentionKernel,
    shapes: &[AttentionShape],
    rows: usize,
) -> usize {
    let split_asked = matches!(
        kernel,
        AttentionKernel::WideSplit | AttentionKernel::CoopSplit
    );
    if ctx.features.adapter != AdapterClass::Gpu && !split_asked {
        return 0;
    }
    shapes
        .iter()
        .map(|&shape| split_scratch_floats(ctx, shape, rows.clamp(1, SPLIT_ROWS), SPLIT_SLICES))
        .max()
        .unwrap_or(0)
}

/// Invocations of a wide workgroup: 4 warps of 32, 2 waves of 64.
pub(super) const WIDE_WG: usize = 128;

/// Head-dim classes of the wide kernel; a head dim runs in the smallest class that holds
/// it. Up to `STAGE_CHUNK` the class is the staged tile's pitch; above it (DiffusionGemma's
/// 256 and 512) the kernel stages Q and K/V `STAGE_CHUNK` dims at a time, so those classes
/// take the workgroup memory (and tiles) of class 128 and only their registers grow.
pub(super) const HD_CLASSES: [usize; 6] = [16, 32, 64, 128, 256, 512];

/// Most head dims the wide kernel stages at once (Q rows and K/V tile rows).
pub(super) const STAGE_CHUNK: usize = 128;

/// (query units, keys) per wide tile, best first: more of both means fewer K/V reads per
/// FMA, bounded by workgroup memory.
pub(super) const WIDE_TILES: [(usize, usize); 5] = [(16, 64), (16, 32), (16, 16), (8, 32), (8, 16)];

/// Workgroup-memory budgets `variants` builds the wide kernel for: the browser's, and the
/// common native limits (32 KiB Apple / Intel, 48 KiB NVIDIA, 64 KiB AMD).
pub(super) const WORKGROUP_BUDGETS: [u32; 4] = [16 * 1024, 32 * 1024, 48 * 1024, 64 * 1024];

/// Tile of the wide kernel for one head-dim class and workgroup-memory budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct WideTile {
    pub(super) hd_class: usize,
    pub(super) bq: usize,
    pub(super) bk: usize,
}

impl WideTile {
    pub(super) fn new(head_dim: usize, budget_bytes: u32) -> Self {
        let hd_class = HD_CLASSES
            .into_iter()
            .find(|&c| c >= head_dim)
            .unwrap_or(MAX_HEAD_DIM);
        // The last candidate fits 16 KiB at every class: the floor WebGPU guarantees.
        let (bq, bk) = WIDE_TILES
            .into_iter()
            .find(|&(bq, bk)| {
                let t = WideTile { hd_class, bq, bk };
                t.workgroup_bytes() <= budget_bytes as usize
            })
            .unwrap_or(WIDE_TILES[WIDE_TILES.len() - 1]);
        let t = WideTile { hd_class, bq, bk };
        debug_assert!(t.is_consistent(), "{t:?}");
        t
    }

    /// Head dims staged at once: the class, at most `STAGE_CHUNK`.
    pub(super) fn chunk(&self) -> usize {
        self.hd_class.min(STAGE_CHUNK)
    }

    /// Rows of the staged K/V tile, in f32: the chunk and one vec4 of padding.
    pub(super) fn kv_pitch(&self) -> usize {
        self.chunk() + 4
    }

    pub(super) fn workgroup_bytes(&self) -> usize {
        let floats = self.bq * self.chunk()
            + self.bk * self.kv_pitch()
            + self.bq * self.bk
            + WIDE_WG
            + self.bq;
        4 * floats
    }

    /// The divisibilities the kernel's index maps rely on.
    pub(super) fn is_consistent(&self) -> bool {
        WIDE_WG.is_multiple_of(self.bk)
            && self.bk.is_multiple_of(4)
            && self.chunk().is_multiple_of(4)
            && self.hd_class.is_multiple_of(self.chunk())
            && WIDE_WG.is_multiple_of(self.bq)
            && WIDE_WG.is_multiple_of(self.chunk())
            && (self.bq * self.bk).is_multiple_of(WIDE_WG)
            && (self.bq * self.chunk()).is_multiple_of(WIDE_WG)
            && self.workgroup_bytes() <= 64 * 1024
    }

    /// `vec`: the head dim equals the class, so K/V rows are whole vec4s (KV_VEC).
    pub(super) fn spec(&self, read: KvRead, split: bool, vec: bool) -> Spec {
        Spec::new()
            .constant("HD", self.hd_class)
            .constant("HC", self.chunk())
            .constant("WG", WIDE_WG)
            .constant("BQ", self.bq)
            .constant("BK", self.bk)
            .constant("QS_LEN", self.bq * self.chunk() / 4)
            .constant("KV_LEN", self.bk * self.kv_pitch() / 4)
            .constant("SS_LEN", self.bq * self.bk / 4)
            .flag(read.flag())
            .flag_if(split, "SPLIT")
            .flag_if(vec, "KV_VEC")
            // Marks the variants only native adapters build (tests check the budget).
            .flag_if(self.workgroup_bytes() > WORKGROUP_BYTES, "NATIVE")
    }
}
