//! DiffusionGemma's `config.json` (`model_type` "diffusion_gemma": the keys of the text stack
//! under `text_config`, the vision tower's ignored), as `docs/models/diffusion-gemma.md` §1
//! gives them. Parsed on its own: the runtime has no DiffusionGemma forward pass yet, so
//! `ModelConfig` still refuses the family; this is what its loader and `unmask info` read.

use serde_json::{Map, Value};

use super::fields::Fields;
use super::limits::{self, check_bound};
use super::parse::parse_object;
use crate::error::ConfigError;

/// The published `google/diffusiongemma-26B-A4B-it` text stack's keys (§1 of
/// `docs/models/diffusion-gemma.md`, in the older form with `global_head_dim` and no
/// `layer_types`): the shapes `unmask bench --config diffusiongemma-26b-a4b` times.
pub const DIFFUSION_GEMMA_26B_A4B_CONFIG_JSON: &str = r#"{"model_type": "diffusion_gemma",
    "canvas_length": 256, "text_config": {"vocab_size": 262144, "hidden_size": 2816,
    "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
    "num_global_key_value_heads": 2, "sliding_window": 1024, "num_experts": 128,
    "top_k_experts": 8, "moe_intermediate_size": 704, "use_bidirectional_attention": "vision"}}"#;

/// The attention of one layer: sliding-window (RoPE θ 10 000, full rotation) or full
/// (proportional partial RoPE, no `v_proj`), with its head size and key/value heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerAttention {
    pub sliding: bool,
    pub head_dim: usize,
    pub kv_heads: usize,
}

/// The text stack of a DiffusionGemma checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct DiffusionGemmaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense MLP and of the self-conditioning MLP.
    pub intermediate_size: usize,
    pub heads: usize,
    pub layers: Vec<LayerAttention>,
    pub sliding_window: usize,
    pub num_experts: usize,
    pub top_k_experts: usize,
    pub moe_intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub final_logit_softcapping: f64,
    /// Tokens of the canvas each denoising pass fills.
    pub canvas_length: usize,
}

impl DiffusionGemmaConfig {
    /// Whether a parsed `config.json` object is DiffusionGemma's.
    pub fn is_diffusion_gemma(map: &Map<String, Value>) -> bool {
        map.get("model_type").and_then(Value::as_str) == Some("diffusion_gemma")
    }

    pub fn from_json_str(text: &str, file: &str) -> Result<Self, ConfigError> {
        Self::from_map(&parse_object(text, file)?)
    }

