use thiserror::Error;

/// Everything that can go wrong on the GPU side, with enough context to act on.
#[derive(Debug, Error)]
pub enum GpuError {
    #[error(
        "no GPU adapter found for backends {backends}. On Linux without a GPU install a software \
         adapter: `apt-get install mesa-vulkan-drivers` (Vulkan lavapipe) or use WGPU_BACKEND=gl \
         with Mesa llvmpipe (libegl-mesa0)"
    )]
    NoAdapter { backends: String },
    #[error("unknown backend {0:?}: expected one of vulkan, metal, dx12, gl, webgpu")]
    UnknownBackend(String),
    #[error("requesting a device from adapter {adapter:?} failed: {source}")]
    RequestDevice {
        adapter: String,
        #[source]
        source: wgpu::RequestDeviceError,
    },
    #[error("shader {kernel}:{entry} ({spec}) failed to compile: {message}")]
    Shader {
        kernel: &'static str,
        entry: &'static str,
        spec: String,
        message: String,
    },
    #[error("shape mismatch in {op}: expected {expected}, found {found}")]
    Shape {
        op: &'static str,
        expected: String,
        found: String,
    },
    #[error("{what} needs {needed} bytes in one binding but the device allows {limit}")]
    TooLarge {
        what: String,
        needed: u64,
        limit: u64,
    },
    #[error(
        "out of GPU memory allocating {what} ({needed} bytes, with {live} bytes already \
         allocated): {message}"
    )]
    OutOfMemory {
        what: String,
        needed: u64,
        live: u64,
        message: String,
    },
    #[error(
        "{what} needs {needed} bytes of GPU memory, but {live} of the budget's {budget} bytes \
         are in use (raise --gpu-memory, or free cached prefixes)"
    )]
    OverBudget {
        what: String,
        needed: u64,
        live: u64,
        budget: u64,
    },
    #[error("the GPU device was lost ({0}); load the model again")]
    DeviceLost(String),
    #[error("cannot quantize {what}: {message}")]
    Quantize { what: String, message: String },
    #[error("reading back a GPU buffer failed: {0}")]
    Readback(String),
    #[error("GPU validation error in {context}: {message}")]
    Validation { context: String, message: String },
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;
