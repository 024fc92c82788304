//! A bad checkpoint gets an error that names the file, the tensor, what was expected and
//! what was found — never a panic. Each case copies the tiny fixture and breaks one thing.

use crate::common;

use common::fixture_dir;

use std::fs;
use std::path::{Path, PathBuf};

use unmask_gpu::WeightFormat;
use unmask_gpu::model::{Model, ModelError};

/// A fresh copy of the fixture in a temporary folder unique to `name`.
fn copy_fixture(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("unmask-ckpt-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    for entry in fs::read_dir(fixture_dir()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    dir
}

fn load(dir: &Path) -> Result<Model, ModelError> {
    Model::load(common::ctx(), dir, WeightFormat::F32, &mut |_| {})
}

fn expect_error(dir: &Path, needles: &[&str]) -> String {
    let err = match load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    };
    eprintln!("[error] {err}");
    for n in needles {
        assert!(err.contains(n), "error should mention {n:?}: {err}");
    }
    let _ = fs::remove_dir_all(dir);
    err
}

/// Rewrites the JSON header of a safetensors file through `edit`, keeping the data.
fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut text = serde_json::to_string(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    fs::write(path, out).unwrap();
}

const SHARD1: &str = "model-00001-of-00002.safetensors";

/// The shard of the index holding `name`.
fn shard_of(dir: &Path, name: &str) -> String {
    let index: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    index["weight_map"][name].as_str().unwrap().to_string()
}

#[test]
fn the_fixture_itself_loads() {
    let m = load(&fixture_dir()).expect("fixture loads");
    assert_eq!(m.weights.layers.len(), 2);
}

#[test]
fn missing_folder_names_the_path() {
    let dir = std::env::temp_dir().join("unmask-no-such-model");
    let err = load(&dir).err().expect("fails").to_string();
    assert!(
        err.contains("unmask-no-such-model") && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn missing_checkpoint_files_are_named() {
    let dir = copy_fixture("nofiles");
    for f in [
        "model.safetensors.index.json",
        SHARD1,
        "model-00002-of-00002.safetensors",
    ] {
        fs::remove_file(dir.join(f)).unwrap();
    }
    expect_error(&dir, &["model.safetensors", "model.safetensors.index.json"]);
}

#[test]
fn missing_shard_is_named() {
    let dir = copy_fixture("noshard");
    fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    expect_error(&dir, &["model-00002-of-00002.safetensors"]);
}

#[test]
fn truncated_shard_is_named() {
    let dir = copy_fixture("truncated");
    let path = dir.join(SHARD1);
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    expect_error(&dir, &[SHARD1, "truncated"]);
}

#[test]
fn corrupt_header_is_named() {
    let dir = copy_fixture("corrupt");
    let path = dir.join(SHARD1);
    let mut bytes = fs::read(&path).unwrap();
    for b in &mut bytes[8..40] {
        *b = b'#';
    }
    fs::write(&path, bytes).unwrap();
    expect_error(&dir, &[SHARD1, "not a valid safetensors file"]);
}

#[test]
fn corrupt_index_is_named() {
    let dir = copy_fixture("badindex");
    fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": 7}",
    )
    .unwrap();
    expect_error(&dir, &["model.safetensors.index.json", "weight_map"]);
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture("notensor");
    let name = "model.transformer.blocks.1.k_proj.weight";
    let shard = shard_of(&dir, name);
    // Rename the tensor in the shard header and the index (a checkpoint of another layout).
    let renamed = "model.transformer.blocks.1.key_proj.weight";
    edit_header(&dir.join(&shard), |h| {
        let t = h.as_object_mut().unwrap().remove(name).unwrap();
        h[renamed] = t;
    });
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&index_path).unwrap()).unwrap();
    let map = index["weight_map"].as_object_mut().unwrap();
    let file = map.remove(name).unwrap();
    map.insert(renamed.to_string(), file);
    fs::write(&index_path, serde_json::to_string(&index).unwrap()).unwrap();
    expect_error(&dir, &[name, "missing"]);
}

#[test]
fn index_naming_the_wrong_shard_is_an_error() {
    let dir = copy_fixture("wrongshard");
    let name = "model.transformer.ln_f.weight";
    let shard = shard_of(&dir, name);
    let other = if shard == SHARD1 {
        "model-00002-of-00002.safetensors"
    } else {
        SHARD1
    };
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"][name] = serde_json::Value::String(other.to_string());
    fs::write(&index_path, serde_json::to_string(&index).unwrap()).unwrap();
    expect_error(&dir, &[name, other]);
}

#[test]
fn wrong_shape_names_tensor_expected_and_found() {
    let dir = copy_fixture("shape");
    // The config says d_model 64; claim 96 so the checkpoint no longer matches it.
    let cfg_path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["mlp_hidden_size"] = serde_json::json!(64);
    fs::write(&cfg_path, serde_json::to_string(&cfg).unwrap()).unwrap();
    expect_error(
        &dir,
        &[
            "ff_proj.weight",
            "expected shape [64, 64]",
            "found [96, 64]",
        ],
    );
}

#[test]
fn wrong_dtype_names_the_tensor() {
    let dir = copy_fixture("dtype");
    let name = "model.transformer.ln_f.weight";
    let shard = shard_of(&dir, name);
    // Relabel the bf16 norm weight as I16: same byte count, an unsupported dtype.
    edit_header(&dir.join(&shard), |h| {
        h[name]["dtype"] = serde_json::Value::String("I16".into());
    });
    expect_error(&dir, &[name, "I16", "BF16"]);
}

#[test]
fn unsupported_config_value_is_named() {
    let dir = copy_fixture("config");
    let cfg_path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["block_type"] = serde_json::json!("sequential");
    fs::write(&cfg_path, serde_json::to_string(&cfg).unwrap()).unwrap();
    expect_error(&dir, &["block_type", "sequential"]);
}
