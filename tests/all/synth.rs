//! `unmask synth`'s library end to end: a scaled-down LLaDA config (GQA, 3 layers, vocab
//! 300) synthesized into several shards, read back by the checkpoint reader, loaded by the
//! engine without a tokenizer and run; the same seed writes the same bytes whatever the shard
//! size, another seed other bytes; and the folder checks.

use crate::common;

use std::path::{Path, PathBuf};

use serde_json::Value;
use unmask::{Engine, EngineOptions, WeightFormat};
use unmask_core::config::ModelConfig;
use unmask_core::synth::{
    INIT_STD, SynthConfig, SynthError, SynthOptions, SynthSummary, WeightDtype, write_checkpoint,
};
use unmask_gpu::model::Checkpoint;

/// A temporary folder, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("unmask-synth-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// LLaDA-8B's config.json at test size, written as a file (the `--config FILE` path).
fn scaled_config(dir: &TempDir) -> SynthConfig {
    let files = ModelConfig::preset_files("llada-8b").unwrap();
    let mut value: Value = serde_json::from_str(&files.config_json).unwrap();
    for (key, v) in [
        ("d_model", 96),
        ("n_heads", 6),
        ("n_kv_heads", 3),
        ("n_layers", 3),
        ("mlp_hidden_size", 160),
        ("vocab_size", 300),
        ("embedding_size", 304),
        ("max_sequence_length", 64),
        ("mask_token_id", 299),
        ("eos_token_id", 297),
        ("pad_token_id", 297),
    ] {
        value[key] = v.into();
    }
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
    SynthConfig::resolve(path.to_str().unwrap()).expect("scaled config is valid")
}

/// The parameter count from the architecture, written out independently of tensor_specs.
fn formula_params(c: &ModelConfig) -> u64 {
    let (d, h, e) = (
        c.d_model as u64,
        c.mlp_hidden_size as u64,
        c.embedding_size as u64,
    );
    let kv = (c.n_kv_heads * c.head_dim()) as u64;
    let per_layer = 2 * d * d + 2 * kv * d + 3 * h * d + 2 * d;
    let lm_head = if c.weight_tying { 0 } else { e * d };
    e * d + c.n_layers as u64 * per_layer + d + lm_head
}

fn synth(config: &SynthConfig, out: &Path, seed: u64, shard_bytes: u64) -> SynthSummary {
    let options = SynthOptions {
        seed,
        dtype: WeightDtype::BF16,
        shard_bytes,
        force: false,
    };
    write_checkpoint(out, config, &options, &mut |_| {}).expect("synth writes")
}

