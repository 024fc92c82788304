//! Compute pipelines built from the WGSL files in `shaders/`, cached by
//! (kernel, entry point, specialisation).
//!
//! A kernel file may hold variants selected by a tiny preprocessor:
//! `//#if FLAG`, `//#if !FLAG`, `//#else`, `//#endif` (nestable) keep or drop lines,
//! and `{{NAME}}` is replaced by a specialisation constant. The flags `F16`, `HALF` and
//! `COOP` also put `enable f16;` at the top, `COOP` `enable wgpu_cooperative_matrix;` too.
//! Everything else is plain WGSL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::context::GpuContext;
use crate::error::{GpuError, Result};

/// One WGSL file of `shaders/`.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    pub name: &'static str,
    pub source: &'static str,
}

/// Flags and constants that pick one variant of a kernel file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Spec {
    flags: Vec<&'static str>,
    consts: Vec<(&'static str, String)>,
}

impl Spec {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn flag(mut self, name: &'static str) -> Self {
        if !self.flags.contains(&name) {
            self.flags.push(name);
            self.flags.sort_unstable();
        }
        self
    }

    pub fn flag_if(self, cond: bool, name: &'static str) -> Self {
        if cond { self.flag(name) } else { self }
    }

    pub fn constant(mut self, name: &'static str, value: impl ToString) -> Self {
        self.consts.retain(|(n, _)| *n != name);
        self.consts.push((name, value.to_string()));
        self.consts.sort_unstable();
        self
    }

    pub fn has(&self, flag: &str) -> bool {
        self.flags.contains(&flag)
    }

    /// Stable text form, used in cache keys and error messages.
    pub fn key(&self) -> String {
        let mut parts: Vec<String> = self.flags.iter().map(|f| f.to_string()).collect();
        parts.extend(self.consts.iter().map(|(n, v)| format!("{n}={v}")));
        parts.join(",")
    }
}

/// Whether a specialisation needs `shader-f16`: `F16` (native f16 storage), `HALF` (f16
/// arithmetic) or `COOP` (f16 cooperative matrices).
pub fn uses_f16(spec: &Spec) -> bool {
    spec.has("F16") || spec.has("HALF") || uses_cooperative_matrix(spec)
}

/// Whether a specialisation needs wgpu's cooperative matrices (`COOP`).
pub fn uses_cooperative_matrix(spec: &Spec) -> bool {
    spec.has("COOP")
}

/// Expands the preprocessor directives of `source` for `spec`.
pub fn render(kernel: &KernelSource, spec: &Spec) -> Result<String> {
    let fail = |message: String| GpuError::Shader {
        kernel: kernel.name,
        entry: "*",
        spec: spec.key(),
        message,
    };
    let mut out = String::with_capacity(kernel.source.len() + 64);
    if uses_f16(spec) {
        out.push_str("enable f16;\n");
    }
    if uses_cooperative_matrix(spec) {
        out.push_str("enable wgpu_cooperative_matrix;\n");
    }
    // Stack of (this branch active, any enclosing branch inactive).
    let mut stack: Vec<(bool, bool)> = Vec::new();
    let active = |stack: &[(bool, bool)]| stack.iter().all(|(on, _)| *on);
    for (lineno, line) in kernel.source.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(cond) = trimmed.strip_prefix("//#if ") {
            let cond = cond.trim();
            let value = match cond.strip_prefix('!') {
                Some(name) => !spec.has(name.trim()),
                None => spec.has(cond),
            };
            stack.push((value, false));
            out.push('\n');
            continue;
        }
        if trimmed.starts_with("//#else") {
            let top = stack
                .last_mut()
                .ok_or_else(|| fail(format!("line {}: #else without #if", lineno + 1)))?;
            top.0 = !top.0;
            out.push('\n');
            continue;
        }
        if trimmed.starts_with("//#endif") {
            stack
                .pop()
                .ok_or_else(|| fail(format!("line {}: #endif without #if", lineno + 1)))?;
            out.push('\n');
            continue;
        }
        if !active(&stack) {
            // Keep line numbers stable for compiler messages.
            out.push('\n');
            continue;
        }
        if line.contains("{{") {
            let mut text = line.to_string();
            for (name, value) in &spec.consts {
                text = text.replace(&format!("{{{{{name}}}}}"), value);
            }
            if let Some(pos) = text.find("{{") {
                return Err(fail(format!(
                    "line {}: no value for constant in `{}`",
                    lineno + 1,
                    &text[pos..]
                )));
            }
            out.push_str(&text);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    if !stack.is_empty() {
        return Err(fail("unterminated //#if".into()));
    }
    Ok(out)
}

/// Kernel file, entry point and specialisation.
type Key = (&'static str, &'static str, Spec);

/// The keys sharing one hash (almost always one) and their kernels.
type Bucket = Vec<(Key, Arc<ComputeKernel>)>;

/// The hash of a key, computed from borrowed parts: a lookup builds no string and clones
/// nothing (it runs for every dispatch).
fn key_hash(kernel: &'static str, entry: &'static str, spec: &Spec) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    kernel.hash(&mut h);
    entry.hash(&mut h);
    spec.hash(&mut h);
    h.finish()
}

