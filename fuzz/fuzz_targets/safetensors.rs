//! A whole safetensors file: its length word and header parsed as the streaming loader
//! parses them (with and without the file's length), then the file as an in-memory
//! checkpoint with every tensor read, so that bad offsets, shapes and dtypes are exercised
//! against the data actually present.
#![no_main]

use std::path::Path;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use unmask_core::checkpoint::{Checkpoint, CheckpointLayout, FileHeader};
use unmask_core::config::ModelConfig;
use unmask_fuzz::{MICRO_CONFIG, config, read_checkpoint};

static MICRO: LazyLock<ModelConfig> = LazyLock::new(|| config(MICRO_CONFIG));

fuzz_target!(|data: &[u8]| {
    let path = Path::new("model.safetensors");
    if let Ok(len) = FileHeader::header_len(path, data)
        && let Some(head) = data.get(..len)
    {
        for file_len in [None, Some(data.len() as u64)] {
            if let Ok(header) = FileHeader::parse(path, head, file_len) {
                let _ = (header.data_start, header.data_len());
                let _ = header.tensors_in_order();
                let layout = CheckpointLayout::single(Path::new("."), header);
                let _ = layout.data_bytes();
                for (name, shape) in MICRO.tensor_specs() {
                    let _ = layout.tensor_entry(&name, &shape);
                    if let &[rows, cols] = shape.as_slice() {
                        let _ = layout.quantized_entry(&name, rows, cols);
                    }
                }
            }
        }
    }
    if let Ok(checkpoint) =
        Checkpoint::from_bytes(vec![(path.display().to_string(), data.to_vec())], None)
    {
        read_checkpoint(&checkpoint, &MICRO);
    }
});
