//! Adapter choice, device creation and the features the kernels may use: device facts
//! only. Which kernel runs is the model's choice (`ops::Kernels`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{GpuError, Result};
use crate::pipeline::PipelineCache;
use crate::step::bind_groups::BindGroupCache;
use crate::step::{HostCounters, ReadbackRing, TraceState};

/// How to pick the adapter and what the device may use.
#[derive(Clone, Debug)]
pub struct ContextOptions {
    /// Backends to consider. `None` honours `WGPU_BACKEND`, else all native backends.
    pub backends: Option<wgpu::Backends>,
    /// Use `shader-f16` when the adapter has it (native f16 weight kernels).
    pub allow_shader_f16: bool,
    /// Use subgroup operations when the adapter has them.
    pub allow_subgroups: bool,
    /// Use cooperative matrices (tensor cores) when the adapter has a 16 x 16 x 16 or
    /// 8 x 8 x 8 f16 configuration with f32 accumulators (wgpu's experimental feature;
    /// native only).
    pub allow_cooperative_matrix: bool,
    /// Side of the `coop` matmul's fragments (8 or 16) instead of the adapter's best, where
    /// cooperative matrices are on at all. For tests: lavapipe lowers cooperative matrices
    /// generically and computes 16 x 16 fragments correctly although it reports only
    /// 8 x 8 x 8, which runs the very tile arithmetic an NVIDIA GPU runs. Outside what the
    /// adapter reports the result is up to the driver; never set it for real work.
    pub cooperative_fragment: Option<u32>,
    /// Cap on the largest storage binding the kernels may use, below the device's own limit.
    /// Tests set it tiny to force the chunked-weight path.
    pub max_binding_bytes: Option<u64>,
    /// Cap on workgroup memory per workgroup, below the device's own limit; the device is
    /// created with it and kernels size their tiles by it. Tests set the browser's 16 KiB
    /// to run the kernel variants a browser gets.
    pub max_workgroup_storage_bytes: Option<u32>,
    /// Most storage-buffer bytes the runtime may hold on the device at once; an allocation
    /// past it is refused with an error naming what it was for (`None`: no budget).
    pub memory_budget: Option<u64>,
    /// Keep wgpu's runtime bounds checks in the kernels. Natively they may be turned off:
    /// every index of `shaders/` is clamped in range by construction and the host checks
    /// each dispatch's parameters against its buffers. A browser always checks.
    pub runtime_checks: bool,
}

impl Default for ContextOptions {
    fn default() -> Self {
        Self {
            backends: None,
            allow_shader_f16: true,
            allow_subgroups: true,
            allow_cooperative_matrix: true,
            cooperative_fragment: None,
            max_binding_bytes: None,
            max_workgroup_storage_bytes: None,
            memory_budget: None,
            runtime_checks: true,
        }
    }
}

/// Parses a backend name as given on a command line or in `WGPU_BACKEND`.
pub fn parse_backend(name: &str) -> Result<wgpu::Backends> {
    match name.to_ascii_lowercase().as_str() {
        "vulkan" | "vk" => Ok(wgpu::Backends::VULKAN),
        "metal" | "mtl" => Ok(wgpu::Backends::METAL),
        "dx12" | "d3d12" => Ok(wgpu::Backends::DX12),
        "gl" | "gles" | "opengl" => Ok(wgpu::Backends::GL),
        "webgpu" | "browser" => Ok(wgpu::Backends::BROWSER_WEBGPU),
        "all" | "auto" => Ok(wgpu::Backends::all()),
        other => Err(GpuError::UnknownBackend(other.to_string())),
    }
}

/// What kind of adapter runs the kernels: the one rule every kernel choice reads for "is
/// this a hardware GPU".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterClass {
    /// A discrete, integrated or virtual (passed-through) GPU.
    Gpu,
    /// A CPU rasterizer: lavapipe, llvmpipe, WARP, SwiftShader where it says so.
    Software,
    /// The adapter does not say (browsers hide the device behind WebGPU).
    Unknown,
}

impl AdapterClass {
    pub fn of(device: wgpu::DeviceType) -> Self {
        match device {
            wgpu::DeviceType::DiscreteGpu
            | wgpu::DeviceType::IntegratedGpu
            | wgpu::DeviceType::VirtualGpu => Self::Gpu,
            wgpu::DeviceType::Cpu => Self::Software,
            wgpu::DeviceType::Other => Self::Unknown,
        }
    }
}

