//! `model.safetensors.index.json`: which shard holds each tensor of a sharded checkpoint.

use std::path::{Path, PathBuf};

use super::CheckpointError;

/// Largest `model.safetensors.index.json` read: it is read whole, so its size is checked
/// first. Published indexes are tens to hundreds of KiB (one line per tensor).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

/// The shards an index names, sorted, and which shard holds each tensor.
pub struct ShardIndex {
    pub(super) path: PathBuf,
    pub shards: Vec<String>,
    pub(super) wanted: Vec<(String, String)>,
}

impl ShardIndex {
    /// Parses the text of `model.safetensors.index.json` read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self, CheckpointError> {
        let index_err = |message: String| CheckpointError::Index {
            path: path.to_path_buf(),
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| index_err(e.to_string()))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| index_err("expected an object `weight_map`".into()))?;
        let mut shards: Vec<String> = Vec::new();
        let mut wanted: Vec<(String, String)> = Vec::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| index_err(format!("weight_map[{name}] is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file.contains("..") {
                return Err(index_err(format!(
                    "weight_map[{name}] = {file:?} is not a file in the checkpoint folder"
                )));
            }
            if !shards.iter().any(|s| s == file) {
                shards.push(file.to_string());
            }
            wanted.push((name.clone(), file.to_string()));
        }
        shards.sort();
        Ok(Self {
            path: path.to_path_buf(),
            shards,
            wanted,
        })
    }
}
