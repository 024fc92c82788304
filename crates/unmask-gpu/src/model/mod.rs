//! The LLaDA model on the GPU: checkpoint loading, weights, and the forward pass over a
//! set of rows against a request's KV arena.

/// The safetensors checkpoint format needs no GPU: it lives in `unmask_core` (so tools such
/// as the fuzzer read checkpoints without building wgpu) and is re-exported at its old path.
pub mod checkpoint {
    pub use unmask_core::checkpoint::*;
}
pub mod adaptive;
pub mod forward;
mod layer;
mod logits;
pub mod plan;
pub mod quant_checkpoint;
mod select;
pub mod stream;
pub mod weights;

use thiserror::Error;
use unmask_core::error::ConfigError;

pub use adaptive::{AdaptiveCache, AdaptiveInput, AdaptiveOutput, AdaptiveRows, AdaptiveShared};
pub use checkpoint::{
    Checkpoint, CheckpointError, CheckpointLayout, FileHeader, QuantTensor, ShardIndex,
    StoredTensor,
};
pub use forward::{ForwardState, KvLayer, LayerPass, Model, SelectBuffers, SeqWindow, TokenChoice};
pub use logits::{LogitsState, ScoredSeq, TargetSeq};
pub use plan::{DeepRows, PlanBuffers, SharedPrefix};
pub use quant_checkpoint::write_quantized;
pub use stream::BodyStream;
pub use weights::{
    LayerWeights, LoadProgress, ModelWeights, WeightFormats, WeightUpload, weight_bytes,
};

#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Gpu(#[from] crate::error::GpuError),
    #[error("writing the checkpoint failed: {0}")]
    Write(#[from] unmask_core::safetensors_writer::SafetensorsError),
    #[error("invalid input: {0}")]
    Input(String),
    /// The caller stopped a generation between two steps.
    #[error("cancelled after {steps} denoising steps")]
    Cancelled { steps: usize },
    #[error(
        "tensor {name} in {path} holds {value} at row {row}, column {col} ({count} non-finite \
         values in that block): expected finite weights (a corrupt or wrongly converted checkpoint)",
        path = path.display()
    )]
    NonFinite {
        name: String,
        path: std::path::PathBuf,
        row: usize,
        col: usize,
        value: f32,
        count: usize,
    },
}
