//! Compute pipelines built from the WGSL files in `shaders/`, cached by
//! (kernel, entry point, specialisation).
//!
//! A kernel file may hold variants selected by a tiny preprocessor:
//! `//#if FLAG`, `//#if !FLAG`, `//#else`, `//#endif` (nestable) keep or drop lines,
//! and `{{NAME}}` is replaced by a specialisation constant. The flag `F16` also puts
//! `enable f16;` at the top. Everything else is plain WGSL.

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

/// Expands the preprocessor directives of `source` for `spec`.
pub fn render(kernel: &KernelSource, spec: &Spec) -> Result<String> {
    let fail = |message: String| GpuError::Shader {
        kernel: kernel.name,
        entry: "*",
        spec: spec.key(),
        message,
    };
    let mut out = String::with_capacity(kernel.source.len() + 64);
    if spec.has("F16") {
        out.push_str("enable f16;\n");
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

type Key = (&'static str, &'static str, String);

#[derive(Default)]
pub(crate) struct PipelineCache {
    map: Mutex<HashMap<Key, Arc<wgpu::ComputePipeline>>>,
}

impl GpuContext {
    /// The pipeline for `entry` of `kernel` specialised by `spec`, compiled on first use.
    pub fn pipeline(
        &self,
        kernel: &KernelSource,
        entry: &'static str,
        spec: &Spec,
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        let key = (kernel.name, entry, spec.key());
        if let Some(p) = self
            .pipelines
            .map
            .lock()
            .expect("pipeline cache poisoned")
            .get(&key)
        {
            return Ok(p.clone());
        }
        let source = render(kernel, spec)?;
        let label = format!("{}:{}[{}]", kernel.name, entry, key.2);
        let pipeline = self.capture_errors(&label, || {
            let module = self
                .device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(&label),
                    source: wgpu::ShaderSource::Wgsl(source.as_str().into()),
                });
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&label),
                    layout: None,
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: wgpu::PipelineCompilationOptions::default(),
                    cache: None,
                })
        });
        let pipeline = pipeline.map_err(|e| GpuError::Shader {
            kernel: kernel.name,
            entry,
            spec: spec.key(),
            message: e.to_string(),
        })?;
        let pipeline = Arc::new(pipeline);
        self.pipelines
            .map
            .lock()
            .expect("pipeline cache poisoned")
            .insert(key, pipeline.clone());
        Ok(pipeline)
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
