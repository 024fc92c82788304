//! Bidirectional multi-head attention over two key/value segments, in f64.

/// One key/value segment: `(k, v, len)`, rows `[len, n_kv_heads * head_dim]`, row-major.
pub type Segment<'a> = (&'a [f32], &'a [f32], usize);

/// Attention of `m` query rows over every key of `seg_a` (if any) followed by every key of
/// `seg_b`; no mask, scale `1/sqrt(head_dim)`, query head `h` reads kv head
/// `h / (n_heads / n_kv_heads)`. Query row `r`, head `h` starts at
/// `q[r * q_stride + q_col + h * head_dim]`. Returns `[m, n_heads * head_dim]`.
///
/// Panics on inconsistent shapes: this is a test reference, not a product path.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    q_stride: usize,
    q_col: usize,
    m: usize,
    seg_a: Option<Segment<'_>>,
    seg_b: Segment<'_>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Vec<f32> {
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
        "heads {n_heads}/{n_kv_heads}"
    );
    let group = n_heads / n_kv_heads;
    let kv_stride = n_kv_heads * head_dim;
    let segments: Vec<Segment<'_>> = seg_a.into_iter().chain(Some(seg_b)).collect();
    for (k, v, len) in &segments {
        assert!(
            k.len() >= len * kv_stride && v.len() >= len * kv_stride,
            "segment too short"
        );
    }
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut out = vec![0f32; m * n_heads * head_dim];
    let mut scores = Vec::new();
    for r in 0..m {
        for h in 0..n_heads {
            let kvh = h / group;
            let qv = &q[r * q_stride + q_col + h * head_dim..][..head_dim];
            scores.clear();
            for (k, _, len) in &segments {
                for j in 0..*len {
                    let kr = &k[j * kv_stride + kvh * head_dim..][..head_dim];
                    let dot: f64 = qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    scores.push(dot * scale);
                }
            }
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            let mut acc = vec![0f64; head_dim];
            let mut idx = 0;
            for (_, v, len) in &segments {
                for j in 0..*len {
                    let vr = &v[j * kv_stride + kvh * head_dim..][..head_dim];
                    for (a, x) in acc.iter_mut().zip(vr) {
                        *a += weights[idx] * *x as f64;
                    }
                    idx += 1;
                }
            }
            let o = &mut out[r * n_heads * head_dim + h * head_dim..][..head_dim];
            for (dst, a) in o.iter_mut().zip(&acc) {
                *dst = (a / total) as f32;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value() {
        let q = [0.3f32, -1.0, 2.0, 0.5];
        let k = [1.0f32, 2.0, 3.0, 4.0];
        let v = [5.0f32, 6.0, 7.0, 8.0];
        let out = attention(&q, 4, 0, 1, None, (&k, &v, 1), 2, 1, 2);
        assert_eq!(out, vec![5.0, 6.0, 5.0, 6.0]);
    }

    #[test]
    fn equal_scores_average_values() {
        // Query orthogonal to both keys: uniform weights.
        let q = [0.0f32, 1.0];
        let ka = [1.0f32, 0.0];
        let va = [2.0f32, 4.0];
        let kb = [-1.0f32, 0.0];
        let vb = [4.0f32, 8.0];
        let out = attention(&q, 2, 0, 1, Some((&ka, &va, 1)), (&kb, &vb, 1), 1, 1, 2);
        assert_eq!(out, vec![3.0, 6.0]);
    }
}
