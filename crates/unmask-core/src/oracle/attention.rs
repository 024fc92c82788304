//! Multi-head attention over two key/value segments, in f64: bidirectional (LLaDA), or
//! causal with an optional sliding window and a free scale (DiffusionGemma's encoder and
//! commit passes).

/// One key/value segment: `(k, v, len)`, rows `[len, n_kv_heads * head_dim]`, row-major.
pub type Segment<'a> = (&'a [f32], &'a [f32], usize);

/// Which keys a query row sees. Keys are numbered through segment A's rows, then segment
/// B's; query row `i` sits at key index `query_start + i`. Without `causal` every row sees
/// every key; with it row `i` sees key `j` iff `j <= query_start + i` and, when `window > 0`,
/// `j > query_start + i - window` (`window` keys including its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mask {
    pub causal: bool,
    pub window: usize,
    pub query_start: usize,
}

impl Mask {
    /// Whether the row at key index `pos` sees key `j`.
    pub fn sees(&self, pos: usize, j: usize) -> bool {
        !self.causal || (j <= pos && (self.window == 0 || pos - j < self.window))
    }
}

/// Attention of `m` query rows over every key of `seg_a` (if any) followed by every key of
/// `seg_b`; no mask, scale `1/sqrt(head_dim)`. See `attention_masked`.
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
    attention_masked(
        q,
        q_stride,
        q_col,
        m,
        seg_a,
        seg_b,
        n_heads,
        n_kv_heads,
        head_dim,
        None,
        Mask::default(),
    )
}

/// Attention of `m` query rows over the keys of `seg_a` (if any) then `seg_b` that `mask`
/// lets each row see, scores multiplied by `scale` (`None`: `1/sqrt(head_dim)`). Query
/// head `h` reads kv head `h / (n_heads / n_kv_heads)`; query row `r`, head `h` starts at
/// `q[r * q_stride + q_col + h * head_dim]`. Returns `[m, n_heads * head_dim]`.
///
/// Panics on inconsistent shapes and on a row that sees no key: this is a test reference,
/// not a product path.
#[allow(clippy::too_many_arguments)]
pub fn attention_masked(
    q: &[f32],
    q_stride: usize,
    q_col: usize,
    m: usize,
    seg_a: Option<Segment<'_>>,
    seg_b: Segment<'_>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: Option<f64>,
    mask: Mask,
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
    // (segment, row) of every key, in key-index order.
    let keys: Vec<(usize, usize)> = segments
        .iter()
        .enumerate()
        .flat_map(|(s, (_, _, len))| (0..*len).map(move |j| (s, j)))
        .collect();
    let scale = scale.unwrap_or(1.0 / (head_dim as f64).sqrt());
    let mut out = vec![0f32; m * n_heads * head_dim];
    for r in 0..m {
        let pos = mask.query_start + r;
        let seen: Vec<(usize, usize)> = keys
            .iter()
            .enumerate()
            .filter(|&(j, _)| mask.sees(pos, j))
            .map(|(_, &key)| key)
            .collect();
        assert!(!seen.is_empty(), "row {r} (key index {pos}) sees no key");
        for h in 0..n_heads {
            let col = (h / group) * head_dim;
            let qv = &q[r * q_stride + q_col + h * head_dim..][..head_dim];
            let scores: Vec<f64> = seen
                .iter()
                .map(|&(s, j)| {
                    let kr = &segments[s].0[j * kv_stride + col..][..head_dim];
                    let dot: f64 = qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    dot * scale
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            let mut acc = vec![0f64; head_dim];
            for (w, &(s, j)) in weights.iter().zip(&seen) {
                let vr = &segments[s].1[j * kv_stride + col..][..head_dim];
                for (a, x) in acc.iter_mut().zip(vr) {
                    *a += w * *x as f64;
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

    /// Four one-dim keys 0..3 with values 1, 2, 4, 8 and zero queries (uniform weights over
    /// what each row sees): the output is the mean of the visible values.
    fn means(m: usize, mask: Mask) -> Vec<f32> {
        let q = vec![0f32; m];
        let (ka, va) = ([0f32; 2], [1f32, 2.0]);
        let (kb, vb) = ([0f32; 2], [4f32, 8.0]);
        attention_masked(
            &q,
            1,
            0,
            m,
            Some((&ka, &va, 2)),
            (&kb, &vb, 2),
            1,
            1,
            1,
            None,
            mask,
        )
    }

    #[test]
    fn causal_rows_see_keys_up_to_their_own() {
        let causal = Mask {
            causal: true,
            ..Mask::default()
        };
        assert_eq!(means(4, causal), vec![1.0, 1.5, 7.0 / 3.0, 3.75]);
        // Two rows at key indices 2 and 3 (a commit pass: A cached, B new).
        let commit = Mask {
            query_start: 2,
            ..causal
        };
        assert_eq!(means(2, commit), vec![7.0 / 3.0, 3.75]);
        // Without a mask every row sees all four.
        assert_eq!(means(2, Mask::default()), vec![3.75, 3.75]);
    }

    #[test]
    fn windows_keep_the_last_keys() {
        let window = |window| Mask {
            causal: true,
            window,
            query_start: 0,
        };
        // Window 2: each row and the one before it; window 1: the row's own key only.
        assert_eq!(means(4, window(2)), vec![1.0, 1.5, 3.0, 6.0]);
        assert_eq!(means(4, window(1)), vec![1.0, 2.0, 4.0, 8.0]);
        // A window wider than the keys changes nothing.
        assert_eq!(means(4, window(9)), means(4, window(0)));
        let commit = Mask {
            query_start: 2,
            ..window(2)
        };
        assert_eq!(means(2, commit), vec![3.0, 6.0]);
    }

    #[test]
    fn scale_multiplies_the_scores() {
        // Two keys with scores q·k = 1 and 0: weights e^s / (e^s + 1) at scale s.
        let q = [1.0f32];
        let (k, v) = ([1.0f32, 0.0], [1.0f32, 0.0]);
        for scale in [1.0, 0.25, 3.0] {
            let out = attention_masked(
                &q,
                1,
                0,
                1,
                None,
                (&k, &v, 2),
                1,
                1,
                1,
                Some(scale),
                Mask::default(),
            );
            let want = scale.exp() / (scale.exp() + 1.0);
            assert!(
                (out[0] as f64 - want).abs() < 1e-7,
                "scale {scale}: {out:?}"
            );
        }
        // Head dim 1: the default is 1/sqrt(1) = 1.
        let default = attention(&q, 1, 0, 1, None, (&k, &v, 2), 1, 1, 1);
        let e = std::f64::consts::E;
        assert!((default[0] as f64 - e / (e + 1.0)).abs() < 1e-7);
    }

    #[test]
    #[should_panic(expected = "sees no key")]
    fn a_row_past_the_keys_with_a_window_panics() {
        // Row at key index 5 with window 1 would see key 5, which does not exist.
        means(
            1,
            Mask {
                causal: true,
                window: 1,
                query_start: 5,
            },
        );
    }
}
