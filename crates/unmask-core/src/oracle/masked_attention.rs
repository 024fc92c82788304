//! Attention with a causal mask, a sliding window and a given scale, in f64: the reference of
//! `shaders/attention_masked.wgsl` (DiffusionGemma's encoder, commit and decoder passes).

use super::attention::Segment;

/// Which keys a query row sees (keys indexed over segment A then B; row `r` at
/// `query_start + r`): with `causal`, keys up to its own; with a window W > 0, also only the
/// last W of them.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mask {
    pub causal: bool,
    pub window: usize,
    pub query_start: usize,
}

/// `[m, n_heads · head_dim]`: query row `r`, head `h` at `q[r·q_stride + h·head_dim]` over the
/// visible keys of `seg_a` then `seg_b`, scores times `scale`; query head `h` reads kv head
/// `h / (n_heads / n_kv_heads)`. Panics on inconsistent shapes (a test reference).
#[allow(clippy::too_many_arguments)]
pub fn attention_masked(
    q: &[f32],
    q_stride: usize,
    m: usize,
    seg_a: Option<Segment<'_>>,
    seg_b: Segment<'_>,
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
    mask: Mask,
    scale: f64,
) -> Vec<f32> {
    let group = n_heads / n_kv_heads;
    let w = n_kv_heads * head_dim;
    let keys: Vec<(&[f32], &[f32])> = seg_a
        .into_iter()
        .chain(Some(seg_b))
        .flat_map(|(k, v, len)| {
            (0..len).map(move |j| (&k[j * w..(j + 1) * w], &v[j * w..(j + 1) * w]))
        })
        .collect();
    let mut out = vec![0f32; m * n_heads * head_dim];
    for r in 0..m {
        let pos = mask.query_start + r;
        let visible =
            |j: usize| !mask.causal || (j <= pos && (mask.window == 0 || j + mask.window > pos));
        for h in 0..n_heads {
            let kvh = h / group;
            let qh = &q[r * q_stride + h * head_dim..][..head_dim];
            let scores: Vec<(usize, f64)> = (0..keys.len())
                .filter(|&j| visible(j))
                .map(|j| {
                    let k = &keys[j].0[kvh * head_dim..][..head_dim];
                    let dot: f64 = qh.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum();
                    (j, dot * scale)
                })
                .collect();
            let max = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s.1 - max).exp()).sum();
            for c in 0..head_dim {
                let acc: f64 = scores
                    .iter()
                    .map(|&(j, s)| (s - max).exp() * keys[j].1[kvh * head_dim + c] as f64)
                    .sum();
                out[(r * n_heads + h) * head_dim + c] = (acc / sum) as f32;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_causal_row_with_window_one_returns_its_own_value() {
        // Two keys; row 1 (query_start 0) with window 1 sees only key 1.
        let k = [1.0, 0.0, 0.0, 1.0];
        let v = [3.0, 4.0, 5.0, 6.0];
        let q = [0.0, 0.0, 0.0, 0.0];
        let mask = Mask {
            causal: true,
            window: 1,
            query_start: 0,
        };
        let out = attention_masked(&q, 2, 2, None, (&k, &v, 2), (1, 1, 2), mask, 1.0);
        assert_eq!(&out[2..], &[5.0, 6.0]);
        // Row 0 sees only key 0; without a mask both average.
        assert_eq!(&out[..2], &[3.0, 4.0]);
        let open = attention_masked(&q, 2, 1, None, (&k, &v, 2), (1, 1, 2), Mask::default(), 1.0);
        assert_eq!(open, vec![4.0, 5.0]);
    }
}
