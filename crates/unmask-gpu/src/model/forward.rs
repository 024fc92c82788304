//! The forward pass of one denoising step, recorded into one command encoder:
//! embed rows → per layer, six dispatches: [RMSNorm + QKV] → [RoPE + K/V rows into the
//! arena] → attention over [segment A | arena] (one per sequence) → [O-proj + residual] →
//! [RMSNorm + gate|up + SwiGLU] → [down + residual] → gather the rows to sample → final
//! norm → LM head per vocabulary chunk → streaming argmax/confidence. Only (token,
//! confidence) per sampled row is read back.
//!
//! The token choice (from gathering the rows to sample to reading back the choices) and
//! the full-logits parity path live in `select`; its types are re-exported here.

#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;
use std::sync::{Arc, RwLock};

use unmask_core::config::ModelConfig;

use super::ModelError;
use super::checkpoint::Checkpoint;
use super::weights::{LoadProgress, ModelWeights, WeightFormats};
use crate::context::GpuContext;
use crate::ops::acache::{self, AnchorProbe, KvShape, ProbeShape};
use crate::ops::attention::{self, AttentionShape, KvSegment};
use crate::ops::elementwise as ew;
use crate::ops::matmul::{self, Fusion};
use crate::ops::{KernelOptions, Kernels};
use crate::step::StepEncoder;
use crate::tensor::{DType, Tensor};

/// A loaded model, with its kernel choice.
pub struct Model {
    pub ctx: Arc<GpuContext>,
    pub cfg: ModelConfig,
    pub weights: ModelWeights,
    /// cos/sin rows for the positions requests have used so far (`RopeTable::rows`), grown
    /// on demand up to `max_pos`: a config's `max_sequence_length` alone never allocates.
    pub(super) rope: RwLock<RopeTable>,
    max_pos: usize,
    /// Which kernels its passes run, and the tuner that measures `Auto`.
    pub(crate) kernels: Kernels,
    /// Storage of the K/V arenas (and of BiCache prefix entries, which must match them):
    /// `F32`, or `F16` for half the memory. Set before the first state is made; attention
    /// refuses segments of mixed storage.
    pub kv_dtype: DType,
}

pub(super) struct RopeTable {
    pub(super) table: Tensor,
    pub(super) rows: usize,
}

/// Rows of the RoPE table built at load: the positions of a typical request, at a few KiB
/// per row.
const ROPE_INITIAL_ROWS: usize = 4096;

/// One layer's keys (after RoPE) and values for every position of a request.
pub struct KvLayer {
    pub k: Tensor,
    pub v: Tensor,
}

/// Activations and the KV arena of one sequence, allocated once per request.
pub struct ForwardState {
    /// Rows that one step may compute.
    pub capacity: usize,
    /// Positions the arena holds (the whole sequence).
    pub seq_len: usize,
    pub ids: Tensor,
    pub positions: Tensor,
    /// Arena row receiving each computed row's K/V.
    pub kv_rows: Tensor,
    pub x: Tensor,
    pub(crate) qkv: Tensor,
    pub(crate) attn: Tensor,
    pub(crate) act: Tensor,
    /// Partial results of attention split over keys (hardware GPUs only; see
    /// `ForwardModel::split_scratch_floats`).
    pub(super) attn_parts: Option<Tensor>,
    pub kv: Vec<KvLayer>,
}

/// One run of a range of layers over a set of hidden rows.
pub struct LayerPass<'a> {
    /// Hidden rows, read and updated in place.
    pub x: &'a Tensor,
    pub rows: usize,
    /// Absolute position of each row (RoPE).
    pub positions: &'a Tensor,
    /// Arena row receiving each row's K/V.
    pub kv_index: &'a Tensor,
    pub layers: std::ops::Range<usize>,
    /// Segment B of every layer (indexed by absolute layer).
    pub arena: &'a [KvLayer],
    /// The sequences of the pass: which rows attend to which arena rows.
    pub seqs: &'a [SeqWindow],
    /// Segment A of every layer and its length (a shared prefix's K/V, read by every
    /// sequence of the pass).
    pub seg_a: Option<(&'a [KvLayer], usize)>,
    /// ACache's probe: every layer adds its masked rows' attention over the span's keys.
    pub probe: Option<&'a AnchorProbe>,
}

pub use super::select::{SelectBuffers, TokenChoice};
pub use unmask_core::step_plan::SeqWindow;

impl Model {
    /// Loads `dir/config.json` and the safetensors checkpoint beside it.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn load(
        ctx: Arc<GpuContext>,
        dir: &Path,
        formats: impl Into<WeightFormats>,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_file(dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(ctx, cfg, &ckpt, formats, progress)
    }

