//! What the fuzz targets share: an allocator that turns an outsized allocation into a crash,
//! the small model they check checkpoints against, and the reads a loader makes of every
//! tensor. The targets themselves are in fuzz_targets/; scripts/fuzz.sh builds and runs them.

use std::alloc::{GlobalAlloc, Layout, System};

use unmask_core::checkpoint::{Checkpoint, CheckpointError, CheckpointLayout, TensorBytes};
use unmask_core::config::ModelConfig;

/// Largest single allocation allowed. Inputs are at most a few tens of KiB, so anything
/// near this size was sized by a number read from the input, not by the input's length:
/// the bug the fuzzer hunts for beside panics.
const MAX_ALLOCATION: usize = 256 << 20;

/// The system allocator, failing any allocation larger than `MAX_ALLOCATION`. libFuzzer's
/// `-rss_limit_mb` only sees memory that is touched; a reservation of gigabytes made by
/// `Vec::with_capacity` and filled slowly (or never) would slip under it. A failed
/// allocation aborts in `handle_alloc_error` with its size, and libFuzzer keeps the input.
pub struct CappedAllocator;

// SAFETY: every call is forwarded to `System` unchanged, or answered with null, which the
// `GlobalAlloc` contract allows for any request.
unsafe impl GlobalAlloc for CappedAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOCATION {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's own guarantees.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOCATION {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's own guarantees.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator, with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > MAX_ALLOCATION {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's own guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

/// The tiny fixture's config.json, for targets that need a valid config.
pub const FIXTURE_CONFIG: &str = include_str!("../../tests/fixtures/tiny/config.json");

/// A model small enough that a whole checkpoint of it fits in a few KiB of fuzz input;
/// fuzz/make_seeds.py writes the seed checkpoints of these shapes.
pub const MICRO_CONFIG: &str = r#"{
  "model_type": "llada", "block_type": "llama", "activation_type": "silu",
  "layer_norm_type": "rms", "rope": true, "weight_tying": false,
  "d_model": 8, "n_heads": 2, "n_kv_heads": 1, "n_layers": 1, "mlp_hidden_size": 8,
  "vocab_size": 16, "embedding_size": 16, "max_sequence_length": 16,
  "mask_token_id": 15, "eos_token_id": 14, "pad_token_id": 14
}"#;

pub fn config(text: &str) -> ModelConfig {
    ModelConfig::from_json_str(text).expect("the fuzzers' own configs are valid")
}

/// Splits an input at its first NUL byte: a file, and the optional second file that goes
/// with it (JSON never holds a raw NUL, so the split cannot cut a valid document).
pub fn split_nul(data: &[u8]) -> (&[u8], Option<&[u8]>) {
    match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], Some(&data[at + 1..])),
        None => (data, None),
    }
}

/// The shape a float tensor is stored with, or None for another dtype. The layout only
/// answers against an expected shape: ask for a scalar, and read the found shape from the
/// mismatch.
pub fn stored_shape(layout: &CheckpointLayout, name: &str) -> Option<Vec<usize>> {
    match layout.tensor_entry(name, &[]) {
        Ok(entry) => Some(entry.shape.to_vec()),
        Err(CheckpointError::Shape { found, .. }) => Some(found),
        Err(_) => None,
    }
}

/// Converts every element of a tensor to f32, in pieces, as the uploads do.
fn read_all(tensor: &TensorBytes<'_>) {
    let mut buf = [0f32; 61];
    let numel = tensor.numel();
    let mut start = 0;
    while start < numel {
        let n = (numel - start).min(buf.len());
        tensor.read_f32(start, &mut buf[..n]);
        start += n;
    }
}

/// Every read a loader makes of a checkpoint: each tensor it holds at its own shape, then
/// each tensor `config` names, as floats or quantized, converted to f32 row by row.
pub fn read_checkpoint(checkpoint: &Checkpoint, config: &ModelConfig) {
    let _ = checkpoint.data_bytes();
    let names: Vec<String> = checkpoint.names().map(str::to_string).collect();
    for name in &names {
        if let Some(shape) = stored_shape(checkpoint.layout(), name)
            && let Ok(tensor) = checkpoint.tensor(name, &shape)
        {
            read_all(&tensor);
        }
    }
    for (name, shape) in config.tensor_specs() {
        let _ = checkpoint.stored_tensor(&name, &shape);
        if let Ok(tensor) = checkpoint.tensor(&name, &shape) {
            read_all(&tensor);
        }
        let &[rows, cols] = shape.as_slice() else {
            continue;
        };
        let Ok(Some(quantized)) = checkpoint.quantized(&name, rows, cols) else {
            continue;
        };
        let _ = quantized.stored_bytes();
        let mut out = vec![0f32; 2 * cols];
        let mut row = 0;
        while row < rows {
            let n = (rows - row).min(2);
            quantized.read_f32(row, &mut out[..n * cols]);
            let _ = quantized.rows(row, n);
            row += n;
        }
    }
}
