//! Dream-v0-7B (Base, Instruct) and DiffuCoder: Qwen2's tensors and config keys, q/k/v
//! biases, logits shifted by one position, Dream's timestep schedule, ChatML.

use super::{FamilySpec, ShippedDepthTable, SpecialTokenNames};
use crate::chat::{CHATML_DEFAULT_SYSTEM, ChatFormat, IM_END_TOKEN};
use crate::config::LayerTensor;
use crate::depth_policy::DREAM_V0_INSTRUCT_7B;
use crate::sampler::Schedule;
use crate::tokenizer::{DREAM_MASK_TOKEN, EOS_TOKEN};

pub(super) static SPEC: FamilySpec = FamilySpec {
    name: "dream",
    summary: "Dream (Qwen2 tensors, q/k/v biases, logits shifted by one position, \
              Dream's timestep schedule, ChatML)",
    model_types: &["Dream", "dream"],
    embedding: "model.embed_tokens.weight",
    final_norm: "model.norm.weight",
    lm_head: "lm_head.weight",
    block_prefix: "model.layers.",
    layer_tensor,
    config_keys: &[
        ("d_model", "hidden_size"),
        ("n_heads", "num_attention_heads"),
        ("n_kv_heads", "num_key_value_heads"),
        ("n_layers", "num_hidden_layers"),
        ("mlp_hidden_size", "intermediate_size"),
        ("embedding_size", "vocab_size"),
        ("max_sequence_length", "max_position_embeddings"),
    ],
    shifts_logits: true,
    default_schedule: Schedule::DREAM,
    // transformers' `PretrainedConfig` gives 50 to a config that names none, and with it
    // `diffusion_generate` (`DreamGenerationConfig.from_model_config`).
    default_top_k: Some(50),
    chat_format: || ChatFormat::ChatMl {
        default_system: Some(CHATML_DEFAULT_SYSTEM.to_string()),
    },
    // The config names `<|endoftext|>` as BOS too; the template writes none.
    special_tokens: SpecialTokenNames {
        mask: DREAM_MASK_TOKEN,
        eos: EOS_TOKEN,
        bos: None,
        eot: IM_END_TOKEN,
        headers: None,
    },
    depth_tables: &[ShippedDepthTable {
        n_layers: 28,
        d_model: 3584,
        json: DREAM_V0_INSTRUCT_7B,
        path: "crates/unmask-core/policies/dream-v0-instruct-7b.json",
    }],
};

fn layer_tensor(part: LayerTensor) -> &'static str {
    use LayerTensor as T;
    match part {
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
    }
}
