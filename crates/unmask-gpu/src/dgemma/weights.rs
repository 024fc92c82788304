//! DiffusionGemma's weights on the GPU, read from the published folder's safetensors by the
//! names `docs/models/diffusion-gemma.md` §2 lists (`model.decoder.*`, the encoder's layer
//! scalars, the self-conditioning MLP; the vision tower is never read). Matrices go into the
//! chosen weight format; norms, router scales and layer scalars stay f32. The dense MLP's and
//! the self-conditioning MLP's gate and up rows are stored one above the other, so one matmul
//! makes the `gate ‖ up` rows `ops::activation::gelu_tanh_gate` reads.

use unmask_core::checkpoint::Checkpoint;
use unmask_core::config::{DiffusionGemmaConfig, LayerAttention};
use unmask_core::quant::QuantFormat;

use crate::context::GpuContext;
use crate::model::{ModelError, WeightFormats};
use crate::tensor::{Tensor, Weight, WeightFormat};

const DECODER: &str = "model.decoder.";
const ENCODER_LAYERS: &str = "model.encoder.language_model.layers.";

/// One layer of the stack.
pub struct DgemmaLayer {
    pub attention: LayerAttention,
    pub input_norm: Tensor,
    /// `[H·d, D]`.
    pub q: Weight,
    /// `[K·d, D]`.
    pub k: Weight,
    /// `[K·d, D]` on sliding layers; full layers take their values from `k`.
    pub v: Option<Weight>,
    /// `[D, H·d]`.
    pub o: Weight,
    pub q_norm: Tensor,
    pub k_norm: Tensor,
    pub post_attention_norm: Tensor,
    pub pre_ff_norm: Tensor,
    /// Dense MLP `[2I, D]`: gate rows, then up rows.
    pub mlp_gate_up: Weight,
    /// `[D, I]`.
    pub mlp_down: Weight,
    pub post_ff_norm_1: Tensor,
    /// `[E, D]`, f32 whatever the format of the other matrices.
    pub router: Weight,
    /// `router.scale · D^-0.5`: the router's input is `RMSNorm(x)` times this, which is an
    /// RMSNorm with this weight.
    pub router_norm: Tensor,
    pub per_expert_scale: Tensor,
    pub pre_ff_norm_2: Tensor,
    /// `[E·2I_e, D]`, whole experts per binding.
    pub experts_gate_up: Weight,
    /// `[E·D, I_e]`.
    pub experts_down: Weight,
    pub post_ff_norm_2: Tensor,
    pub post_ff_norm: Tensor,
    /// The decoder's and the encoder's (commit's) copies of the layer scalar.
    pub decoder_scalar: f32,
    pub encoder_scalar: f32,
}

/// The self-conditioning MLP (§4.1).
pub struct SelfConditioningMlp {
    pub pre_norm: Tensor,
    /// `[2I, D]`.
    pub gate_up: Weight,
    /// `[D, I]`.
    pub down: Weight,
}

pub struct DgemmaWeights {
    /// `[V, D]`: the token table, the LM head (tied) and the self-conditioning table.
    pub embedding: Weight,
    pub final_norm: Tensor,
    pub layers: Vec<DgemmaLayer>,
    pub self_conditioning: SelfConditioningMlp,
}

/// Reads tensors of one checkpoint into GPU buffers.
struct Reader<'a> {
    ctx: &'a GpuContext,
    ck: &'a Checkpoint,
    format: WeightFormat,
    /// Matrices rounded through this quantization on the host (then stored in `format`):
    /// f32 weights equal to what the quantized format holds, the reference a quantized
    /// model is checked against.
    round: Option<QuantFormat>,
}

