//! One module per model family: every fact that differs between the published
//! architectures lives in its `FamilySpec` (`llada.rs`, `dream.rs`). The rest of the
//! runtime asks `ModelFamily::spec()` and never branches on the family itself; a new family
//! is one file here, its `config.json` reader (`config/`) and its kernels, if it needs new
//! ones.

mod dream;
mod llada;

use crate::chat::ChatFormat;
use crate::config::{LayerTensor, ModelFamily};
use crate::depth_policy::DepthTable;
use crate::sampler::Schedule;

/// A BiCache depth table shipped for a published model, recognised by its shape.
pub struct ShippedDepthTable {
    pub n_layers: usize,
    pub d_model: usize,
    /// The table's JSON (`crates/unmask-core/policies/`).
    pub json: &'static str,
    /// Where it lives in the repository, for messages.
    pub path: &'static str,
}

/// The token strings of a family's special tokens, looked up in its tokenizer.
pub struct SpecialTokenNames {
    pub mask: &'static str,
    pub eos: &'static str,
    /// `None`: the config's BOS id (else EOS), the template writes none.
    pub bos: Option<&'static str>,
    /// The end of a chat turn.
    pub eot: &'static str,
    /// LLaDA's header markers around a role name.
    pub headers: Option<(&'static str, &'static str)>,
}

/// What a family's published checkpoints, configs and reference code fix.
pub struct FamilySpec {
    /// The name `config.json`'s `model_type` and this runtime's messages use.
    pub name: &'static str,
    /// One line for `unmask info`: how the family differs from the others.
    pub summary: &'static str,
    /// The values of `model_type` that select the family (absent selects LLaDA).
    pub model_types: &'static [&'static str],
    pub embedding: &'static str,
    pub final_norm: &'static str,
    /// The untied LM head.
    pub lm_head: &'static str,
    /// The block prefix, before the layer number.
    pub block_prefix: &'static str,
    /// A block's tensor names after `{block_prefix}{layer}.`.
    pub layer_tensor: fn(LayerTensor) -> &'static str,
    /// `config.json` keys that spell a field otherwise than LLaDA's config does.
    pub config_keys: &'static [(&'static str, &'static str)],
    /// The prediction for position i is read from the hidden state of position i - 1
    /// (position 0 from its own): Dream's alignment with the AR model it started from.
    pub shifts_logits: bool,
    /// The sampler's schedule when the request names none.
    pub default_schedule: Schedule,
    /// The top-k cut when neither the request nor the model folder names one.
    pub default_top_k: Option<u32>,
    /// The chat format of the family's published template.
    pub chat_format: fn() -> ChatFormat,
    pub special_tokens: SpecialTokenNames,
    /// Depth tables shipped for the family's published models.
    pub depth_tables: &'static [ShippedDepthTable],
}

impl ModelFamily {
    /// Every family this runtime runs.
    pub const ALL: [ModelFamily; 2] = [ModelFamily::Llada, ModelFamily::Dream];

    /// The family's facts.
    pub fn spec(self) -> &'static FamilySpec {
        match self {
            ModelFamily::Llada => &llada::SPEC,
            ModelFamily::Dream => &dream::SPEC,
        }
    }

    /// The family a `config.json` `model_type` names (absent: LLaDA, whose configs have
    /// none).
    pub fn from_model_type(model_type: Option<&str>) -> Option<ModelFamily> {
        match model_type {
            None => Some(ModelFamily::Llada),
            Some(t) => Self::ALL
                .into_iter()
                .find(|f| f.spec().model_types.contains(&t)),
        }
    }

    pub fn as_str(self) -> &'static str {
        self.spec().name
    }

    pub fn shifts_logits(self) -> bool {
        self.spec().shifts_logits
    }

    /// The token embedding table.
    pub fn embedding_name(self) -> &'static str {
        self.spec().embedding
    }

    /// The norm after the last block.
    pub fn final_norm_name(self) -> &'static str {
        self.spec().final_norm
    }

    /// The untied LM head.
    pub fn lm_head_name(self) -> &'static str {
        self.spec().lm_head
    }

    /// Tensor `part` of block `layer`.
    pub fn layer_name(self, layer: usize, part: LayerTensor) -> String {
        let spec = self.spec();
        format!("{}{layer}.{}", spec.block_prefix, (spec.layer_tensor)(part))
    }

    /// The key of `config.json` that holds the field named `field` in LLaDA's spelling.
    pub fn config_key(self, field: &'static str) -> &'static str {
        self.spec()
            .config_keys
            .iter()
            .find(|(f, _)| *f == field)
            .map_or(field, |&(_, key)| key)
    }

    /// The chat format of the family's published template.
    pub fn chat_format(self) -> ChatFormat {
        (self.spec().chat_format)()
    }

    /// The depth table shipped for the published model of this family with the shape
    /// (`n_layers`, `d_model`), if there is one.
    pub fn shipped_depth_table(self, n_layers: usize, d_model: usize) -> Option<DepthTable> {
        self.spec()
            .depth_tables
            .iter()
            .find(|t| (t.n_layers, t.d_model) == (n_layers, d_model))
            .and_then(|t| DepthTable::from_json(t.json, t.path).ok())
    }
}

impl std::fmt::Display for ModelFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_types_select_their_family() {
        assert_eq!(ModelFamily::from_model_type(None), Some(ModelFamily::Llada));
        assert_eq!(
            ModelFamily::from_model_type(Some("llada")),
            Some(ModelFamily::Llada)
        );
        assert_eq!(
            ModelFamily::from_model_type(Some("Dream")),
            Some(ModelFamily::Dream)
        );
        assert_eq!(ModelFamily::from_model_type(Some("qwen2")), None);
    }

    #[test]
    fn every_family_names_every_tensor_once() {
        for family in ModelFamily::ALL {
            let mut names: Vec<String> = LayerTensor::ALL
                .iter()
                .map(|&t| family.layer_name(3, t))
                .collect();
            names.extend(
                [
                    family.embedding_name(),
                    family.final_norm_name(),
                    family.lm_head_name(),
                ]
                .map(String::from),
            );
            let n = names.len();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), n, "{family}: a name is used twice");
        }
        assert_eq!(
            ModelFamily::Llada.layer_name(2, LayerTensor::Down),
            "model.transformer.blocks.2.ff_out.weight"
        );
        assert_eq!(
            ModelFamily::Dream.layer_name(2, LayerTensor::QBias),
            "model.layers.2.self_attn.q_proj.bias"
        );
    }

    #[test]
    fn shipped_tables_parse_and_match_their_shape() {
        for family in ModelFamily::ALL {
            for t in family.spec().depth_tables {
                assert!(
                    family.shipped_depth_table(t.n_layers, t.d_model).is_some(),
                    "{}",
                    t.path
                );
            }
            assert!(family.shipped_depth_table(3, 17).is_none());
        }
        assert_eq!(
            ModelFamily::Dream.config_key("n_layers"),
            "num_hidden_layers"
        );
        assert_eq!(ModelFamily::Llada.config_key("n_layers"), "n_layers");
    }
}
