//! The row-wise kernels' uniforms as the host lays them out (checked against the WGSL
//! structs by `host_and_wgsl_parameter_layouts_agree`).

use super::{AddParams, CopyParams, EmbedParams, NormParams, PackParams, RopeQkvParams};

pub(crate) fn host_params() -> Vec<crate::ops::HostParams> {
    use crate::ops::host_params;
    vec![
        host_params!(
            "embed",
            "main",
            EmbedParams {
                rows,
                cols,
                row_stride,
                row_start,
                chunk_rows,
                s_off
            }
        ),
        host_params!("rmsnorm", "main", NormParams { rows, cols, eps }),
        host_params!("add", "main", AddParams { n }),
        host_params!(
            "pack_f16",
            "main",
            PackParams {
                rows,
                cols,
                src_stride,
                dst_stride,
                dst_row
            }
        ),
        host_params!(
            "copy_rows",
            "*",
            CopyParams {
                rows,
                cols,
                src_stride,
                src_col,
                dst_stride,
                dst_col
            }
        ),
        host_params!(
            "rope_qkv",
            "main",
            RopeQkvParams {
                rows,
                n_heads,
                n_kv_heads,
                head_dim,
                row_stride,
                max_pos
            }
        ),
    ]
}