/// A compiled kernel variant with its explicit bind group layout: binding 0 is the uniform
/// parameters at a dynamic offset into the step's parameter buffer, bindings 1.. the
/// storage buffers in declaration order. Dispatches carry it, so every dispatch of a step
/// has a name and a variant.
#[derive(Debug)]
pub struct ComputeKernel {
    /// Unique per pipeline (keys of the bind group cache).
    pub(crate) id: u64,
    pub(crate) pipeline: wgpu::ComputePipeline,
    pub(crate) layout: wgpu::BindGroupLayout,
    /// The kernel file (`shaders/<name>.wgsl`).
    pub name: &'static str,
    pub entry: &'static str,
    /// The specialisation (flags and constants), as `Spec::key` writes it.
    pub variant: String,
}

impl ComputeKernel {
    /// `file:entry` — the kernel family a dispatch belongs to.
    pub fn family(&self) -> String {
        format!("{}:{}", self.name, self.entry)
    }
}

/// The storage bindings of group 0 in a rendered kernel, in binding order: `true` where the
/// kernel writes the buffer. Every kernel declares its bindings as
/// `@group(0) @binding(N) var<storage, read|read_write> name: type;`.
fn storage_bindings(source: &str) -> std::result::Result<Vec<bool>, String> {
    let mut out: Vec<(u32, bool)> = Vec::new();
    for line in source.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("@group(0) @binding(") else {
            continue;
        };
        let (num, decl) = rest
            .split_once(')')
            .ok_or_else(|| format!("unreadable binding declaration `{line}`"))?;
        let binding: u32 = num
            .trim()
            .parse()
            .map_err(|_| format!("binding number in `{line}`"))?;
        let decl = decl.trim_start();
        if decl.starts_with("var<uniform>") {
            if binding != 0 {
                return Err(format!("a uniform at binding {binding} (only 0 may be)"));
            }
            continue;
        }
        let writes = if decl.starts_with("var<storage, read_write>") {
            true
        } else if decl.starts_with("var<storage, read>") {
            false
        } else {
            return Err(format!("unsupported binding declaration `{line}`"));
        };
        out.push((binding, writes));
    }
    out.sort_unstable_by_key(|b| b.0);
    for (i, (binding, _)) in out.iter().enumerate() {
        if *binding != i as u32 + 1 {
            return Err(format!(
                "storage bindings must be 1, 2, ... without gaps; found {binding} at place {}",
                i + 1
            ));
        }
    }
    Ok(out.into_iter().map(|(_, w)| w).collect())
}