    /// From the parsed top-level object of `config.json`.
    pub fn from_map(top: &Map<String, Value>) -> Result<Self, ConfigError> {
        if !Self::is_diffusion_gemma(top) {
            return Err(ConfigError::Unsupported {
                field: "model_type",
                expected: "\"diffusion_gemma\"".into(),
                found: top
                    .get("model_type")
                    .map_or("nothing".into(), Value::to_string),
            });
        }
        let text_config = match top.get("text_config") {
            Some(Value::Object(map)) => map,
            other => {
                return Err(ConfigError::WrongType {
                    field: "text_config",
                    expected: "an object (the text stack's keys)",
                    found: other.map_or("nothing".into(), |v| super::json_kind(v).into()),
                });
            }
        };
        let f = Fields { map: text_config };
        let required = |field: &'static str| {
            f.opt_size(field)?.ok_or_else(|| ConfigError::Invalid {
                field,
                expected: "a positive integer (the mixture of experts needs it)".into(),
                found: "nothing".into(),
            })
        };
        let n_layers = f.size_or("num_hidden_layers", 30)?;
        // Bounded before the layer list is built from it.
        check_bound("num_hidden_layers", n_layers, limits::MAX_LAYERS)?;
        let layers = layer_attention(&f, n_layers)?;
        if f.bool_or("attention_bias", false)? {
            return Err(ConfigError::Unsupported {
                field: "attention_bias",
                expected: "false".into(),
                found: "true".into(),
            });
        }
        let bidirectional = f.opt_str("use_bidirectional_attention")?;
        if bidirectional.as_deref().is_some_and(|v| v != "vision") {
            return Err(ConfigError::Unsupported {
                field: "use_bidirectional_attention",
                expected: "\"vision\" or null (a causal encoder over text)".into(),
                found: format!("{bidirectional:?}"),
            });
        }
        let activation = f.str_or("hidden_activation", "gelu_pytorch_tanh")?;
        if activation != "gelu_pytorch_tanh" {
            return Err(ConfigError::Unsupported {
                field: "hidden_activation",
                expected: "\"gelu_pytorch_tanh\"".into(),
                found: format!("\"{activation}\""),
            });
        }
        let config = Self {
            vocab_size: f.size_or("vocab_size", 262_144)?,
            hidden_size: f.size_or("hidden_size", 2304)?,
            intermediate_size: f.size_or("intermediate_size", 9216)?,
            heads: f.size_or("num_attention_heads", 8)?,
            layers,
            sliding_window: f.size_or("sliding_window", 512)?,
            num_experts: required("num_experts")?,
            top_k_experts: required("top_k_experts")?,
            moe_intermediate_size: required("moe_intermediate_size")?,
            rms_norm_eps: f.positive_float_or("rms_norm_eps", 1e-6)?,
            final_logit_softcapping: f.positive_float_or("final_logit_softcapping", 30.0)?,
            canvas_length: Fields { map: top }.size_or("canvas_length", 256)?,
        };
        if config.top_k_experts > config.num_experts {
            return Err(ConfigError::Invalid {
                field: "top_k_experts",
                expected: format!("at most num_experts ({})", config.num_experts),
                found: config.top_k_experts.to_string(),
            });
        }
        config.check_bounds()?;
        Ok(config)
    }

    /// The published checkpoint's text tensors (`docs/models/diffusion-gemma.md` §2), in
    /// the order a layer reads them: name and shape. The encoder's layer scalars are its
    /// only tensors besides the decoder's; the vision tower is not listed.
    pub fn tensor_specs(&self) -> Vec<(String, Vec<usize>)> {
        const DEC: &str = "model.decoder.";
        let (d, i, e, ie) = (
            self.hidden_size,
            self.intermediate_size,
            self.num_experts,
            self.moe_intermediate_size,
        );
        let mut out = vec![
            (
                format!("{DEC}embed_tokens.weight"),
                vec![self.vocab_size, d],
            ),
            (format!("{DEC}norm.weight"), vec![d]),
        ];
        for (l, a) in self.layers.iter().enumerate() {
            let p = format!("{DEC}layers.{l}.");
            let (q, kv) = (self.heads * a.head_dim, a.kv_heads * a.head_dim);
            let mut t = |name: &str, shape: Vec<usize>| out.push((format!("{p}{name}"), shape));
            t("input_layernorm.weight", vec![d]);
            t("self_attn.q_proj.weight", vec![q, d]);
            t("self_attn.k_proj.weight", vec![kv, d]);
            if a.sliding {
                t("self_attn.v_proj.weight", vec![kv, d]);
            }
            t("self_attn.o_proj.weight", vec![d, q]);
            t("self_attn.q_norm.weight", vec![a.head_dim]);
            t("self_attn.k_norm.weight", vec![a.head_dim]);
            t("post_attention_layernorm.weight", vec![d]);
            t("pre_feedforward_layernorm.weight", vec![d]);
            t("mlp.gate_proj.weight", vec![i, d]);
            t("mlp.up_proj.weight", vec![i, d]);
            t("mlp.down_proj.weight", vec![d, i]);
            t("post_feedforward_layernorm_1.weight", vec![d]);
            t("router.proj.weight", vec![e, d]);
            t("router.scale", vec![d]);
            t("router.per_expert_scale", vec![e]);
            t("pre_feedforward_layernorm_2.weight", vec![d]);
            t("experts.gate_up_proj", vec![e, 2 * ie, d]);
            t("experts.down_proj", vec![e, d, ie]);
            t("post_feedforward_layernorm_2.weight", vec![d]);
            t("post_feedforward_layernorm.weight", vec![d]);
            t("layer_scalar", vec![1]);
        }
        for l in 0..self.layers.len() {
            out.push((
                format!("model.encoder.language_model.layers.{l}.layer_scalar"),
                vec![1],
            ));
        }
        let sc = format!("{DEC}self_conditioning.");
        out.push((format!("{sc}pre_norm.weight"), vec![d]));
        out.push((format!("{sc}gate_proj.weight"), vec![i, d]));
        out.push((format!("{sc}up_proj.weight"), vec![i, d]));
        out.push((format!("{sc}down_proj.weight"), vec![d, i]));
        out
    }

    /// Every size within the runtime's bounds (`limits`), and the parameters they make: far
    /// above the published model, far below what overflows a size computation or asks the
    /// allocator for terabytes.
    fn check_bounds(&self) -> Result<(), ConfigError> {
        let mut sizes = vec![
            ("hidden_size", self.hidden_size, limits::MAX_D_MODEL),
            ("num_attention_heads", self.heads, limits::MAX_HEADS),
            (
                "intermediate_size",
                self.intermediate_size,
                limits::MAX_MLP_HIDDEN,
            ),
            (
                "moe_intermediate_size",
                self.moe_intermediate_size,
                limits::MAX_MLP_HIDDEN,
            ),
            ("vocab_size", self.vocab_size, limits::MAX_VOCAB),
            ("num_experts", self.num_experts, limits::MAX_EXPERTS),
            ("top_k_experts", self.top_k_experts, limits::MAX_EXPERTS),
            (
                "sliding_window",
                self.sliding_window,
                limits::MAX_SEQUENCE_LENGTH,
            ),
            (
                "canvas_length",
                self.canvas_length,
                limits::MAX_SEQUENCE_LENGTH,
            ),
        ];
        for l in &self.layers {
            sizes.push(("head_dim", l.head_dim, limits::MAX_D_MODEL));
            sizes.push(("num_key_value_heads", l.kv_heads, limits::MAX_HEADS));
        }
        for (field, value, max) in sizes {
            check_bound(field, value, max)?;
        }
        let (parameters, _) = self.parameter_counts();
        if parameters > limits::MAX_PARAMETERS {
            return Err(ConfigError::Invalid {
                field: "num_hidden_layers",
                expected: format!(
                    "a model of at most {} parameters (the runtime's bound)",
                    limits::MAX_PARAMETERS
                ),
                found: format!(
                    "{parameters} parameters from hidden_size {}, {} layers, {} experts of \
                     {}, vocab_size {}",
                    self.hidden_size,
                    self.layers.len(),
                    self.num_experts,
                    self.moe_intermediate_size,
                    self.vocab_size
                ),
            });
        }
        Ok(())
    }

    /// Parameters of the text stack: (all of them, those one token uses: K of the E experts).
    pub fn parameter_counts(&self) -> (u64, u64) {
        let d = self.hidden_size as u64;
        let (h, i) = (self.heads as u64, self.intermediate_size as u64);
        let expert = 3 * self.moe_intermediate_size as u64 * d;
        let mut shared = self.vocab_size as u64 * d + d + (d + 3 * i * d); // embedding, norm, self-cond.
        for l in &self.layers {
            let (hd, kv) = (l.head_dim as u64, l.kv_heads as u64);
            let v_proj = if l.sliding { kv * hd * d } else { 0 };
            shared += 2 * h * hd * d + kv * hd * d + v_proj + 2 * hd; // q, o, k, v, q/k norms
            shared += 7 * d + 3 * i * d + self.num_experts as u64 * (d + 1) + d + 1; // norms, MLP, router, scalar
        }
        let n = self.layers.len() as u64;
        (
            shared + n * self.num_experts as u64 * expert,
            shared + n * self.top_k_experts as u64 * expert,
        )
    }
}

