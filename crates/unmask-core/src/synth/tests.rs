//! The synthesizer's plans, presets and streams.

use super::*;
use crate::config::{DiffusionGemmaConfig, ModelConfig};

#[test]
fn fewer_layers_keep_every_other_field() {
    let full = SynthConfig::preset("llada-8b").unwrap();
    let two = full.clone().with_layers(2).unwrap();
    let (t, f) = (two.config.masked().unwrap(), full.config.masked().unwrap());
    assert_eq!(t.n_layers, 2);
    assert_eq!(t.d_model, f.d_model);
    assert_eq!(t.embedding_size, f.embedding_size);
    assert_eq!(two.generation_config_json, full.generation_config_json);
    let reread = ModelConfig::from_json_str(&two.config_json).unwrap();
    assert_eq!(&reread, t);
    assert!(two.source.contains("2 layers"), "{}", two.source);
}

#[test]
fn llada_8b_preset_has_the_reference_size() {
    let preset = SynthConfig::preset("llada-8b").unwrap();
    // llada.md §5: 8,015,581,184 parameters, 16,031,162,368 bytes in bf16.
    assert_eq!(preset.config.parameter_count(), 8_015_581_184);
    let decls = tensor_decls(&preset.config, WeightDtype::BF16);
    assert_eq!(decls.len(), 291);
    let bytes: u64 = decls.iter().map(|d| d.byte_len().unwrap()).sum();
    assert_eq!(bytes, 16_031_162_368);
    let c = preset.config.masked().unwrap();
    assert_eq!(
        (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads),
        (4096, 32, 32, 32)
    );
    assert_eq!((c.mlp_hidden_size, c.vocab_size), (12288, 126464));
    assert_eq!(c.embedding_size, 126464);
    assert!(!c.weight_tying);
    // Four shards under Hugging Face's 5 GB default, none over it.
    let shards = plan_shards(&decls, DEFAULT_SHARD_BYTES);
    assert_eq!(shards.len(), 4);
    for s in &shards {
        let size: u64 = decls[s.clone()].iter().map(|d| d.byte_len().unwrap()).sum();
        assert!(size <= DEFAULT_SHARD_BYTES, "{size}");
    }
}

#[test]
fn llada_8b_preset_is_the_reference_file() {
    let preset = SynthConfig::preset("llada-8b").unwrap();
    let value: Value = serde_json::from_str(&preset.config_json).unwrap();
    let map = value.as_object().unwrap();
    assert_eq!(map.len(), 46);
    assert_eq!(map["rms_norm_eps"], json!(1e-5));
    assert_eq!(map["init_std"], json!(0.02));
    assert!(preset.config_json.contains("\"rms_norm_eps\": 1e-05,\n"));
    assert!(!preset.config_json.ends_with('\n'));
    let generation = preset.generation_config_json.unwrap();
    let generation: Value = serde_json::from_str(&generation).unwrap();
    assert_eq!(generation["bos_token_id"], 126080);
}

#[test]
fn unknown_configs_name_the_presets() {
    let e = SynthConfig::resolve("llada-9b").unwrap_err().to_string();
    assert!(
        e.contains("llada-9b") && e.contains("llada-8b, tiny"),
        "{e}"
    );
}

#[test]
fn streams_are_counter_based() {
    let mut whole = vec![0f32; 1000];
    fill_normal(5, "w", 0, &mut whole);
    let mut part = vec![0f32; 300];
    fill_normal(5, "w", 700, &mut part);
    assert_eq!(&whole[700..], &part[..]);
    let mut other = vec![0f32; 1000];
    fill_normal(5, "v", 0, &mut other);
    assert_ne!(whole, other);
    fill_normal(6, "w", 0, &mut other);
    assert_ne!(whole, other);
}

#[test]
fn values_have_the_init_statistics() {
    let mut v = vec![0f32; 1 << 18];
    fill_normal(1, "model.transformer.wte.weight", 0, &mut v);
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    assert!(mean.abs() < 2e-4, "mean {mean}");
    assert!(
        (var.sqrt() - INIT_STD as f64).abs() < 2e-4,
        "std {}",
        var.sqrt()
    );
    let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(max <= 3.47 * INIT_STD && max > 2.5 * INIT_STD, "max {max}");
}

#[test]
fn shards_follow_the_budget() {
    let d = |n: usize| TensorDecl::new(format!("t{n}"), Dtype::U8, vec![n]);
    let tensors = vec![d(4), d(3), d(10), d(2), d(2)];
    assert_eq!(plan_shards(&tensors, 7), vec![0..2, 2..3, 3..5]);
    assert_eq!(plan_shards(&tensors, 100), vec![0..5]);
    assert_eq!(plan_shards(&tensors, 1).len(), 5);
    assert!(plan_shards(&[], 10).is_empty());
    assert_eq!(shard_names(1), vec!["model.safetensors"]);
    assert_eq!(
        shard_names(2),
        vec![
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
}

/// DiffusionGemma's published text stack: every parameter listed once (the encoder's layer
/// scalars besides), about 50 GB in bf16; cut to 2 layers, `layer_types`-free configs keep
/// the last layer full, and the tensors are those of 2 layers.
#[test]
fn the_diffusion_gemma_preset_lists_the_published_tensors() {
    let preset = SynthConfig::preset(DIFFUSION_GEMMA_PRESET).unwrap();
    let SynthModel::DiffusionGemma(c) = &preset.config else {
        panic!("a DiffusionGemma config");
    };
    let (total, _) = c.parameter_counts();
    assert_eq!(preset.config.parameter_count(), total + 30);
    let decls = tensor_decls(&preset.config, WeightDtype::BF16);
    let bytes: u64 = decls.iter().map(|d| d.byte_len().unwrap()).sum();
    assert_eq!(bytes, 2 * (total + 30));
    assert!((50.0e9..54.0e9).contains(&(bytes as f64)), "{bytes}");
    assert!(preset.generation_config_json.is_none());
    let two = preset.clone().with_layers(2).unwrap();
    let SynthModel::DiffusionGemma(t) = &two.config else {
        panic!("still DiffusionGemma");
    };
    assert_eq!(t.layers.len(), 2);
    assert_eq!((t.hidden_size, t.vocab_size), (c.hidden_size, c.vocab_size));
    let reread = DiffusionGemmaConfig::from_json_str(&two.config_json, "config.json").unwrap();
    assert_eq!(&reread, t);
    let names: Vec<String> = two
        .config
        .tensor_specs()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(names.contains(&"model.decoder.layers.1.experts.gate_up_proj".to_string()));
    assert!(!names.iter().any(|n| n.contains("layers.2.")));
}

/// A DiffusionGemma config with `layer_types` and `per_layer_config` (the test fixture's
/// form) cut to fewer layers drops the entries of the layers it leaves out.
#[test]
fn fewer_diffusion_gemma_layers_cut_the_layer_lists() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-dgemma");
    let full = SynthConfig::resolve(dir.to_str().unwrap()).unwrap();
    assert!(
        full.generation_config_json.is_some(),
        "the folder's generation_config.json"
    );
    let one = full.with_layers(1).unwrap();
    let v: Value = serde_json::from_str(&one.config_json).unwrap();
    assert_eq!(v["text_config"]["layer_types"].as_array().unwrap().len(), 1);
    assert!(
        v["text_config"]["per_layer_config"]
            .as_object()
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        one.config
            .tensor_specs()
            .iter()
            .filter(|(n, _)| n.contains("layers.0."))
            .count(),
        22 + 1
    );
}
