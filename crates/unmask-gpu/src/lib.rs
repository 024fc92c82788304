//! Unmask on wgpu: the device context, typed buffers, the WGSL kernel library and
//! (with the model issue) the LLaDA forward pass.

pub mod context;
pub mod error;
pub mod model;
pub mod ops;
pub mod pipeline;
pub mod step;
pub mod tensor;

pub use context::{ContextOptions, GpuContext, KernelFeatures, MemoryCounter, parse_backend};
pub use error::{GpuError, Result};
pub use pipeline::{KernelSource, Spec};
pub use step::{Binding, StepEncoder};
pub use tensor::{DType, GpuBuffer, Tensor, Weight, WeightChunk, WeightFormat};

/// Declares a `KernelSource` for a file of the workspace's `shaders/` directory.
#[macro_export]
macro_rules! kernel_source {
    ($name:literal) => {
        $crate::pipeline::KernelSource {
            name: $name,
            source: include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../shaders/",
                $name,
                ".wgsl"
            )),
        }
    };
}
