//! The kernel library. Each module records dispatches of one kernel family into a
//! `StepEncoder`; `all_variants` lists every shader variant the runtime can build, so a
//! test can validate and translate each one without a GPU.

pub mod acache;
pub mod activation;
pub mod alternatives;
pub mod attention;
pub mod cross_entropy;
pub mod denoise;
pub mod elementwise;
pub mod heads;
mod kernels;
pub mod logit_bias;
pub mod matmul;
pub mod moe;
pub mod sampling;
pub mod soft_embed;
#[cfg(feature = "unfused-kernels")]
pub mod unfused;
pub mod v_verify;

pub use kernels::{KernelOptions, Kernels};

use crate::pipeline::{KernelSource, Spec};

/// The host side of a kernel's uniform `Params`: its size and each field's byte offset,
/// checked against the WGSL struct by the test below.
#[cfg(test)]
pub(crate) struct HostParams {
    /// (kernel file, entry point) the struct feeds.
    pub kernel: &'static str,
    pub entry: &'static str,
    pub size: usize,
    pub fields: Vec<(&'static str, usize)>,
}

/// `host_params!("kernel", "entry", Type { field, ... })`: a `HostParams` from the type.
#[cfg(test)]
macro_rules! host_params {
    ($kernel:literal, $entry:literal, $ty:ident { $($field:ident),* $(,)? }) => {
        crate::ops::HostParams {
            kernel: $kernel,
            entry: $entry,
            size: std::mem::size_of::<$ty>(),
            fields: vec![$((stringify!($field), std::mem::offset_of!($ty, $field))),*],
        }
    };
}
#[cfg(test)]
pub(crate) use host_params;

/// One buildable (kernel file, entry point, specialisation).
#[derive(Clone, Debug)]
pub struct ShaderVariant {
    pub kernel: KernelSource,
    pub entry: &'static str,
    pub spec: Spec,
}

/// Each kernel module's list of what it builds, with the uniforms it fills (its host side,
/// checked against the WGSL structs by the test below).
#[derive(Clone, Copy)]
struct KernelModule {
    variants: fn() -> Vec<ShaderVariant>,
    #[cfg(test)]
    host_params: fn() -> Vec<HostParams>,
}

macro_rules! kernel_module {
    ($m:ident) => {
        KernelModule {
            variants: $m::variants,
            #[cfg(test)]
            host_params: $m::host_params,
        }
    };
}

fn modules() -> Vec<KernelModule> {
    let v = vec![
        kernel_module!(elementwise),
        kernel_module!(matmul),
        kernel_module!(attention),
        kernel_module!(sampling),
        kernel_module!(alternatives),
        kernel_module!(logit_bias),
        kernel_module!(cross_entropy),
        kernel_module!(acache),
        kernel_module!(v_verify),
        kernel_module!(moe),
        kernel_module!(activation),
        kernel_module!(heads),
        kernel_module!(soft_embed),
        kernel_module!(denoise),
    ];
    #[cfg(feature = "unfused-kernels")]
    let v = [v, vec![kernel_module!(unfused)]].concat();
    v
}

pub fn all_variants() -> Vec<ShaderVariant> {
    modules().iter().flat_map(|m| (m.variants)()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_params() -> Vec<HostParams> {
        modules().iter().flat_map(|m| (m.host_params)()).collect()
    }

    /// Every variant's uniform `p` against the Rust struct the host writes into it: the same
    /// size, and each named WGSL member at the offset of the Rust field of that name. A field
    /// added on one side only, or reordered, shows here instead of as wrong numbers on a GPU.
    #[test]
    fn host_and_wgsl_parameter_layouts_agree() {
        let hosts = host_params();
        let mut checked = 0;
        for v in all_variants() {
            let wgsl = crate::pipeline::render(&v.kernel, &v.spec).unwrap();
            let module = naga::front::wgsl::parse_str(&wgsl)
                .unwrap_or_else(|e| panic!("{} {}: {e}", v.kernel.name, v.spec.key()));
            let mut layouter = naga::proc::Layouter::default();
            layouter.update(module.to_ctx()).unwrap();
            let Some((_, p)) = module.global_variables.iter().find(|(_, g)| {
                g.space == naga::AddressSpace::Uniform && g.name.as_deref() == Some("p")
            }) else {
                continue;
            };
            let naga::TypeInner::Struct { members, span } = &module.types[p.ty].inner else {
                panic!("{}: `p` is not a struct", v.kernel.name);
            };
            let what = format!("{}:{} ({})", v.kernel.name, v.entry, v.spec.key());
            let host = hosts
                .iter()
                .find(|h| h.kernel == v.kernel.name && (h.entry == v.entry || h.entry == "*"))
                .unwrap_or_else(|| panic!("{what}: no host Params registered"));
            assert_eq!(host.size, *span as usize, "{what}: struct size");
            for m in members {
                let name = m.name.as_deref().unwrap_or("");
                if name.starts_with('_') {
                    continue;
                }
                let at = host
                    .fields
                    .iter()
                    .find(|(f, _)| *f == name)
                    .map(|&(_, o)| o);
                assert_eq!(at, Some(m.offset as usize), "{what}: member {name}");
            }
            let named = members
                .iter()
                .filter(|m| !m.name.as_deref().unwrap_or("_").starts_with('_'))
                .count();
            let host_named = host
                .fields
                .iter()
                .filter(|(f, _)| !f.starts_with('_'))
                .count();
            assert_eq!(named, host_named, "{what}: fields on one side only");
            checked += 1;
        }
        eprintln!("[layout] {checked} shader variants: uniform Params agree with the host structs");
        assert!(checked >= 20, "only {checked} variants have a uniform p");
    }
}