    pub fn from_checkpoint(
        ctx: Arc<GpuContext>,
        cfg: ModelConfig,
        ckpt: &Checkpoint,
        formats: impl Into<WeightFormats>,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, ModelError> {
        let weights = ModelWeights::load(&ctx, &cfg, ckpt, formats, progress)?;
        Self::from_weights(ctx, cfg, weights, &KernelOptions::default())
    }

    /// The model over weights already on the GPU (e.g. uploaded from a stream), with its
    /// kernel choice (its tuner reads the tuning file once, here).
    pub fn from_weights(
        ctx: Arc<GpuContext>,
        cfg: ModelConfig,
        weights: ModelWeights,
        kernels: &KernelOptions,
    ) -> Result<Self, ModelError> {
        let max_pos = cfg.max_sequence_length.max(1);
        let rope = Self::build_rope(&ctx, &cfg, max_pos.min(ROPE_INITIAL_ROWS))?;
        let kernels = Kernels::new(&ctx, kernels);
        Ok(Self {
            ctx,
            cfg,
            weights,
            rope: RwLock::new(rope),
            kernels,
            max_pos,
            kv_dtype: DType::F32,
        })
    }

    /// Which kernels the model's passes run.
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Sets the kernel choice (before any state is made: the attention kernel sizes the
    /// split scratch of a state).
    pub fn set_kernels(&mut self, options: &KernelOptions) {
        self.kernels = Kernels::new(&self.ctx, options);
    }

    /// Sets the matmul kernel alone, keeping the tuner and its measurements.
    pub fn set_matmul_kernel(&mut self, kernel: crate::ops::matmul::MatmulKernel) {
        self.kernels.matmul = kernel;
    }

    fn build_rope(
        ctx: &Arc<GpuContext>,
        cfg: &ModelConfig,
        rows: usize,
    ) -> Result<RopeTable, ModelError> {
        let hd = cfg.head_dim();
        let table = ew::rope_table(cfg.rope_theta as f32, hd, rows);
        Ok(RopeTable {
            table: Tensor::from_f32(ctx, &[rows, hd], &table, "rope table")?,
            rows,
        })
    }

    /// Makes the RoPE table cover positions `0..positions` (at most `max_sequence_length`,
    /// which callers check first), doubling it when it grows so growth is rare.
    fn ensure_rope(&self, positions: usize) -> Result<(), ModelError> {
        let positions = positions.min(self.max_pos);
        let covered = self.rope.read().unwrap_or_else(|e| e.into_inner()).rows;
        if positions <= covered {
            return Ok(());
        }
        let rows = positions.max(covered.saturating_mul(2)).min(self.max_pos);
        let grown = Self::build_rope(&self.ctx, &self.cfg, rows)?;
        let mut rope = self.rope.write().unwrap_or_else(|e| e.into_inner());
        if rope.rows < grown.rows {
            *rope = grown;
        }
        Ok(())
    }

    /// Positions the RoPE table covers now.
    pub fn rope_rows(&self) -> usize {
        self.rope.read().unwrap_or_else(|e| e.into_inner()).rows
    }

    pub(crate) fn qkv_width(&self) -> usize {
        (self.cfg.n_heads + 2 * self.cfg.n_kv_heads) * self.cfg.head_dim()
    }

    /// Bytes one `ForwardState` needs for `capacity` rows over `seq_len` positions.
    pub fn state_bytes(&self, capacity: usize, seq_len: usize) -> u64 {
        let c = &self.cfg;
        // x; qkv; attn; act; three u32 row indices.
        let per_row =
            c.d_model + self.qkv_width() + c.n_heads * c.head_dim() + c.mlp_hidden_size + 3;
        let words = capacity * per_row + self.split_scratch_floats(capacity);
        (words * 4) as u64 + self.kv_bytes(seq_len)
    }

    /// Bytes of K/V for `positions` positions of every layer, in `kv_dtype`.
    pub fn kv_bytes(&self, positions: usize) -> u64 {
        let c = &self.cfg;
        (2 * c.n_layers * positions * c.n_kv_heads * c.head_dim() * self.kv_dtype.size_bytes())
            as u64
    }

    /// A zeroed K/V layer of `positions` rows in `kv_dtype` (an arena's or a prefix entry's).
    pub fn kv_layer(&self, positions: usize, label: &str) -> Result<KvLayer, ModelError> {
        let shape = [positions, self.cfg.n_kv_heads * self.cfg.head_dim()];
        Ok(KvLayer {
            k: Tensor::zeros(&self.ctx, self.kv_dtype, &shape, &format!("{label} k"))?,
            v: Tensor::zeros(&self.ctx, self.kv_dtype, &shape, &format!("{label} v"))?,
        })
    }

    /// f32 of the scratch that lets attention split over keys (`attention::model_split_floats`).
    fn split_scratch_floats(&self, capacity: usize) -> usize {
        let c = &self.cfg;
        let shape = AttentionShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim(),
        };
        attention::model_split_floats(&self.ctx, self.kernels.attention, &[shape], capacity)
    }

    /// The most rows (and arena positions) one `ForwardState` can hold on this device: its
    /// widest activation (or an arena layer) must fit one storage binding.
    pub fn max_state_rows(&self) -> usize {
        (self.ctx.features.max_binding_bytes / self.state_row_bytes() as u64) as usize
    }

    /// Bytes of one row of the widest buffer of a `ForwardState` (an activation or an arena
    /// layer): what `max_state_rows` divides one storage binding by.
    pub fn state_row_bytes(&self) -> usize {
        let c = &self.cfg;
        let widest = [
            c.d_model,
            self.qkv_width(),
            c.n_heads * c.head_dim(),
            c.mlp_hidden_size,
        ]
        .into_iter()
        .max()
        .unwrap_or(1);
        (4 * widest)
            .max(c.n_kv_heads * c.head_dim() * self.kv_dtype.size_bytes())
            .max(1)
    }

    pub fn new_state(&self, capacity: usize, seq_len: usize) -> Result<ForwardState, ModelError> {
        if seq_len > self.max_pos {
            return Err(ModelError::Input(format!(
                "sequence of {seq_len} positions exceeds max_sequence_length {}",
                self.max_pos
            )));
        }
        self.new_batch_state(capacity, seq_len)
    }

    /// A state for a batch: `capacity` rows per step over sequences whose arenas lie one
    /// after the other in `arena_rows` rows (each sequence within max_sequence_length).
    pub fn new_batch_state(
        &self,
        capacity: usize,
        arena_rows: usize,
    ) -> Result<ForwardState, ModelError> {
        let seq_len = arena_rows;
        // Refused whole, before any of it is allocated, rather than buffer by buffer.
        let needed = self.state_bytes(capacity.max(1), arena_rows);
        if let Some(headroom) = self.ctx.memory.headroom().filter(|&h| needed > h) {
            return Err(crate::error::GpuError::OverBudget {
                what: format!("a request state of {capacity} rows over {arena_rows} positions"),
                needed,
                live: self.ctx.memory.live_bytes(),
                budget: self.ctx.memory.budget().unwrap_or(headroom),
            }
            .into());
        }
        // Every sequence of the arena is at most `arena_rows` long.
        self.ensure_rope(arena_rows)?;
        let c = &self.cfg;
        let ctx = &self.ctx;
        let cap = capacity.max(1);
        let f32t = |shape: &[usize], label: &str| Tensor::zeros(ctx, DType::F32, shape, label);
        let kv = (0..c.n_layers)
            .map(|i| self.kv_layer(seq_len, &format!("layer {i}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ForwardState {
            capacity: cap,
            seq_len,
            ids: Tensor::zeros(ctx, DType::U32, &[cap], "ids")?,
            positions: Tensor::zeros(ctx, DType::U32, &[cap], "positions")?,
            kv_rows: Tensor::zeros(ctx, DType::U32, &[cap], "kv rows")?,
            x: f32t(&[cap, c.d_model], "x")?,
            qkv: f32t(&[cap, self.qkv_width()], "qkv")?,
            attn: f32t(&[cap, c.n_heads * c.head_dim()], "attn")?,
            act: f32t(&[cap, c.mlp_hidden_size], "act")?,
            attn_parts: match self.split_scratch_floats(cap) {
                0 => None,
                floats => Some(f32t(&[floats], "attention split scratch")?),
            },
            kv,
        })
    }

    /// Writes the ids and absolute positions of the rows a step computes.
    pub fn write_rows(
        &self,
        st: &ForwardState,
        ids: &[u32],
        positions: &[u32],
    ) -> Result<(), ModelError> {
        if ids.len() != positions.len() || ids.len() > st.capacity {
            return Err(ModelError::Input(format!(
                "{} ids and {} positions for a state of {} rows",
                ids.len(),
                positions.len(),
                st.capacity
            )));
        }
        let rows = self.cfg.embedding_size as u32;
        if let Some(bad) = ids.iter().find(|&&id| id >= rows) {
            return Err(ModelError::Input(format!(
                "token id {bad} is outside the embedding table of {rows} rows"
            )));
        }
        if let Some(bad) = positions.iter().find(|&&p| p as usize >= st.seq_len) {
            return Err(ModelError::Input(format!(
                "position {bad} is outside the sequence of {} positions",
                st.seq_len
            )));
        }
        st.ids.write_u32(&self.ctx, ids)?;
        st.positions.write_u32(&self.ctx, positions)?;
        Ok(())
    }

    /// Places a stored span's K/V (`rows` rows of every layer of `span`, from a span-only
    /// pass) at arena rows `dst_row..` of every layer of `arena`, its keys rotated by
    /// `offset` positions: the span as it sits at `offset` in a request (ACache).
    pub fn encode_span_place(
        &self,
        step: &mut StepEncoder,
        span: &[KvLayer],
        arena: &[KvLayer],
        rows: usize,
        dst_row: usize,
        offset: usize,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        if span.len() != c.n_layers || arena.len() != c.n_layers {
            return Err(ModelError::Input(format!(
                "a span of {} layers placed into an arena of {} for a model of {}",
                span.len(),
                arena.len(),
                c.n_layers
            )));
        }
        self.ensure_rope(offset + 1)?;
        let rope = self.rope.read().unwrap_or_else(|e| e.into_inner());
        let shape = KvShape {
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim(),
        };
        for (li, (s, a)) in span.iter().zip(arena).enumerate() {
            step.set_layer(Some(li));
            acache::place_span(
                step,
                (&s.k, &s.v),
                (&a.k, &a.v),
                &rope.table,
                rope.rows,
                shape,
                0,
                dst_row,
                rows,
                offset,
            )?;
        }
        step.set_layer(None);
        Ok(())
    }

    /// Embeds the ids written by `write_rows` into `st.x`.
    pub fn encode_embed(
        &self,
        step: &mut StepEncoder,
        st: &ForwardState,
        rows: usize,
    ) -> Result<(), ModelError> {
        ew::embed(step, &st.ids, &self.weights.embedding, &st.x, rows)?;
        Ok(())
    }

    /// Records the layers `pass.layers` over `pass.rows` hidden rows of `pass.x` (updated in
    /// place), using `st` for scratch. Each computed row's K/V go to arena row
    /// `kv_index[r]` of its layer; the rows of each sequence window attend to segment A
    /// (when given) and that window's arena rows.
    pub fn encode_pass(
        &self,
        step: &mut StepEncoder,
        st: &ForwardState,
        pass: &LayerPass<'_>,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let hd = c.head_dim();
        let (h, hkv) = (c.n_heads, c.n_kv_heads);
        let eps = c.rms_norm_eps as f32;
        let k = &self.kernels;
        let rows = pass.rows;
        if rows > st.capacity || pass.layers.end > c.n_layers || pass.arena.len() < pass.layers.end
        {
            return Err(ModelError::Input(format!(
                "a pass of {rows} rows over layers {:?} does not fit a state of {} rows and {} arena layers",
                pass.layers,
                st.capacity,
                pass.arena.len()
            )));
        }
        if let Some(w) = pass.seqs.iter().find(|w| w.rows.end > rows) {
            return Err(ModelError::Input(format!(
                "a sequence window over rows {:?} in a pass of {rows} rows",
                w.rows
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let x = pass.x;
        for li in pass.layers.clone() {
            step.set_layer(Some(li));
            let lw = &self.weights.layers[li];
            let arena = &pass.arena[li];
            // RMSNorm folded into the QKV projection.
            matmul::matmul_fused(
                step,
                x,
                &lw.qkv,
                &st.qkv,
                rows,
                k,
                Fusion {
                    norm: Some((&lw.attn_norm, eps)),
                    ..Fusion::default()
                },
            )?;
            // q rotated in place; k rotated and v copied into the arena rows.
            self.encode_rope_qkv(
                step,
                li,
                &st.qkv,
                pass.positions,
                pass.kv_index,
                arena,
                rows,
            )?;
            if let Some(probe) = pass.probe {
                let shape = ProbeShape {
                    n_heads: h,
                    n_kv_heads: hkv,
                    head_dim: hd,
                };
                probe.encode_layer(step, &st.qkv, &arena.k, shape)?;
            }
            let seg_a = pass
                .seg_a
                .map(|(layers, len)| KvSegment::first(&layers[li].k, &layers[li].v, len));
            self.encode_attention(step, st, &st.qkv, pass.seqs, seg_a, arena)?;
            let residual = Fusion {
                residual: true,
                ..Fusion::default()
            };
            matmul::matmul_fused(step, &st.attn, &lw.attn_out, x, rows, k, residual)?;
            // RMSNorm folded in front, SwiGLU behind: gate|up straight to the activations.
            matmul::matmul_fused(
                step,
                x,
                &lw.gate_up,
                &st.act,
                rows,
                k,
                Fusion {
                    norm: Some((&lw.ff_norm, eps)),
                    swiglu: true,
                    ..Fusion::default()
                },
            )?;
            matmul::matmul_fused(step, &st.act, &lw.down, x, rows, k, residual)?;
        }
        step.set_layer(None);
        Ok(())
    }
}