/// What the kernels may rely on, decided once at device creation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelFeatures {
    pub adapter: AdapterClass,
    pub shader_f16: bool,
    pub subgroups: bool,
    pub subgroup_min_size: u32,
    pub subgroup_max_size: u32,
    /// Cooperative matrices are enabled: the adapter multiplies square f16 fragments into
    /// f32 accumulators per subgroup, and its subgroup size is fixed (the `coop` matmul
    /// splits its tile by subgroup).
    pub cooperative_matrix: bool,
    /// Side of the fragments the `coop` matmul multiplies: 16 where the adapter offers
    /// 16 x 16 x 16 (NVIDIA's tensor cores), else 8 (8 x 8 x 8, e.g. lavapipe); 0 when
    /// cooperative matrices are off.
    pub cooperative_fragment: u32,
    /// Every cooperative-matrix configuration the adapter reports, enabled or not (for
    /// `unmask info`).
    pub cooperative_configs: Vec<wgpu::CooperativeMatrixProperties>,
    /// Largest storage buffer binding a kernel may use, in bytes.
    pub max_binding_bytes: u64,
    pub max_buffer_bytes: u64,
    pub max_workgroup_invocations: u32,
    pub max_workgroups_per_dim: u32,
    /// Workgroup memory a kernel may use, in bytes: the adapter's limit natively, 16 KiB
    /// in a browser (the portable WebGPU default, whatever the adapter reports).
    pub max_workgroup_storage_bytes: u32,
}

/// Bytes of storage buffers alive on the device (weights, activations, KV arenas, prefix
/// entries), and the most ever alive at once.
#[derive(Debug, Default)]
pub struct MemoryCounter {
    live: AtomicU64,
    peak: AtomicU64,
    budget: Option<u64>,
}

impl MemoryCounter {
    pub(crate) fn new(budget: Option<u64>) -> Self {
        Self {
            budget,
            ..Self::default()
        }
    }

