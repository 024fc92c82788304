//! The kernel library. Each module records dispatches of one kernel family into a
//! `StepEncoder`; `all_variants` lists every shader variant the runtime can build, so a
//! test can validate and translate each one without a GPU.

pub mod attention;
pub mod elementwise;
pub mod matmul;
pub mod sampling;

use crate::pipeline::{KernelSource, Spec};

/// One buildable (kernel file, entry point, specialisation).
#[derive(Clone, Debug)]
pub struct ShaderVariant {
    pub kernel: KernelSource,
    pub entry: &'static str,
    pub spec: Spec,
}

pub fn all_variants() -> Vec<ShaderVariant> {
    let mut v = Vec::new();
    v.extend(elementwise::variants());
    v.extend(matmul::variants());
    v.extend(attention::variants());
    v.extend(sampling::variants());
    v
}
