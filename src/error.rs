//! What can stop a load or a generation.

use std::path::PathBuf;

use thiserror::Error;
use unmask_core::error::{ConfigError, SamplerError, TokenizerError};
use unmask_gpu::GpuError;
use unmask_gpu::model::ModelError;

/// Anything that can stop a load or a generation.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// A request field or option outside what the engine accepts.
    #[error("{field}: expected {expected}, found {found}")]
    Invalid {
        field: &'static str,
        expected: String,
        found: String,
    },
    #[error("{dir} has no tokenizer.json: give token ids instead of text", dir = dir.display())]
    NoTokenizer { dir: PathBuf },
    /// A batch session cannot take this request, with the reason.
    #[error("{0}")]
    Refused(String),
    /// A step of the batch this request ran in failed; the request stopped with it. The
    /// cause is shared by every request of the batch.
    #[error("stopped with its batch: {0}")]
    BatchStopped(#[source] std::sync::Arc<EngineError>),
    #[error("{0}")]
    DepthTable(String),
    /// A broken invariant of the runtime: a bug, not bad input.
    #[error("internal error: {0}")]
    Internal(String),
    /// `Engine::inject_fault_after_pin` at work (tests).
    #[error("injected fault after pinning a prefix")]
    InjectedFault,
    #[error("cannot read {location}: {message}")]
    File { location: String, message: String },
}
