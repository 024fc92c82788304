//! Unmask: a WebGPU inference runtime for diffusion language models (LLaDA).
//!
//! ```no_run
//! use unmask::{Engine, EngineOptions, Request};
//! let engine = Engine::load("models/tiny", &EngineOptions::default())?;
//! let out = engine.generate(&Request::chat(None, "What is 2+3?"))?;
//! println!("{}", out.text.unwrap_or_default());
//! # Ok::<(), unmask::EngineError>(())
//! ```
//!
//! The `Engine` loads a Hugging Face model folder (LLaDA, Dream) onto the GPU and runs the
//! reference sampler (`unmask_core::sampler`) with every forward pass on the GPU
//! (`unmask_gpu::model`): one command encoder per step, 12 bytes read back per sampled row
//! (and 8 per alternative when `top_logprobs` asks for them).
//! Every request runs in a `Session` of N ≥ 1 requests stepped together.
//!
//! DiffusionGemma folders (`config.json` with `model_type: "diffusion_gemma"`) load into a
//! `DgemmaEngine` instead: encoder, decoder and commit passes with the entropy-bound
//! sampler, a shared system turn kept by its prefix store (`is_diffusion_gemma_config` tells
//! the two apart).
//!
//! Generation is one `async` implementation (`Engine::generate_async`): natively the
//! blocking `generate` drives it with `pollster`, polling the device at each read-back; in a
//! browser it is awaited and each read-back yields to the page's event loop. Models load
//! from a directory (`Engine::load`, read in pieces) or from any `ModelFiles` source that
//! streams the checkpoint (`Engine::load_from`; the browser's fetch or picked files).

// Prefix entries are shared through `Arc` so native callers can use an engine from any
// thread; in a browser wgpu's handles are neither `Send` nor `Sync`, and the one thread
// makes the `Arc` merely a reference count.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

mod acache;
mod bicache;
mod clock;
mod dgemma;
mod engine;
mod error;
mod files;
mod likelihood;
mod options;
mod prefix;
pub mod profile;
mod request;
mod request_run;
mod run;
mod session;
mod spec;
mod text_side;

pub use bicache::PrefixEntry;
pub use clock::Stopwatch;
pub use dgemma::{
    DEFAULT_POSITIONS as DGEMMA_DEFAULT_POSITIONS, DgemmaEngine, DgemmaOutput, DgemmaRequest,
    DgemmaTask, DgemmaTextSide, encode_gemma_chat, is_diffusion_gemma_config,
};
pub use engine::Engine;
pub use error::{EngineError, Refusal};
#[cfg(not(target_arch = "wasm32"))]
pub use files::DirFiles;
pub use files::{MemoryFiles, ModelFiles};
pub use likelihood::{Likelihood, LikelihoodRun, best_estimate};
pub use options::{DEPTH_TABLE_FILE, EngineOptions};
pub use request::{
    AcacheReport, AdaptiveReport, BicacheReport, DEFAULT_ANCHOR_RATIO, Generation, Logprob,
    MOST_TOP_LOGPROBS, Prompt, Request, Span, StepEvent, Timings,
};
pub use request_run::RequestRun;
pub use session::{PrefixKey, Session};
pub use spec::{
    AdaptiveOverrides, DEFAULT_BLOCK, RequestSpec, Settings, SpecError, SpecLimits, logit_bias_ids,
};
pub use text_side::TextSide;
pub use unmask_core::adaptive::AdaptiveRefresh;
pub use unmask_core::cache::CacheMode;
pub use unmask_core::chat::{ChatFormat, Message, Role};
pub use unmask_core::config::ModelFamily;
pub use unmask_core::likelihood::{LikelihoodParams, MaskSample};
pub use unmask_core::prefix_store::StoreBudget as CacheBudget;
pub use unmask_core::prefix_store::{Recount, StoreEvent};
pub use unmask_core::sampler::{GenerationParams, LogitBias, Remasking, Schedule, StepRecord};
pub use unmask_core::tokenizer::DecodeMode;
pub use unmask_gpu::WeightFormat;
pub use unmask_gpu::dgemma::{PrefixUse, StepReport as DgemmaStep};
pub use unmask_gpu::model::{LoadProgress, ModelError, WeightFormats};