impl Reader<'_> {
    fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let t = self.ck.tensor(name, shape)?;
        let mut out = vec![0.0f32; t.numel()];
        t.read_f32(0, &mut out);
        if let Some(at) = out.iter().position(|v| !v.is_finite()) {
            let cols = shape.last().copied().unwrap_or(1).max(1);
            return Err(ModelError::NonFinite {
                name: name.to_string(),
                path: t.path.to_path_buf(),
                row: at / cols,
                col: at % cols,
                value: out[at],
                count: out.iter().filter(|v| !v.is_finite()).count(),
            });
        }
        Ok(out)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Tensor, ModelError> {
        Ok(Tensor::from_f32(
            self.ctx,
            &[len],
            &self.floats(name, &[len])?,
            name,
        )?)
    }

    /// `data` (rows of `cols`) through `round`'s quantization and back.
    fn rounded(&self, data: Vec<f32>, cols: usize) -> Result<Vec<f32>, ModelError> {
        let Some(q) = self.round else {
            return Ok(data);
        };
        let rows = data.len() / cols;
        let mut codes = vec![0u8; rows * q.row_code_bytes(cols)];
        let mut scales = vec![0u8; rows * unmask_core::quant::row_scale_bytes(cols)];
        q.quantize_rows(&data, cols, &mut codes, &mut scales)
            .map_err(|e| ModelError::Input(format!("rounding through {}: {e}", q.name())))?;
        Ok(q.dequantize_rows(&codes, &scales, rows, cols))
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        let data = self.rounded(self.floats(name, &[rows, cols])?, cols)?;
        Ok(Weight::from_f32(
            self.ctx,
            rows,
            cols,
            &data,
            self.format,
            name,
        )?)
    }

    /// Two `[rows, cols]` matrices stacked into one `[2 rows, cols]` weight.
    fn stacked_pair(
        &self,
        a: &str,
        b: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Weight, ModelError> {
        let mut data = self.rounded(self.floats(a, &[rows, cols])?, cols)?;
        data.extend(self.rounded(self.floats(b, &[rows, cols])?, cols)?);
        Ok(Weight::from_f32(
            self.ctx,
            2 * rows,
            cols,
            &data,
            self.format,
            a,
        )?)
    }

    /// An expert tensor `[E, rows, cols]` (no `.weight` suffix in the published files).
    fn experts(
        &self,
        name: &str,
        e: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Weight, ModelError> {
        let data = self.rounded(self.floats(name, &[e, rows, cols])?, cols)?;
        let w = Weight::zeros_stacked(self.ctx, e, rows, cols, self.format, name)?;
        w.write_rows_f32(self.ctx, 0, &data)?;
        Ok(w)
    }

    fn scalar(&self, name: &str) -> Result<f32, ModelError> {
        Ok(self.floats(name, &[1])?[0])
    }
}

impl DgemmaWeights {
    /// Every tensor of the text stack, checked against the shapes `cfg` gives.
    pub fn load(
        ctx: &GpuContext,
        ck: &Checkpoint,
        cfg: &DiffusionGemmaConfig,
        format: WeightFormat,
    ) -> Result<Self, ModelError> {
        Self::load_rounded(ctx, ck, cfg, format.into(), None)
    }

    /// `load` with the token table (input embedding, LM head, soft embedding) in
    /// `formats.embed` and every other matrix in `formats.layers`, every matrix but the
    /// router rounded through `round`'s quantization on the host first: with f32 formats, a
    /// model computing exactly what a `round`-quantized one stores, in f32.
    pub fn load_rounded(
        ctx: &GpuContext,
        ck: &Checkpoint,
        cfg: &DiffusionGemmaConfig,
        formats: WeightFormats,
        round: Option<QuantFormat>,
    ) -> Result<Self, ModelError> {
        let r = Reader {
            ctx,
            ck,
            format: formats.layers,
            round,
        };
        let table = Reader {
            ctx,
            ck,
            format: formats.embed,
            round,
        };
        let (d, v, i) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (e, ie, h) = (cfg.num_experts, cfg.moe_intermediate_size, cfg.heads);
        let embedding = table.matrix(&format!("{DECODER}embed_tokens.weight"), v, d)?;
        let final_norm = r.vector(&format!("{DECODER}norm.weight"), d)?;
        let mut layers = Vec::with_capacity(cfg.layers.len());
        for (l, &attention) in cfg.layers.iter().enumerate() {
            let p = format!("{DECODER}layers.{l}.");
            let (hd, kv) = (attention.head_dim, attention.kv_heads);
            let norm = |n: &str| r.vector(&format!("{p}{n}.weight"), d);
            let router_scale = r.floats(&format!("{p}router.scale"), &[d])?;
            let inv_sqrt_d = (d as f64).powf(-0.5);
            let router_norm: Vec<f32> = router_scale
                .iter()
                .map(|&s| (s as f64 * inv_sqrt_d) as f32)
                .collect();
            layers.push(DgemmaLayer {
                attention,
                input_norm: norm("input_layernorm")?,
                q: r.matrix(&format!("{p}self_attn.q_proj.weight"), h * hd, d)?,
                k: r.matrix(&format!("{p}self_attn.k_proj.weight"), kv * hd, d)?,
                v: if attention.sliding {
                    Some(r.matrix(&format!("{p}self_attn.v_proj.weight"), kv * hd, d)?)
                } else {
                    None
                },
                o: r.matrix(&format!("{p}self_attn.o_proj.weight"), d, h * hd)?,
                q_norm: r.vector(&format!("{p}self_attn.q_norm.weight"), hd)?,
                k_norm: r.vector(&format!("{p}self_attn.k_norm.weight"), hd)?,
                post_attention_norm: norm("post_attention_layernorm")?,
                pre_ff_norm: norm("pre_feedforward_layernorm")?,
                mlp_gate_up: r.stacked_pair(
                    &format!("{p}mlp.gate_proj.weight"),
                    &format!("{p}mlp.up_proj.weight"),
                    i,
                    d,
                )?,
                mlp_down: r.matrix(&format!("{p}mlp.down_proj.weight"), d, i)?,
                post_ff_norm_1: norm("post_feedforward_layernorm_1")?,
                // The router stays f32 in every format (E x D is small): its top-K choice
                // flips on margins far below a quantization step.
                router: {
                    let data = r.floats(&format!("{p}router.proj.weight"), &[e, d])?;
                    Weight::from_f32(ctx, e, d, &data, WeightFormat::F32, "router")?
                },
                router_norm: Tensor::from_f32(ctx, &[d], &router_norm, "router norm")?,
                per_expert_scale: r.vector(&format!("{p}router.per_expert_scale"), e)?,
                pre_ff_norm_2: norm("pre_feedforward_layernorm_2")?,
                experts_gate_up: r.experts(&format!("{p}experts.gate_up_proj"), e, 2 * ie, d)?,
                experts_down: r.experts(&format!("{p}experts.down_proj"), e, d, ie)?,
                post_ff_norm_2: norm("post_feedforward_layernorm_2")?,
                post_ff_norm: norm("post_feedforward_layernorm")?,
                decoder_scalar: r.scalar(&format!("{p}layer_scalar"))?,
                encoder_scalar: r.scalar(&format!("{ENCODER_LAYERS}{l}.layer_scalar"))?,
            });
        }
        let sc = format!("{DECODER}self_conditioning.");
        let self_conditioning = SelfConditioningMlp {
            pre_norm: r.vector(&format!("{sc}pre_norm.weight"), d)?,
            gate_up: r.stacked_pair(
                &format!("{sc}gate_proj.weight"),
                &format!("{sc}up_proj.weight"),
                i,
                d,
            )?,
            down: r.matrix(&format!("{sc}down_proj.weight"), d, i)?,
        };
        Ok(Self {
            embedding,
            final_norm,
            layers,
            self_conditioning,
        })
    }
}

/// Bytes the loader's matrices take in `format` and its vectors in f32 for `cfg` (without
/// the 16-byte rounding of each buffer): what a folder of that shape needs on the GPU for its
/// weights.
pub fn weight_bytes(cfg: &DiffusionGemmaConfig, formats: impl Into<WeightFormats>) -> u64 {
    let formats = formats.into();
    let (d, v, i) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
    let (e, ie, h) = (cfg.num_experts, cfg.moe_intermediate_size, cfg.heads);
    let m = |rows: usize, cols: usize| rows as u64 * formats.layers.row_bytes(cols);
    let f32s = |n: usize| 4 * n as u64;
    let table = v as u64 * formats.embed.row_bytes(d);
    let mut bytes = table + f32s(d) + f32s(d) + m(2 * i, d) + m(d, i);
    for a in &cfg.layers {
        let (hd, kv) = (a.head_dim, a.kv_heads);
        bytes += m(h * hd, d) + m(kv * hd, d) + m(d, h * hd);
        if a.sliding {
            bytes += m(kv * hd, d);
        }
        bytes += m(2 * i, d) + m(d, i) + f32s(e * d) + m(e * 2 * ie, d) + m(e * d, ie);
        bytes += f32s(8 * d + 2 * hd + e);
    }
    bytes
}

impl DgemmaWeights {
    /// Bytes of every buffer the weights hold.
    pub fn size_bytes(&self) -> u64 {
        let mut total = self.embedding.size_bytes() + self.final_norm.size_bytes();
        let sc = &self.self_conditioning;
        total += sc.pre_norm.size_bytes() + sc.gate_up.size_bytes() + sc.down.size_bytes();
        for l in &self.layers {
            let matrices = [&l.q, &l.k, &l.o, &l.mlp_gate_up, &l.mlp_down, &l.router];
            total += matrices.iter().map(|w| w.size_bytes()).sum::<u64>();
            total += l.v.as_ref().map_or(0, Weight::size_bytes);
            total += l.experts_gate_up.size_bytes() + l.experts_down.size_bytes();
            let vectors = [
                &l.input_norm,
                &l.q_norm,
                &l.k_norm,
                &l.post_attention_norm,
                &l.pre_ff_norm,
                &l.post_ff_norm_1,
                &l.router_norm,
                &l.per_expert_scale,
                &l.pre_ff_norm_2,
                &l.post_ff_norm_2,
                &l.post_ff_norm,
            ];
            total += vectors.iter().map(|t| t.size_bytes()).sum::<u64>();
        }
        total
    }
}
