//! The tensor names of each family's published checkpoints.

use super::ModelFamily;

/// One tensor of a transformer block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    AttnNorm,
    Q,
    QBias,
    K,
    KBias,
    V,
    VBias,
    /// The attention output projection.
    O,
    FfnNorm,
    /// The SwiGLU gate (LLaDA's `ff_proj`).
    Gate,
    Up,
    /// The MLP output (LLaDA's block `ff_out`).
    Down,
}

impl LayerTensor {
    /// Every tensor of a block, in checkpoint order.
    pub const ALL: [LayerTensor; 12] = [
        LayerTensor::AttnNorm,
        LayerTensor::Q,
        LayerTensor::QBias,
        LayerTensor::K,
        LayerTensor::KBias,
        LayerTensor::V,
        LayerTensor::VBias,
        LayerTensor::O,
        LayerTensor::FfnNorm,
        LayerTensor::Gate,
        LayerTensor::Up,
        LayerTensor::Down,
    ];

    pub fn is_bias(self) -> bool {
        matches!(
            self,
            LayerTensor::QBias | LayerTensor::KBias | LayerTensor::VBias
        )
    }
}

impl ModelFamily {
    /// The token embedding table.
    pub fn embedding_name(self) -> &'static str {
        match self {
            ModelFamily::Llada => "model.transformer.wte.weight",
            ModelFamily::Dream => "model.embed_tokens.weight",
        }
    }

    /// The norm after the last block.
    pub fn final_norm_name(self) -> &'static str {
        match self {
            ModelFamily::Llada => "model.transformer.ln_f.weight",
            ModelFamily::Dream => "model.norm.weight",
        }
    }

    /// The untied LM head.
    pub fn lm_head_name(self) -> &'static str {
        match self {
            ModelFamily::Llada => "model.transformer.ff_out.weight",
            ModelFamily::Dream => "lm_head.weight",
        }
    }

    /// Tensor `part` of block `layer`.
    pub fn layer_name(self, layer: usize, part: LayerTensor) -> String {
        use LayerTensor as T;
        match self {
            ModelFamily::Llada => {
                let name = match part {
                    T::AttnNorm => "attn_norm.weight",
                    T::Q => "q_proj.weight",
                    T::QBias => "q_proj.bias",
                    T::K => "k_proj.weight",
                    T::KBias => "k_proj.bias",
                    T::V => "v_proj.weight",
                    T::VBias => "v_proj.bias",
                    T::O => "attn_out.weight",
                    T::FfnNorm => "ff_norm.weight",
                    T::Gate => "ff_proj.weight",
                    T::Up => "up_proj.weight",
                    T::Down => "ff_out.weight",
                };
                format!("model.transformer.blocks.{layer}.{name}")
            }
            ModelFamily::Dream => {
                let name = match part {
                    T::AttnNorm => "input_layernorm.weight",
                    T::Q => "self_attn.q_proj.weight",
                    T::QBias => "self_attn.q_proj.bias",
                    T::K => "self_attn.k_proj.weight",
                    T::KBias => "self_attn.k_proj.bias",
                    T::V => "self_attn.v_proj.weight",
                    T::VBias => "self_attn.v_proj.bias",
                    T::O => "self_attn.o_proj.weight",
                    T::FfnNorm => "post_attention_layernorm.weight",
                    T::Gate => "mlp.gate_proj.weight",
                    T::Up => "mlp.up_proj.weight",
                    T::Down => "mlp.down_proj.weight",
                };
                format!("model.layers.{layer}.{name}")
            }
        }
    }
}
