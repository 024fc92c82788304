//! Every integration test of the root crate in one binary, so CI links once and the tests
//! share one GPU context (`common::ctx`). Each module is one subject; run one with
//! `cargo test --test all bicache::`.

mod common;

mod acache;
mod bicache;
mod bicache_batch;
mod cache_modes;
mod checkpoint_errors;
mod continuous;
mod dgemma;
mod dgemma_generate;
mod dgemma_shared_turn;
mod dllm_cache;
mod dream;
mod generate_goldens;
mod kernels_alternatives;
mod kernels_attention;
mod kernels_attention_mask;
mod kernels_attention_shapes;
mod kernels_cross_entropy;
mod kernels_dgemma;
mod kernels_elementwise;
mod kernels_experts;
mod kernels_matmul;
mod kernels_matmul_fused;
mod kernels_moe;
mod kernels_quant;
mod kernels_select;
mod kernels_select_confidence;
mod kernels_select_cut;
mod likelihood;
mod logit_bias;
mod model_parity;
mod profile;
mod quant_checkpoint;
mod quant_model;
mod request_run;
mod shader_portability;
mod step_program;
mod streamed_load;
mod synth;
mod tune;
// Raw Vulkan through wgpu's HAL: where wgpu has a Vulkan backend.
#[cfg(any(windows, target_os = "linux"))]
mod validation;