    /// Counts `bytes` for `what`, or refuses them when they would pass the budget.
    pub(crate) fn allocate(&self, what: &str, bytes: u64) -> Result<()> {
        let mut live = self.live.load(Ordering::Relaxed);
        loop {
            let after = live.saturating_add(bytes);
            if let Some(budget) = self.budget.filter(|&b| after > b) {
                return Err(GpuError::OverBudget {
                    what: what.to_string(),
                    needed: bytes,
                    live,
                    budget,
                });
            }
            match self
                .live
                .compare_exchange_weak(live, after, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.peak.fetch_max(after, Ordering::Relaxed);
                    return Ok(());
                }
                Err(now) => live = now,
            }
        }
    }

    /// The budget, when there is one.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Bytes that may still be allocated under the budget (`None`: no budget).
    pub fn headroom(&self) -> Option<u64> {
        self.budget.map(|b| b.saturating_sub(self.live_bytes()))
    }

    pub(crate) fn release(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub fn live_bytes(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    pub fn peak_bytes(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Starts a new peak measurement from what is alive now.
    pub fn reset_peak(&self) {
        self.peak.store(self.live_bytes(), Ordering::Relaxed);
    }
}

/// Faults the device reports outside any call: a lost device, and errors no error scope
/// caught (wgpu's default handler would panic on them).
#[derive(Default)]
pub struct DeviceFaults {
    lost: Mutex<Option<String>>,
    uncaptured: Mutex<Option<String>>,
}

impl DeviceFaults {
    fn record(slot: &Mutex<Option<String>>, message: String) {
        let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
        // The first fault explains the ones after it.
        if slot.is_none() {
            *slot = Some(message);
        }
    }

    /// Why the device was lost, once it has been.
    pub fn lost(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The device, its queue and everything derived from the adapter.
pub struct GpuContext {
    /// Storage-buffer bytes alive on the device.
    pub memory: Arc<MemoryCounter>,
    pub faults: Arc<DeviceFaults>,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub features: KernelFeatures,
    pub limits: wgpu::Limits,
    /// Submits, dispatches and what the host created on the device.
    pub host: HostCounters,
    /// Whether kernels keep wgpu's runtime bounds checks (`ContextOptions::runtime_checks`).
    pub runtime_checks: bool,
    pub(crate) pipelines: PipelineCache,
    pub(crate) params: crate::step::ParamArena,
    pub(crate) bind_groups: BindGroupCache,
    pub(crate) readback: ReadbackRing,
    pub(crate) trace: TraceState,
}

/// The fragment side the `coop` matmul can use among an adapter's configurations: square
/// f16 inputs with f32 accumulators, 16 x 16 x 16 preferred (more work per instruction),
/// else 8 x 8 x 8.
pub fn coop_fragment(configs: &[wgpu::CooperativeMatrixProperties]) -> Option<u32> {
    [16, 8].into_iter().find(|&side| {
        configs.iter().any(|c| {
            (c.m_size, c.n_size, c.k_size) == (side, side, side)
                && c.ab_type == wgpu::CooperativeScalarType::F16
                && c.cr_type == wgpu::CooperativeScalarType::F32
        })
    })
}

#[cfg(not(target_arch = "wasm32"))]
fn adapter_rank(info: &wgpu::AdapterInfo) -> (u8, u8) {
    let device = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    // GL is the fallback of last resort: no f16, no subgroups, fewer bindings.
    let backend = match info.backend {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        wgpu::Backend::BrowserWebGpu => 1,
        _ => 2,
    };
    (device, backend)
}

impl GpuContext {
    /// Blocking constructor for native targets.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new(options: &ContextOptions) -> Result<Arc<Self>> {
        pollster::block_on(Self::new_async(options))
    }

    pub async fn new_async(options: &ContextOptions) -> Result<Arc<Self>> {
        let backends = match options.backends {
            Some(b) => b,
            None => wgpu::Backends::from_env().unwrap_or(wgpu::Backends::all()),
        };
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = backends;
        // wgpu's debugging flags: on in debug builds (the Vulkan validation layers when
        // installed, shader debug info), overridden by `WGPU_VALIDATION`, `WGPU_DEBUG` and
        // the other `WGPU_*` flag variables (scripts/test-validation.sh sets `WGPU_DEBUG=0`).
        desc.flags = wgpu::InstanceFlags::from_env_or_default();
        let instance = wgpu::Instance::new(desc);
        let adapter = Self::pick_adapter(&instance, backends).await?;
        Self::from_adapter(adapter, options).await
    }

    #[cfg(not(target_arch = "wasm32"))]
    async fn pick_adapter(
        instance: &wgpu::Instance,
        backends: wgpu::Backends,
    ) -> Result<wgpu::Adapter> {
        let mut adapters = instance.enumerate_adapters(backends).await;
        adapters.sort_by_key(|a| adapter_rank(&a.get_info()));
        adapters
            .into_iter()
            .next()
            .ok_or_else(|| GpuError::NoAdapter {
                backends: format!("{backends:?}"),
            })
    }

    #[cfg(target_arch = "wasm32")]
    async fn pick_adapter(
        instance: &wgpu::Instance,
        backends: wgpu::Backends,
    ) -> Result<wgpu::Adapter> {
        instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|_| GpuError::NoAdapter {
                backends: format!("{backends:?}"),
            })
    }

    pub async fn from_adapter(
        adapter: wgpu::Adapter,
        options: &ContextOptions,
    ) -> Result<Arc<Self>> {
        if let Some(side) = options.cooperative_fragment
            && side != 8
            && side != 16
        {
            return Err(GpuError::Shape {
                op: "ContextOptions::cooperative_fragment",
                expected: "8 or 16".into(),
                found: side.to_string(),
            });
        }
        let info = adapter.get_info();
        let available = adapter.features();
        let mut required = wgpu::Features::empty();
        let shader_f16 = options.allow_shader_f16 && available.contains(wgpu::Features::SHADER_F16);
        if shader_f16 {
            required |= wgpu::Features::SHADER_F16;
        }
        let subgroups = options.allow_subgroups && available.contains(wgpu::Features::SUBGROUP);
        if subgroups {
            required |= wgpu::Features::SUBGROUP;
        }
        let cooperative_configs = adapter.cooperative_matrix_properties();
        let cooperative_matrix = options.allow_cooperative_matrix
            && shader_f16
            && subgroups
            && available.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
            && info.subgroup_min_size == info.subgroup_max_size
            && coop_fragment(&cooperative_configs).is_some();
        if cooperative_matrix {
            required |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        // Only `unmask trace` and benchmarks time dispatches; asking costs nothing.
        if available.contains(wgpu::Features::TIMESTAMP_QUERY) {
            required |= wgpu::Features::TIMESTAMP_QUERY;
        }
        let mut limits = adapter.limits();
        if let Some(cap) = options.max_workgroup_storage_bytes {
            limits.max_compute_workgroup_storage_size =
                limits.max_compute_workgroup_storage_size.min(cap);
        }
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("unmask"),
                required_features: required,
                required_limits: limits.clone(),
                experimental_features: if cooperative_matrix {
                    // SAFETY: the only experimental feature asked for is cooperative
                    // matrices, used by the `coop` matmul alone, which the kernel tests
                    // check against the CPU oracle on every adapter that has them.
                    unsafe { wgpu::ExperimentalFeatures::enabled() }
                } else {
                    wgpu::ExperimentalFeatures::disabled()
                },
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|source| GpuError::RequestDevice {
                adapter: info.name.clone(),
                source,
            })?;
        let device_binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        let max_binding_bytes = match options.max_binding_bytes {
            Some(cap) => cap.min(device_binding),
            None => device_binding,
        };
        let features = KernelFeatures {
            adapter: AdapterClass::of(info.device_type),
            shader_f16,
            subgroups,
            subgroup_min_size: info.subgroup_min_size,
            subgroup_max_size: info.subgroup_max_size,
            cooperative_matrix,
            cooperative_fragment: match (cooperative_matrix, options.cooperative_fragment) {
                (false, _) => 0,
                (true, Some(forced)) => forced,
                (true, None) => coop_fragment(&cooperative_configs).unwrap_or(0),
            },
            cooperative_configs,
            max_binding_bytes,
            max_buffer_bytes: limits.max_buffer_size,
            max_workgroup_invocations: limits.max_compute_invocations_per_workgroup,
            max_workgroups_per_dim: limits.max_compute_workgroups_per_dimension,
            max_workgroup_storage_bytes: {
                let browser =
                    cfg!(target_arch = "wasm32") || info.backend == wgpu::Backend::BrowserWebGpu;
                let cap = options
                    .max_workgroup_storage_bytes
                    .or(browser.then_some(16 * 1024))
                    .unwrap_or(u32::MAX);
                limits.max_compute_workgroup_storage_size.min(cap)
            },
        };
        let faults = Arc::new(DeviceFaults::default());
        {
            let faults = faults.clone();
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                DeviceFaults::record(&faults.uncaptured, e.to_string())
            }));
        }
        {
            let faults = faults.clone();
            device.set_device_lost_callback(move |reason, message| {
                DeviceFaults::record(&faults.lost, format!("{reason:?}: {message}"))
            });
        }
        let params = crate::step::ParamArena::new(limits.min_uniform_buffer_offset_alignment);
        Ok(Arc::new(Self {
            memory: Arc::new(MemoryCounter::new(options.memory_budget)),
            faults,
            device,
            queue,
            info,
            features,
            limits,
            host: HostCounters::default(),
            runtime_checks: options.runtime_checks || cfg!(target_arch = "wasm32"),
            pipelines: PipelineCache::default(),
            params,
            bind_groups: BindGroupCache::default(),
            readback: ReadbackRing::default(),
            trace: TraceState::default(),
        }))
    }

    /// Bind groups cached now (for tests of the cache's lifetime rules).
    pub fn cached_bind_groups(&self) -> usize {
        self.bind_groups.len()
    }

    /// One line for logs and `--json` output: adapter, backend, driver and the features in use.
    pub fn describe(&self) -> String {
        format!(
            "adapter=\"{}\" backend={:?} type={:?} driver=\"{} {}\" shader_f16={} subgroups={} max_binding={} MiB",
            self.info.name,
            self.info.backend,
            self.info.device_type,
            self.info.driver,
            self.info.driver_info,
            self.features.shader_f16,
            self.features.subgroups,
            self.features.max_binding_bytes >> 20
        )
    }

    /// Runs `create` inside an out-of-memory error scope. Natively wgpu settles the scope
    /// when it is popped, so an allocation the device cannot back comes back here as
    /// `Err(message)` instead of reaching the uncaptured-error handler. A browser answers
    /// later; there no scope is pushed and the handler records the error for
    /// `check_faults`, which every read-back calls.
    pub(crate) fn scoped_allocation<T>(
        &self,
        create: impl FnOnce() -> T,
    ) -> std::result::Result<T, String> {
        #[cfg(not(target_arch = "wasm32"))]
        {
            use std::future::Future;
            let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
            let value = create();
            let mut popped = std::pin::pin!(scope.pop());
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            match popped.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(Some(error)) => Err(error.to_string()),
                _ => Ok(value),
            }
        }
        #[cfg(target_arch = "wasm32")]
        Ok(create())
    }

    /// The first fault the device reported since the last check, as an error: a lost
    /// device (every later call fails the same way) or an error no scope caught (once).
    pub fn check_faults(&self) -> Result<()> {
        if let Some(reason) = self.faults.lost() {
            return Err(GpuError::DeviceLost(reason));
        }
        let uncaptured = self
            .faults
            .uncaptured
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match uncaptured {
            Some(message) => Err(GpuError::Validation {
                context: "the device (an error outside any call)".into(),
                message,
            }),
            None => Ok(()),
        }
    }

    /// Blocks until all submitted work has finished (native only; a no-op in browsers).
    pub fn wait_idle(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| GpuError::Validation {
                context: "device poll".into(),
                message: e.to_string(),
            })
    }
}
