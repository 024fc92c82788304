//! model.safetensors.index.json: parsed, then laid out over headers for the shards it
//! names (the tiny fixture's two shards, taken in turn), with the right number of headers
//! and one too few; when it names few shards, also opened as an in-memory checkpoint over
//! the fixture shards' bytes and read whole.
#![no_main]

use std::path::Path;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use unmask_core::checkpoint::{Checkpoint, CheckpointLayout, FileHeader, ShardIndex};
use unmask_core::config::ModelConfig;
use unmask_fuzz::{FIXTURE_CONFIG, config, read_checkpoint, stored_shape};

static SHARDS: [&[u8]; 2] = [
    include_bytes!("../../tests/fixtures/tiny/model-00001-of-00002.safetensors"),
    include_bytes!("../../tests/fixtures/tiny/model-00002-of-00002.safetensors"),
];
static TINY: LazyLock<ModelConfig> = LazyLock::new(|| config(FIXTURE_CONFIG));

/// The header of fixture shard `i % 2`, as if read from the file `name`.
fn header(i: usize, name: &str) -> FileHeader {
    let bytes = SHARDS[i % 2];
    let path = Path::new(name);
    let len = FileHeader::header_len(path, bytes).expect("fixture");
    FileHeader::parse(path, &bytes[..len], Some(bytes.len() as u64)).expect("fixture")
}

/// Opening more shards than this per input would spend the run copying fixture bytes.
const MAX_SHARDS_IN_MEMORY: usize = 4;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let index_name = "model.safetensors.index.json";
    let Ok(index) = ShardIndex::parse(Path::new(index_name), text) else {
        return;
    };
    let dir = Path::new(".");
    let headers = |n: usize| -> Vec<FileHeader> {
        index
            .shards
            .iter()
            .take(n)
            .enumerate()
            .map(|(i, s)| header(i, s))
            .collect()
    };
    if let Ok(layout) = CheckpointLayout::sharded(dir, &index, headers(index.shards.len())) {
        let _ = layout.data_bytes();
        let names: Vec<String> = layout.names().map(str::to_string).collect();
        for name in &names {
            let _ = layout.file_of(name);
            if let Some(shape) = stored_shape(&layout, name) {
                let _ = layout.tensor_entry(name, &shape);
            }
        }
        for (name, shape) in TINY.tensor_specs() {
            let _ = layout.tensor_entry(&name, &shape);
            if let &[rows, cols] = shape.as_slice() {
                let _ = layout.quantized_entry(&name, rows, cols);
            }
        }
    }
    if let Some(fewer) = index.shards.len().checked_sub(1) {
        let _ = CheckpointLayout::sharded(dir, &index, headers(fewer));
    }
    if index.shards.len() <= MAX_SHARDS_IN_MEMORY {
        let files = index
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.clone(), SHARDS[i % 2].to_vec()))
            .collect();
        if let Ok(checkpoint) = Checkpoint::from_bytes(files, Some((index_name, text))) {
            read_checkpoint(&checkpoint, &TINY);
        }
    }
});
