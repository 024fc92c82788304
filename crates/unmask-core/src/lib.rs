//! Unmask without a GPU: model config, safetensors checkpoint layout, tokenizer and chat
//! template, the diffusion sampler, cache policy, and the CPU oracle the GPU kernels are
//! tested against.

pub mod adaptive;
pub mod cache;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod depth_policy;
pub mod error;
pub mod family;
pub mod gemma_chat;
pub mod likelihood;
pub mod oracle;
pub mod prefix_store;
pub mod quant;
pub mod rng;
pub mod sampler;
pub mod small_files;
pub mod step_plan;
pub mod synth;
pub mod tokenizer;

/// The safetensors writer at its older path; it lives in `checkpoint::writer`.
pub use checkpoint::writer as safetensors_writer;