/// Each layer's attention: `layer_types` (default: full every 6th layer, the last one full),
/// head sizes and key/value heads from `per_layer_config` for the full layers, or from
/// `global_head_dim` and `num_global_key_value_heads`.
fn layer_attention(f: &Fields<'_>, n_layers: usize) -> Result<Vec<LayerAttention>, ConfigError> {
    let sliding_kind = |i: usize| i % 6 != 5 && i + 1 != n_layers;
    let kinds: Vec<bool> = match f.map.get("layer_types") {
        None | Some(Value::Null) => (0..n_layers).map(sliding_kind).collect(),
        Some(Value::Array(items)) if items.len() == n_layers => items
            .iter()
            .map(|v| match v.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(ConfigError::Unsupported {
                    field: "layer_types",
                    expected: "\"sliding_attention\" or \"full_attention\" per layer".into(),
                    found: v.to_string(),
                }),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ConfigError::Invalid {
                field: "layer_types",
                expected: format!("an array of {n_layers} layer types (num_hidden_layers)"),
                found: super::json_kind(other).into(),
            });
        }
    };
    let head_dim = f.size_or("head_dim", 256)?;
    let kv_heads = f.size_or("num_key_value_heads", 4)?;
    let global_head_dim = f.size_or("global_head_dim", 512)?;
    let global_kv = f
        .opt_size("num_global_key_value_heads")?
        .unwrap_or(kv_heads);
    let per_layer = match f.map.get("per_layer_config") {
        Some(Value::Object(map)) => Some(map),
        None | Some(Value::Null) => None,
        Some(other) => {
            return Err(ConfigError::WrongType {
                field: "per_layer_config",
                expected: "an object of layer index -> {head_dim, num_key_value_heads}",
                found: super::json_kind(other).into(),
            });
        }
    };
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, sliding)| {
            if sliding {
                return Ok(LayerAttention {
                    sliding,
                    head_dim,
                    kv_heads,
                });
            }
            match per_layer.and_then(|m| m.get(&i.to_string())) {
                Some(Value::Object(layer)) => {
                    let lf = Fields { map: layer };
                    Ok(LayerAttention {
                        sliding,
                        head_dim: lf.size_or("head_dim", global_head_dim as u64)?,
                        kv_heads: lf.size_or("num_key_value_heads", global_kv as u64)?,
                    })
                }
                _ => Ok(LayerAttention {
                    sliding,
                    head_dim: global_head_dim,
                    kv_heads: global_kv,
                }),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> String {
        std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny-dgemma/config.json"
        ))
        .unwrap()
    }

    #[test]
    fn the_fixture_config_reads_as_published() {
        let c = DiffusionGemmaConfig::from_json_str(&fixture(), "config.json").unwrap();
        assert_eq!((c.hidden_size, c.heads, c.vocab_size), (48, 4, 320));
        assert_eq!(
            (c.num_experts, c.top_k_experts, c.moe_intermediate_size),
            (8, 2, 16)
        );
        assert_eq!((c.sliding_window, c.canvas_length), (8, 16));
        let full = LayerAttention {
            sliding: false,
            head_dim: 32,
            kv_heads: 1,
        };
        let sliding = LayerAttention {
            sliding: true,
            head_dim: 16,
            kv_heads: 2,
        };
        assert_eq!(c.layers, [sliding, full, sliding, full]);
        assert_eq!(c.final_logit_softcapping, 30.0);
        // Every tensor of the fixture's files but the encoder's copies of the layer scalars.
        assert_eq!(c.parameter_counts().0, 184_644);
    }

    /// The published 26B-A4B's keys (docs/models/diffusion-gemma.md §1), older form with
    /// `global_head_dim` and no `layer_types`: 25 sliding and 5 full layers, about 26 B
    /// parameters of which about 4 B serve a token.
    #[test]
    fn the_published_shape_counts_26b_total_4b_active() {
        let text = DIFFUSION_GEMMA_26B_A4B_CONFIG_JSON;
        let c = DiffusionGemmaConfig::from_json_str(text, "config.json").unwrap();
        assert_eq!(c.layers.iter().filter(|l| l.sliding).count(), 25);
        assert!(
            c.layers[29]
                == LayerAttention {
                    sliding: false,
                    head_dim: 512,
                    kv_heads: 2
                }
        );
        let (total, active) = c.parameter_counts();
        assert!((25.0e9..27.0e9).contains(&(total as f64)), "{total}");
        assert!((3.5e9..4.5e9).contains(&(active as f64)), "{active}");
        // The tensor list, counted on its own: every parameter, plus the encoder's copies of
        // the layer scalars (one per layer), with no name twice.
        let specs = c.tensor_specs();
        let listed: u64 = specs
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum();
        assert_eq!(listed, total + c.layers.len() as u64);
        let names: std::collections::BTreeSet<&str> =
            specs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names.len(), specs.len());
        assert_eq!(
            specs
                .iter()
                .filter(|(n, _)| n.ends_with("v_proj.weight"))
                .count(),
            25
        );
    }

    #[test]
    fn bad_keys_are_refused_with_the_field_named() {
        let base = fixture();
        for (from, to, field) in [
            (
                "\"num_experts\": 8",
                "\"num_experts\": \"8\"",
                "num_experts",
            ),
            (
                "\"top_k_experts\": 2",
                "\"top_k_experts\": 9",
                "top_k_experts",
            ),
            (
                "\"use_bidirectional_attention\": \"vision\"",
                "\"use_bidirectional_attention\": \"all\"",
                "use_bidirectional_attention",
            ),
            (
                "\"full_attention\",\n      \"sliding_attention\",\n      \"full_attention\"\n",
                "\"full_attention\"\n",
                "layer_types",
            ),
            (
                "\"moe_intermediate_size\": 16,",
                "",
                "moe_intermediate_size",
            ),
            (
                "\"model_type\": \"diffusion_gemma\"",
                "\"model_type\": \"gemma4\"",
                "model_type",
            ),
        ] {
            assert!(base.contains(from), "{from}");
            let err =
                DiffusionGemmaConfig::from_json_str(&base.replacen(from, to, 1), "config.json")
                    .unwrap_err()
                    .to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }

    /// Sizes past the runtime's bounds are refused by name before anything is built from
    /// them (a layer count of 931608280 made the parser allocate a layer list of 22 GB),
    /// and so are bounded sizes whose product is past the parameter bound.
    #[test]
    fn sizes_past_the_bounds_are_refused_before_allocating() {
        let base = fixture();
        let cases: [(&[(&str, &str)], &str); 8] = [
            (
                &[(
                    r#""num_hidden_layers": 4"#,
                    r#""num_hidden_layers": 931608280"#,
                )],
                "num_hidden_layers",
            ),
            (
                &[(r#""num_experts": 8"#, r#""num_experts": 1048576"#)],
                "num_experts",
            ),
            // Past num_experts, and with these widths a parameter count past u64.
            (
                &[
                    (r#""top_k_experts": 2"#, r#""top_k_experts": 4294967295"#),
                    (r#""hidden_size": 48"#, r#""hidden_size": 131072"#),
                    (
                        r#""moe_intermediate_size": 16"#,
                        r#""moe_intermediate_size": 4096"#,
                    ),
                ],
                "top_k_experts",
            ),
            (
                &[(r#""hidden_size": 48"#, r#""hidden_size": 4000000"#)],
                "hidden_size",
            ),
            (
                &[(
                    r#""moe_intermediate_size": 16"#,
                    r#""moe_intermediate_size": 4000000"#,
                )],
                "moe_intermediate_size",
            ),
            (
                &[(r#""head_dim": 16"#, r#""head_dim": 4000000"#)],
                "head_dim",
            ),
            (
                &[(r#""canvas_length": 16"#, r#""canvas_length": 4000000"#)],
                "canvas_length",
            ),
            // Each within its bound, together past the parameter bound.
            (
                &[
                    (r#""hidden_size": 48"#, r#""hidden_size": 131072"#),
                    (r#""num_experts": 8"#, r#""num_experts": 4096"#),
                    (
                        r#""moe_intermediate_size": 16"#,
                        r#""moe_intermediate_size": 1048576"#,
                    ),
                ],
                "parameters",
            ),
        ];
        for (edits, field) in cases {
            let mut text = base.clone();
            for (from, to) in edits {
                assert!(text.contains(from), "{from}");
                text = text.replacen(from, to, 1);
            }
            let err = DiffusionGemmaConfig::from_json_str(&text, "config.json")
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }
}
