//! Reference versions of DiffusionGemma's expert FFN and activations
//! (`docs/models/diffusion-gemma.md` §4.5 to §4.7), in f64: one token and one chosen expert at a
//! time, the plain definition the grouped GPU kernels are checked against.

/// `0.5 g (1 + tanh(sqrt(2/π) (g + 0.044715 g³)))` (torch `gelu(approximate="tanh")`).
pub fn gelu_tanh(g: f64) -> f64 {
    let z = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
    0.5 * g * (1.0 + z.tanh())
}

/// `gelu_tanh(gate) ⊙ up` for rows of `[gate (cols) | up (cols)]`: `[rows, 2 cols]` in,
/// `[rows, cols]` out.
pub fn gelu_tanh_gate(gate_up: &[f32], cols: usize) -> Vec<f32> {
    gate_up
        .chunks(2 * cols)
        .flat_map(|row| {
            (0..cols).map(move |c| (gelu_tanh(f64::from(row[c])) * f64::from(row[cols + c])) as f32)
        })
        .collect()
}

/// `cap · tanh(x / cap)` element-wise (final logit soft-capping).
pub fn softcap(x: &[f32], cap: f32) -> Vec<f32> {
    let cap = f64::from(cap);
    x.iter()
        .map(|&v| (cap * (f64::from(v) / cap).tanh()) as f32)
        .collect()
}

/// `x · s` element-wise.
pub fn scale(x: &[f32], s: f32) -> Vec<f32> {
    x.iter()
        .map(|&v| (f64::from(v) * f64::from(s)) as f32)
        .collect()
}

/// The shape of an expert FFN: `hidden` (D) inputs and outputs, `inter` (I) activations per
/// expert, `top_k` (K) experts per token.
#[derive(Clone, Copy, Debug)]
pub struct ExpertDims {
    pub hidden: usize,
    pub inter: usize,
    pub top_k: usize,
}

/// `out[r] = Σ_j w[r, j] · down[e_j] · (gelu_tanh(g) ⊙ u)` with `g‖u = gate_up[e_j] · y[r]`.
///
/// `y` is `[rows, D]`; `ids` and `weights` are `[rows, K]` (expert ids and their weights);
/// `gate_up` is `[E, 2I, D]` (rows `0..I` of an expert its gate, `I..2I` its up projection) and
/// `down` `[E, D, I]`, both row-major. Everything is summed in f64, slot by slot.
pub fn moe_experts(
    y: &[f32],
    ids: &[u32],
    weights: &[f32],
    gate_up: &[f32],
    down: &[f32],
    dims: ExpertDims,
) -> Vec<f32> {
    let ExpertDims {
        hidden: d,
        inter: i,
        top_k: k,
    } = dims;
    let mut out = Vec::with_capacity(y.len());
    for (r, x) in y.chunks(d).enumerate() {
        let mut acc = vec![0f64; d];
        for j in 0..k {
            let e = ids[r * k + j] as usize;
            let w = f64::from(weights[r * k + j]);
            let gu = &gate_up[e * 2 * i * d..(e + 1) * 2 * i * d];
            let dot = |row: &[f32]| -> f64 {
                row.iter()
                    .zip(x)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum()
            };
            let act: Vec<f64> = (0..i)
                .map(|c| {
                    gelu_tanh(dot(&gu[c * d..(c + 1) * d])) * dot(&gu[(i + c) * d..(i + c + 1) * d])
                })
                .collect();
            let dn = &down[e * d * i..(e + 1) * d * i];
            for (o, a) in acc.iter_mut().enumerate() {
                let row = &dn[o * i..(o + 1) * i];
                let s: f64 = row
                    .iter()
                    .zip(&act)
                    .map(|(&wv, av)| f64::from(wv) * av)
                    .sum();
                *a += w * s;
            }
        }
        out.extend(acc.iter().map(|&v| v as f32));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_tanh_matches_known_values() {
        // torch.nn.functional.gelu(x, approximate="tanh") in float64.
        for (x, want) in [
            (0.0, 0.0),
            (1.0, 0.8411919906082768),
            (-1.0, -0.15880800939172324),
            (3.0, 2.996362607918227),
        ] {
            assert!((gelu_tanh(x) - want).abs() < 1e-12, "gelu_tanh({x})");
        }
        // Saturates to the identity and to zero.
        assert_eq!(gelu_tanh(1e4), 1e4);
        assert!(gelu_tanh(-1e4).abs() < 1e-300);
    }

    #[test]
    fn gelu_gate_and_softcap_and_scale() {
        // Two rows of [gate | up] with I = 2.
        let gu = [1.0, 0.0, 2.0, 5.0, -1.0, 3.0, 4.0, -2.0];
        let out = gelu_tanh_gate(&gu, 2);
        let want = [
            (gelu_tanh(1.0) * 2.0) as f32,
            0.0,
            (gelu_tanh(-1.0) * 4.0) as f32,
            (gelu_tanh(3.0) * -2.0) as f32,
        ];
        assert_eq!(out, want);
        let capped = softcap(&[0.0, 1e4, -1e4, 30.0], 30.0);
        assert_eq!(capped[..3], [0.0, 30.0, -30.0]);
        assert!((capped[3] - 30.0 * 1f32.tanh()).abs() < 1e-5);
        assert_eq!(scale(&[1.5, -2.0], 2.0), [3.0, -4.0]);
    }

    #[test]
    fn experts_sum_weighted_slots() {
        // D = 2, I = 1, E = 2, K = 2. Expert 0: gate = x0, up = x1, down = [1, 2];
        // expert 1: gate = x1, up = 1·x0 + 1·x1, down = [0, -1].
        let gate_up = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0];
        let down = [1.0, 2.0, 0.0, -1.0];
        let y = [2.0, 3.0];
        let dims = ExpertDims {
            hidden: 2,
            inter: 1,
            top_k: 2,
        };
        let out = moe_experts(&y, &[1, 0], &[0.25, 0.5], &gate_up, &down, dims);
        let a0 = gelu_tanh(2.0) * 3.0;
        let a1 = gelu_tanh(3.0) * 5.0;
        let want = [0.5 * a0 + 0.25 * 0.0 * a1, 0.5 * 2.0 * a0 - 0.25 * a1];
        for (g, w) in out.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() < 1e-5, "{out:?} against {want:?}");
        }
    }
}