#[derive(Default)]
pub(crate) struct PipelineCache {
    /// By key hash; a bucket holds the (rare) keys that share one.
    map: Mutex<HashMap<u64, Bucket>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl GpuContext {
    /// The pipeline for `entry` of `kernel` specialised by `spec`, compiled on first use.
    pub fn pipeline(
        &self,
        kernel: &KernelSource,
        entry: &'static str,
        spec: &Spec,
    ) -> Result<Arc<ComputeKernel>> {
        let hash = key_hash(kernel.name, entry, spec);
        let found = self
            .pipelines
            .map
            .lock()
            .expect("pipeline cache poisoned")
            .get(&hash)
            .and_then(|bucket| {
                bucket
                    .iter()
                    .find(|((k, e, s), _)| *k == kernel.name && *e == entry && s == spec)
                    .map(|(_, p)| p.clone())
            });
        if let Some(p) = found {
            return Ok(p);
        }
        let fail = |message: String| GpuError::Shader {
            kernel: kernel.name,
            entry,
            spec: spec.key(),
            message,
        };
        let source = render(kernel, spec)?;
        let storage = storage_bindings(&source).map_err(fail)?;
        let variant = spec.key();
        let label = format!("{}:{}[{variant}]", kernel.name, entry);
        let buffer_entry =
            |binding: u32, ty: wgpu::BufferBindingType, dynamic: bool| wgpu::BindGroupLayoutEntry {
                binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty,
                    has_dynamic_offset: dynamic,
                    min_binding_size: None,
                },
                count: None,
            };
        let mut entries = vec![buffer_entry(0, wgpu::BufferBindingType::Uniform, true)];
        for (i, &writes) in storage.iter().enumerate() {
            entries.push(buffer_entry(
                i as u32 + 1,
                wgpu::BufferBindingType::Storage { read_only: !writes },
                false,
            ));
        }
        let checks = self.runtime_checks;
        let built = self.capture_errors(&label, || {
            let layout = self
                .device
                .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(&label),
                    entries: &entries,
                });
            let pipeline_layout =
                self.device
                    .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                        label: Some(&label),
                        bind_group_layouts: &[Some(&layout)],
                        immediate_size: 0,
                    });
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(&label),
                source: wgpu::ShaderSource::Wgsl(source.as_str().into()),
            };
            let module = if checks {
                self.device.create_shader_module(desc)
            } else {
                // SAFETY: only with `ContextOptions::runtime_checks` off, which callers turn
                // off for kernels whose indices are clamped in range by construction (every
                // load and store of shaders/ is bounded by its Params, which the host checks
                // against the bound buffers' sizes before dispatching).
                unsafe {
                    self.device
                        .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
                }
            };
            let pipeline = self
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&label),
                    layout: Some(&pipeline_layout),
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: wgpu::PipelineCompilationOptions::default(),
                    cache: None,
                });
            (layout, pipeline)
        });
        let (layout, pipeline) = built.map_err(|e| fail(e.to_string()))?;
        let id = self
            .pipelines
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let kernel = Arc::new(ComputeKernel {
            id,
            pipeline,
            layout,
            name: kernel.name,
            entry,
            variant,
        });
        self.pipelines
            .map
            .lock()
            .expect("pipeline cache poisoned")
            .entry(hash)
            .or_default()
            .push(((kernel.name, entry, spec.clone()), kernel.clone()));
        Ok(kernel)
    }

    /// Runs `f` inside a validation error scope and returns the first error it raised.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn capture_errors<T>(&self, context: &str, f: impl FnOnce() -> T) -> Result<T> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = f();
        match pollster::block_on(scope.pop()) {
            None => Ok(value),
            Some(err) => Err(GpuError::Validation {
                context: context.to_string(),
                message: err.to_string(),
            }),
        }
    }

    /// In browsers errors surface asynchronously in the console; nothing to block on here.
    #[cfg(target_arch = "wasm32")]
    pub fn capture_errors<T>(&self, _context: &str, f: impl FnOnce() -> T) -> Result<T> {
        Ok(f())
    }
}
