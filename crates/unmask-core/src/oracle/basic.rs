//! Reference versions of the row-wise kernels.

/// out[r, :] = table[ids[r], :].
pub fn embed(table: &[f32], cols: usize, ids: &[u32]) -> Vec<f32> {
    ids.iter()
        .flat_map(|&id| {
            table[id as usize * cols..(id as usize + 1) * cols]
                .iter()
                .copied()
        })
        .collect()
}

/// RMSNorm with weight, accumulated in f64.
pub fn rms_norm(x: &[f32], weight: &[f32], cols: usize, eps: f32) -> Vec<f32> {
    x.chunks(cols)
        .flat_map(|row| {
            let mean_sq = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (mean_sq + eps as f64).sqrt();
            row.iter()
                .zip(weight)
                .map(move |(&v, &w)| (w as f64 * v as f64 * inv) as f32)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Half-split RoPE ("rotate_half") of `n_heads` heads starting at `col_offset` of each row,
/// angles from the f32 inverse frequencies as in the reference, rotation in f64.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &[f32],
    row_stride: usize,
    col_offset: usize,
    n_heads: usize,
    head_dim: usize,
    positions: &[u32],
    theta: f32,
) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = x.to_vec();
    for (r, &pos) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let base = r * row_stride + col_offset + h * head_dim;
            for j in 0..half {
                let inv_freq = 1.0 / theta.powf((2 * j) as f32 / head_dim as f32);
                let angle = (pos as f32 * inv_freq) as f64;
                let (sin, cos) = angle.sin_cos();
                let x1 = x[base + j] as f64;
                let x2 = x[base + j + half] as f64;
                out[base + j] = (x1 * cos - x2 * sin) as f32;
                out[base + j + half] = (x2 * cos + x1 * sin) as f32;
            }
        }
    }
    out
}

/// silu(gate) * up for a fused `[rows, 2*cols]` input (gate first).
pub fn swiglu(gate_up: &[f32], cols: usize) -> Vec<f32> {
    gate_up
        .chunks(2 * cols)
        .flat_map(|row| {
            (0..cols).map(move |c| {
                let g = row[c] as f64;
                let u = row[cols + c] as f64;
                (g / (1.0 + (-g).exp()) * u) as f32
            })
        })
        .collect()
}

/// Element-wise x + y.
pub fn add(x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(y)
        .map(|(a, b)| (*a as f64 + *b as f64) as f32)
        .collect()
}
