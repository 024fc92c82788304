//! The attention kernels' uniforms, host side (checked against the WGSL structs by
//! `host_and_wgsl_parameter_layouts_agree`).

use bytemuck::{Pod, Zeroable};

/// The fields the register and the wide kernel's uniforms open with, in their order: the
/// query rows, the two K/V segments, the output and the mask, filled in one place
/// (`attention_with`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(super) struct QueryParams {
    pub(super) units: u32,
    pub(super) group: u32,
    pub(super) q_stride: u32,
    pub(super) q_col: u32,
    pub(super) len_a: u32,
    pub(super) len_b: u32,
    pub(super) kv_stride: u32,
    pub(super) out_stride: u32,
    pub(super) unit_blocks: u32,
    pub(super) n_kv_heads: u32,
    pub(super) scale_log2: f32,
    pub(super) row0: u32,
    pub(super) b_row0: u32,
    pub(super) a_row0: u32,
    pub(super) causal: u32,
    pub(super) window: u32,
    pub(super) query_start: u32,
}

/// Uniform of `attention.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(super) struct Params {
    pub(super) q: QueryParams,
    pub(super) _pad0: u32,
    pub(super) _pad1: u32,
    pub(super) _pad2: u32,
}

/// Uniform of `attention_wide.wgsl` (80 bytes: no padding needed).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(super) struct WideParams {
    pub(super) q: QueryParams,
    pub(super) slices: u32,
    pub(super) tiles_per_slice: u32,
    pub(super) hd: u32,
}

/// Uniform of `attention_combine.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(super) struct CombineParams {
    pub(super) units: u32,
    pub(super) group: u32,
    pub(super) n_kv_heads: u32,
    pub(super) slices: u32,
    pub(super) hd: u32,
    pub(super) pitch: u32,
    pub(super) out_stride: u32,
    pub(super) row0: u32,
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<crate::ops::HostParams> {
    use crate::ops::host_params;
    use std::mem::{offset_of, size_of};
    // The shared head's fields, at the offset it sits at in `outer`.
    let query = |outer: usize| {
        let f = |name, offset| (name, outer + offset);
        vec![
            f("units", offset_of!(QueryParams, units)),
            f("group", offset_of!(QueryParams, group)),
            f("q_stride", offset_of!(QueryParams, q_stride)),
            f("q_col", offset_of!(QueryParams, q_col)),
            f("len_a", offset_of!(QueryParams, len_a)),
            f("len_b", offset_of!(QueryParams, len_b)),
            f("kv_stride", offset_of!(QueryParams, kv_stride)),
            f("out_stride", offset_of!(QueryParams, out_stride)),
            f("unit_blocks", offset_of!(QueryParams, unit_blocks)),
            f("n_kv_heads", offset_of!(QueryParams, n_kv_heads)),
            f("scale_log2", offset_of!(QueryParams, scale_log2)),
            f("row0", offset_of!(QueryParams, row0)),
            f("b_row0", offset_of!(QueryParams, b_row0)),
            f("a_row0", offset_of!(QueryParams, a_row0)),
            f("causal", offset_of!(QueryParams, causal)),
            f("window", offset_of!(QueryParams, window)),
            f("query_start", offset_of!(QueryParams, query_start)),
        ]
    };
    let wide = host_params!(
        "attention_wide",
        "*",
        WideParams {
            slices,
            tiles_per_slice,
            hd
        }
    );
    vec![
        crate::ops::HostParams {
            kernel: "attention",
            entry: "*",
            size: size_of::<Params>(),
            fields: query(offset_of!(Params, q)),
        },
        crate::ops::HostParams {
            fields: [query(offset_of!(WideParams, q)), wide.fields].concat(),
            ..wide
        },
        host_params!(
            "attention_combine",
            "*",
            CombineParams {
                units,
                group,
                n_kv_heads,
                slices,
                hd,
                pitch,
                out_stride,
                row0,
            }
        ),
    ]
}
