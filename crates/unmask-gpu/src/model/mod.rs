//! The LLaDA model on the GPU: checkpoint loading, weights, and the forward pass over a
//! set of rows against a request's KV arena.

pub mod checkpoint;
pub mod forward;
pub mod quant_checkpoint;
pub mod stream;
pub mod weights;

use thiserror::Error;
use unmask_core::error::ConfigError;

pub use checkpoint::{
    Checkpoint, CheckpointError, CheckpointLayout, FileHeader, QuantTensor, ShardIndex,
    StoredTensor,
};
pub use forward::{
    ForwardState, KvLayer, LayerPass, LladaModel, SelectBuffers, SeqWindow, TokenChoice,
};
pub use quant_checkpoint::write_quantized;
pub use stream::BodyStream;
pub use weights::{
    LayerWeights, LladaWeights, LoadProgress, WeightFormats, WeightUpload, weight_bytes,
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
}
