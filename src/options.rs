//! How to load a model: `EngineOptions`, and the model folder's depth table.

use std::path::PathBuf;
use unmask_core::depth_policy::DepthTable;
use unmask_core::prefix_store::StoreBudget;

use unmask_gpu::model::WeightFormats;
use unmask_gpu::ops::KernelOptions;
use unmask_gpu::ops::attention::AttentionKernel;
use unmask_gpu::ops::matmul::MatmulKernel;
use unmask_gpu::tune::TunePolicy;
use unmask_gpu::{ContextOptions, DType, WeightFormat};

use crate::EngineError;

/// File in a model folder holding its BiCache depth table (r → b), made by `unmask profile`.
pub const DEPTH_TABLE_FILE: &str = "bicache_depth.json";

/// How to load a model.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Backend name (`vulkan`, `metal`, `dx12`, `gl`); `None` honours `WGPU_BACKEND`.
    pub backend: Option<String>,
    /// Weight storage on the GPU; f16 by default (native when the device has shader-f16).
    /// `Q8` / `Q4` quantize the matrices as they load. A checkpoint written by
    /// `unmask quantize` keeps its own formats whatever is asked here.
    pub weight_format: WeightFormat,
    /// Storage of the embedding table and LM head; `None` means `weight_format`.
    pub embed_format: Option<WeightFormat>,
    /// What the BiCache prefix store may hold (tokens and bytes over all entries).
    pub cache_budget: StoreBudget,
    /// Most GPU memory (storage buffers: weights, states, cached prefixes) the engine may
    /// hold; work that would pass it is refused with an error before it is allocated.
    /// `None`: as much as the device gives.
    pub gpu_memory: Option<u64>,
    /// Keep wgpu's runtime bounds checks in the kernels (the default). Natively they may be
    /// turned off (`ContextOptions::runtime_checks`); a browser always checks.
    pub shader_checks: bool,
    /// The matmul kernel: `Auto` (the default) takes the measured or fixed choice per
    /// shape; a concrete kernel is pinned for every shape it supports.
    pub matmul_kernel: MatmulKernel,
    /// The attention kernel: `Auto` (the default) takes the measured or fixed choice per
    /// shape; a concrete kernel is pinned where it runs (else its fallback runs).
    pub attention_kernel: AttentionKernel,
    /// When `Auto` kernels are chosen by timing them on the device (`unmask_gpu::tune`).
    pub tune: TunePolicy,
    /// Where measured choices are kept (`None`: `unmask_gpu::tune::default_tune_file`).
    pub tune_file: Option<PathBuf>,
    /// Storage of the K/V arenas and BiCache prefix entries: `F32` (the default) or `F16`
    /// (half the memory; K and V rounded to f16 once, as they are written).
    pub kv_dtype: DType,
}

impl EngineOptions {
    /// The GPU context these options ask for: backend, memory budget and bounds checks.
    pub fn context_options(&self) -> Result<ContextOptions, EngineError> {
        let backends = self
            .backend
            .as_deref()
            .map(unmask_gpu::parse_backend)
            .transpose()?;
        Ok(ContextOptions {
            backends,
            memory_budget: self.gpu_memory,
            runtime_checks: self.shader_checks,
            ..ContextOptions::default()
        })
    }

    /// The model's kernel choice these options ask for.
    pub fn kernel_options(&self) -> KernelOptions {
        KernelOptions {
            matmul: self.matmul_kernel,
            attention: self.attention_kernel,
            tune: self.tune,
            tune_file: self.tune_file.clone(),
        }
    }

    /// The storage formats asked for.
    pub fn formats(&self) -> WeightFormats {
        WeightFormats {
            layers: self.weight_format,
            embed: self.embed_format.unwrap_or(self.weight_format),
        }
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            backend: None,
            weight_format: WeightFormat::F16Native,
            embed_format: None,
            cache_budget: StoreBudget {
                max_tokens: 1 << 16,
                max_bytes: 1 << 30,
            },
            gpu_memory: None,
            shader_checks: true,
            matmul_kernel: MatmulKernel::Auto,
            attention_kernel: AttentionKernel::Auto,
            tune: TunePolicy::Auto,
            tune_file: None,
            kv_dtype: DType::F32,
        }
    }
}

/// Parses a model folder's BiCache depth table (`file` names it in errors).
pub(crate) fn parse_depth_table(text: &str, file: &str) -> Result<DepthTable, EngineError> {
    Ok(DepthTable::from_json(text, file)?)
}
