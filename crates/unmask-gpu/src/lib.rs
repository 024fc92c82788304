//! Unmask on wgpu: the device context (device facts only), typed buffers, the WGSL kernel
//! library with its kernel choice (`ops`), a model's weights on the GPU and the executor of
//! step plans (`model`), for every family `unmask_core::family` describes.

// Buffers and the context are shared through `Arc` so native callers can use them from any
// thread; in a browser wgpu's handles are neither `Send` nor `Sync`, and the one thread
// makes the `Arc` merely a reference count.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

pub mod context;
pub mod dgemma;
pub mod error;
pub mod model;
mod oneshot;
pub mod ops;
pub mod pipeline;
pub mod step;
pub mod tensor;
pub mod tune;

pub use context::{ContextOptions, GpuContext, KernelFeatures, MemoryCounter, parse_backend};
pub use error::{GpuError, Result};
pub use pipeline::{ComputeKernel, KernelSource, Spec};
pub use step::{
    Binding, HostCounts, StepEncoder, StepTrace, Submitted, TraceClock, TraceOptions,
    TracedDispatch,
};
pub use tensor::{DType, GpuBuffer, Tensor, Weight, WeightChunk, WeightFormat};

/// Declares a `KernelSource` for a file of this crate's `shaders/` directory; further names
/// append those files (WGSL declarations may come in any order), so kernels share code such
/// as the weight loaders of `weight_load.wgsl` without copies.
#[macro_export]
macro_rules! kernel_source {
    ($name:literal $(, $part:literal)* $(,)?) => {
        $crate::pipeline::KernelSource {
            name: $name,
            source: concat!(
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/shaders/", $name, ".wgsl")),
                $(
                    "\n",
                    include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/shaders/", $part, ".wgsl")),
                )*
            ),
        }
    };
}
