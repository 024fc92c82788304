//! What can stop a load or a generation.

use std::path::PathBuf;

use thiserror::Error;
use unmask_core::depth_policy::DepthTableError;
use unmask_core::error::{ConfigError, SamplerError, TokenizerError};
use unmask_gpu::GpuError;
use unmask_gpu::model::ModelError;

/// Why a session cannot take a request, or a request cannot share a prefix entry.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Refusal {
    /// The request cannot share its prefix (no depth table, guidance, no shared turns, ...).
    #[error("{0}")]
    NotShared(String),
    /// The entry would pass the prefix store's budget.
    #[error("the shared prefix cannot be stored: {0}")]
    PrefixNotStored(String),
    #[error("a session with a shared prefix runs BiCache requests only: {0}")]
    NeedsSharedPrefix(String),
    #[error("the request shares a prefix entry: it runs in its prefix's session")]
    SharesAPrefix,
    #[error(
        "the request's shared prefix ({request} tokens) is not the session's ({session} tokens)"
    )]
    OtherPrefix { request: usize, session: usize },
    #[error(
        "the request's depth b = {request} is below the session's b = {session}: it would \
         reuse more shallow layers than its policy allows"
    )]
    ShallowerDepth { request: usize, session: usize },
    #[error("the session runs requests {session} classifier-free guidance; this one is {request}")]
    Guidance {
        session: &'static str,
        request: &'static str,
    },
    #[error(
        "the session runs {session} requests; a {request} request steps with other requests \
         of its kind (dLLM-Cache's steps have their own layer path)"
    )]
    OtherCache { session: String, request: String },
    #[error("the request needs {needed} positions; the session holds {holds}")]
    TooLong { needed: usize, holds: usize },
    /// Its pin on the session's entry failed (the store refused it).
    #[error("the request could not join the session: {0}")]
    CouldNotJoin(String),
    /// `unmask profile` found no item it could use.
    #[error("no item could be profiled ({0})")]
    NothingToProfile(String),
}

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
    /// A session cannot take this request (or cannot be made), and why.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// A step of the batch this request ran in failed; the request stopped with it. The
    /// cause is shared by every request of the batch.
    #[error("stopped with its batch: {0}")]
    BatchStopped(#[source] std::sync::Arc<EngineError>),
    #[error(transparent)]
    DepthTable(#[from] DepthTableError),
    /// A broken invariant of the runtime: a bug, not bad input.
    #[error("internal error: {0}")]
    Internal(String),
    /// `Engine::inject_fault_after_pin` at work (tests).
    #[error("injected fault after pinning a prefix")]
    InjectedFault,
    #[error("cannot read {location}: {message}")]
    File { location: String, message: String },
}