/// Every file of a folder, by name.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn scaled_checkpoint_loads_and_runs_without_a_tokenizer() {
    let tmp = TempDir::new("load");
    let config = scaled_config(&tmp);
    let out = tmp.path().join("model");
    let summary = synth(&config, &out, 7, 100_000);
    let c = config.config.masked().expect("a LLaDA or Dream config");
    assert_eq!(summary.params, formula_params(c));
    assert_eq!(summary.data_bytes, 2 * formula_params(c));
    assert!(summary.shards.len() >= 2, "{} shards", summary.shards.len());

    // The index names every tensor, and its total is the tensor bytes.
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["metadata"]["total_size"], summary.data_bytes);
    assert_eq!(
        index["weight_map"].as_object().unwrap().len(),
        c.tensor_specs().len()
    );

    // The reader validates every header and finds every tensor with its shape.
    let ckpt = Checkpoint::open(&out).expect("checkpoint opens");
    assert_eq!(ckpt.data_bytes(), summary.data_bytes);
    let wte = ckpt
        .tensor("model.transformer.wte.weight", &[304, 96])
        .unwrap();
    let mut values = vec![0f32; wte.numel()];
    wte.read_f32(0, &mut values);
    let n = values.len() as f64;
    let std = (values.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n).sqrt();
    assert!((std - INIT_STD as f64).abs() < 0.001, "std {std}");
    let norm = ckpt
        .tensor("model.transformer.blocks.2.ff_norm.weight", &[96])
        .unwrap();
    let mut ones = vec![0f32; 96];
    norm.read_f32(0, &mut ones);
    assert!(ones.iter().all(|&v| v == 1.0));

    // The engine loads it without tokenizer.json and runs a forward on token ids.
    let options = EngineOptions {
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    let engine = Engine::load_on(common::ctx(), &out, &options, &mut |_| {}).expect("loads");
    assert!(engine.tokenizer().is_none());
    assert_eq!(engine.config().parameter_count(), formula_params(c));
    assert_eq!(
        engine.special().bos,
        297,
        "no BOS anywhere: the EOS id stands in"
    );
    let ids = [1u32, 5, 299, 299, 42];
    let logits = engine.model().logits(&ids).expect("forward");
    assert_eq!(logits.len(), ids.len() * 304);
    assert!(logits.iter().all(|v| v.is_finite()));
    let spread = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(spread > 1e-3, "logits are all near zero ({spread})");

    // Text needs the tokenizer, and the error names the missing file.
    let err = engine
        .encode_prompt(&unmask::Prompt::Chat(vec![unmask::Message {
            role: unmask::Role::User,
            content: "hi".into(),
        }]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.json"), "{err}");

    // One file instead of several: the same tensors and the same logits.
    let single = tmp.path().join("single");
    let one = synth(&config, &single, 7, u64::MAX);
    assert_eq!(one.shards.len(), 1);
    assert!(single.join("model.safetensors").is_file());
    let engine = Engine::load_on(common::ctx(), &single, &options, &mut |_| {}).unwrap();
    assert_eq!(engine.model().logits(&ids).unwrap(), logits);
}

#[test]
fn same_seed_same_bytes_whatever_the_sharding() {
    let tmp = TempDir::new("determinism");
    let config = scaled_config(&tmp);
    let a = tmp.path().join("a");
    let b = tmp.path().join("b");
    let coarse = tmp.path().join("coarse");
    let other = tmp.path().join("other");
    let sa = synth(&config, &a, 11, 100_000);
    synth(&config, &b, 11, 100_000);
    let sc = synth(&config, &coarse, 11, 300_000);
    synth(&config, &other, 12, 100_000);

    // The same seed and budget: byte-identical folders.
    let fa = files(&a);
    assert_eq!(fa, files(&b));

    // Another budget: other shard files, the same bytes in every tensor.
    assert!(sc.shards.len() < sa.shards.len() && sc.shards.len() >= 2);
    let (ca, cc) = (
        Checkpoint::open(&a).unwrap(),
        Checkpoint::open(&coarse).unwrap(),
    );
    for (name, shape) in config.config.tensor_specs() {
        assert_eq!(
            ca.tensor(&name, &shape).unwrap().data,
            cc.tensor(&name, &shape).unwrap().data,
            "{name}"
        );
    }

    // Another seed: the same config and layout, other weights.
    let fo = files(&other);
    assert_eq!(
        fa.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        fo.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    let co = Checkpoint::open(&other).unwrap();
    let name = "model.transformer.blocks.1.q_proj.weight";
    assert_ne!(
        ca.tensor(name, &[96, 96]).unwrap().data,
        co.tensor(name, &[96, 96]).unwrap().data
    );
    let config_json = |f: &[(String, Vec<u8>)]| {
        f.iter()
            .find(|(n, _)| n == "config.json")
            .map(|(_, b)| b.clone())
    };
    assert_eq!(config_json(&fa), config_json(&fo));
}

#[test]
fn output_folder_checks() {
    let tmp = TempDir::new("folders");
    let config = SynthConfig::preset("tiny").unwrap();
    let out = tmp.path().join("out");
    let shards = synth(&config, &out, 0, 60_000).shards.len();
    assert!(shards >= 2);

    // A folder with files in it is refused unless forced.
    let refuse = write_checkpoint(&out, &config, &SynthOptions::default(), &mut |_| {});
    match refuse {
        Err(SynthError::NotEmpty { path, .. }) => assert_eq!(path, out),
        other => panic!("expected NotEmpty, got {other:?}"),
    }
    // Forced, it is rewritten as one file and the old shards and index are gone.
    std::fs::write(out.join("notes.txt"), "kept").unwrap();
    let forced = SynthOptions {
        force: true,
        ..SynthOptions::default()
    };
    write_checkpoint(&out, &config, &forced, &mut |_| {}).expect("forced write");
    let names: Vec<String> = files(&out).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "notes.txt"
        ]
    );
    Checkpoint::open(&out).expect("the rewritten checkpoint opens");

    // A folder that cannot be created is named.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let err = write_checkpoint(&file.join("sub"), &config, &forced, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("a-file/sub"), "{err}");
    assert!(matches!(
        write_checkpoint(&file, &config, &forced, &mut |_| {}),
        Err(SynthError::NotADirectory { .. })
    ));

    // Unknown presets list the valid ones.
    let err = SynthConfig::resolve("llada-70b").unwrap_err().to_string();
    assert!(
        err.contains("llada-8b, tiny, dream-7b, tiny-dream"),
        "{err}"
    );
}

/// The Dream preset at test size: Qwen2 names, q/k/v biases (random, so their path is
/// exercised), untied head; the engine loads it without a tokenizer, runs the forward and
/// generates with Dream's schedule; `with_layers` writes Qwen2's layer key.
#[test]
fn dream_preset_synthesizes_loads_and_generates() {
    let tmp = TempDir::new("dream");
    let config = SynthConfig::preset("tiny-dream")
        .unwrap()
        .with_layers(3)
        .unwrap();
    let c = config.config.masked().expect("a LLaDA or Dream config");
    assert_eq!(c.family, unmask::ModelFamily::Dream);
    assert_eq!(c.n_layers, 3);
    assert!(config.config_json.contains("\"num_hidden_layers\": 3"));
    let out = tmp.path().join("model");
    let summary = synth(&config, &out, 3, 60_000);
    let biases = 3 * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim();
    assert_eq!(summary.params, formula_params(c) + biases as u64);
    let ckpt = Checkpoint::open(&out).expect("checkpoint opens");
    let bias = ckpt
        .tensor("model.layers.2.self_attn.k_proj.bias", &[32])
        .unwrap();
    let mut values = vec![0f32; 32];
    bias.read_f32(0, &mut values);
    assert!(values.iter().any(|&v| v != 0.0), "random biases");
    let options = EngineOptions {
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    let engine = Engine::load_on(common::ctx(), &out, &options, &mut |_| {}).expect("loads");
    let logits = engine
        .model()
        .logits(&[1, 5, 304, 304, 42])
        .expect("forward");
    assert!(logits.iter().all(|v| v.is_finite()));
    let out = engine
        .generate(&unmask::Request::ids(vec![1, 5, 42]).with_params(common::params(8, 4, 8)))
        .expect("generates");
    assert_eq!(out.ids.len(), 8);
    assert!(!out.ids.contains(&304));
}

/// A DiffusionGemma checkpoint from the fixture's config.json: written in several shards,
/// loaded by the DiffusionGemma loader (every name and shape it reads is there), its encoder
/// and decoder run to finite logits; the same seed gives the same bytes, and a 1-layer cut
/// loads too.
#[test]
fn diffusion_gemma_checkpoint_loads_and_runs() {
    use unmask_gpu::dgemma::DgemmaModel;
    let tmp = TempDir::new("dgemma");
    let fixture = common::fixture_dir().with_file_name("tiny-dgemma");
    let config = SynthConfig::resolve(fixture.to_str().unwrap()).unwrap();
    let out = tmp.path().join("model");
    let summary = synth(&config, &out, 3, 200_000);
    assert!(summary.shards.len() > 1, "{} shards", summary.shards.len());
    assert_eq!(summary.params, config.config.parameter_count());
    let ctx = common::ctx();
    let model =
        DgemmaModel::load(&ctx, &out, WeightFormat::F32, 64).expect("synthesized folder loads");
    let mut cache = model.new_cache(&ctx, 64).unwrap();
    let logits = model
        .encode(&ctx, &mut cache, &[2, 105, 90, 7], true)
        .unwrap()
        .unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    let canvas: Vec<u32> = (0..model.cfg.canvas_length as u32).map(|i| 3 + i).collect();
    let decoded = model.decode(&ctx, &cache, &canvas, None).unwrap();
    assert!(decoded.iter().all(|x| x.is_finite()));
    assert!(
        decoded.iter().any(|&x| x != decoded[0]),
        "random weights give varied logits"
    );
    let again = tmp.path().join("again");
    synth(&config, &again, 3, 50_000_000);
    let (ca, cb) = (
        Checkpoint::open(&out).unwrap(),
        Checkpoint::open(&again).unwrap(),
    );
    for (name, shape) in config.config.tensor_specs() {
        assert_eq!(
            ca.tensor(&name, &shape).unwrap().data,
            cb.tensor(&name, &shape).unwrap().data,
            "{name}: the same seed, whatever the shards"
        );
    }
    let one = config.with_layers(1).unwrap();
    let out1 = tmp.path().join("one");
    synth(&one, &out1, 3, 50_000_000);
    let m1 = DgemmaModel::load(&ctx, &out1, WeightFormat::F32, 64).expect("1-layer cut loads");
    assert_eq!(m1.cfg.layers.len(), 1);
}
