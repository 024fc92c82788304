//! Every specialisation of `shaders/matmul.wgsl` (with the kernels appended to it) and
//! `shaders/matmul_split.wgsl` the matmul can dispatch, for the shader checks (naga,
//! spirv-val, the browser's limits).

use super::{CoopShape, FUSIONS, KERNEL, MatmulKernel, SPLIT_REDUCE, spec};
use crate::ops::ShaderVariant;
use crate::pipeline::Spec;
use crate::tensor::WeightFormat;

/// Every (entry, spec) `matmul` can dispatch.
pub fn variants() -> Vec<ShaderVariant> {
    let mut out = Vec::new();
    for kernel in MatmulKernel::CONCRETE {
        for format in WeightFormat::ALL {
            // `NarrowDot` reads quantized weights only (`plan` runs `Narrow` for the others).
            if kernel == MatmulKernel::NarrowDot && format.quant().is_none() {
                continue;
            }
            let x_vec4_options: &[bool] = if kernel == MatmulKernel::Naive {
                &[false]
            } else {
                &[false, true]
            };
            // Either k-tile depth of `Gemm`, as the device's workgroup memory decides.
            let bk16_options: &[bool] = match kernel {
                MatmulKernel::Gemm | MatmulKernel::GemmF16 => &[false, true],
                _ => &[false],
            };
            // `Coop` at an NVIDIA GPU's subgroup size and fragments, either tile depth, and
            // at lavapipe's (8 wide subgroups, 8 x 8 fragments).
            let shape = |subgroup, fragment, k_depth| CoopShape {
                subgroup,
                fragment,
                k_depth,
            };
            let coop_options: &[CoopShape] = match kernel {
                MatmulKernel::Coop | MatmulKernel::CoopSplit => {
                    &[shape(32, 16, 32), shape(32, 16, 16), shape(8, 8, 32)]
                }
                _ => &[shape(0, 0, 0)],
            };
            for &x_vec4 in x_vec4_options {
                for (&bk16, &coop) in bk16_options
                    .iter()
                    .flat_map(|b| coop_options.iter().map(move |c| (b, c)))
                {
                    for (norm, residual, swiglu) in FUSIONS {
                        // The split pass leaves the residual add to the second pass.
                        if kernel == MatmulKernel::CoopSplit && residual {
                            continue;
                        }
                        // `Coop`'s tiles of 4 or (TM2, for few rows) 2 fragment rows.
                        let halves: &[bool] = if coop.fragment > 0 {
                            &[false, true]
                        } else {
                            &[false]
                        };
                        for &half in halves {
                            let spec = spec(kernel, format, x_vec4, swiglu, bk16, coop)
                                .flag_if(norm, "NORM")
                                .flag_if(residual, "RESIDUAL")
                                .flag_if(swiglu, "SWIGLU")
                                .flag_if(half, "TM2");
                            out.push(ShaderVariant {
                                kernel: KERNEL,
                                entry: kernel.entry(),
                                spec,
                            });
                        }
                    }
                }
            }
        }
    }
    for residual in [false, true] {
        for swiglu in [false, true] {
            out.push(ShaderVariant {
                kernel: SPLIT_REDUCE,
                entry: "main",
                spec: Spec::new()
                    .flag_if(residual, "RESIDUAL")
                    .flag_if(swiglu, "SWIGLU"),
            });
        }
    }
    out
}
