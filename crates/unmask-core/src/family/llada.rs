//! LLaDA-8B (Base, Instruct) and LLaDA 1.5: `model.transformer.*` tensors, no q/k/v biases
//! (unless the config asks for them), LLaDA's linear schedule, its chat template.

use super::{FamilySpec, ShippedDepthTable, SpecialTokenNames};
use crate::chat::ChatFormat;
use crate::config::LayerTensor;
use crate::depth_policy::LLADA_8B_INSTRUCT;
use crate::sampler::Schedule;
use crate::tokenizer;

pub(super) static SPEC: FamilySpec = FamilySpec {
    name: "llada",
    summary: "LLaDA (model.transformer.* tensors, no biases)",
    model_types: &["llada"],
    embedding: "model.transformer.wte.weight",
    final_norm: "model.transformer.ln_f.weight",
    lm_head: "model.transformer.ff_out.weight",
    block_prefix: "model.transformer.blocks.",
    layer_tensor,
    config_keys: &[],
    shifts_logits: false,
    default_schedule: Schedule::Llada,
    default_top_k: None,
    chat_format: || ChatFormat::Llada,
    special_tokens: SpecialTokenNames {
        mask: tokenizer::MASK_TOKEN,
        eos: tokenizer::EOS_TOKEN,
        bos: Some(tokenizer::BOS_TOKEN),
        eot: tokenizer::EOT_TOKEN,
        headers: Some((tokenizer::START_HEADER_TOKEN, tokenizer::END_HEADER_TOKEN)),
    },
    depth_tables: &[ShippedDepthTable {
        n_layers: 32,
        d_model: 4096,
        json: LLADA_8B_INSTRUCT,
        path: "crates/unmask-core/policies/llada-8b-instruct.json",
    }],
};

fn layer_tensor(part: LayerTensor) -> &'static str {
    use LayerTensor as T;
    match part {
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
    }
}
