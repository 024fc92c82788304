//! Token selection from one row of LM-head logits, in f64: the reference for the GPU's
//! streaming argmax / softmax-probability reduction.

use crate::rng::{hash4, uniform_open};
pub use crate::sampler::SelectParams;

/// Standard Gumbel noise `-ln(-ln U)` for vocabulary id `token` of the row at `position`.
pub fn gumbel(params: &SelectParams, position: u32, token: u32) -> f64 {
    let bits = hash4(
        params.seed as u32,
        (params.seed >> 32) as u32,
        params.step,
        position,
        token,
    );
    let u = uniform_open(bits) as f64;
    -(-u.ln()).ln()
}

/// The chosen token id of a full logits row and its untempered softmax probability.
///
/// Token: argmax of `l + T * gumbel` (first index on ties), where `l` is the
/// CFG-combined, suppressed logit. Confidence: `softmax(l)[token]` over the ids not in
/// `conf_exclude`, and 0 when the token is excluded.
pub fn select_token(
    logits: &[f32],
    uncond: Option<&[f32]>,
    position: u32,
    params: &SelectParams,
) -> (u32, f32) {
    let w = params.cfg_scale as f64;
    let mut l: Vec<f64> = match uncond {
        Some(u) => {
            assert_eq!(u.len(), logits.len(), "uncond row length");
            logits
                .iter()
                .zip(u)
                .map(|(&c, &u)| u as f64 + (w + 1.0) * (c as f64 - u as f64))
                .collect()
        }
        None => logits.iter().map(|&c| c as f64).collect(),
    };
    if let Some(x) = params.suppress_token.and_then(|s| l.get_mut(s as usize)) {
        *x = f64::NEG_INFINITY;
    }
    let t = params.temperature as f64;
    let mut token = 0usize;
    let mut best = f64::NEG_INFINITY;
    for (v, &x) in l.iter().enumerate() {
        let score = if t > 0.0 {
            x + t * gumbel(params, position, v as u32)
        } else {
            x
        };
        if v == 0 || score > best {
            best = score;
            token = v;
        }
    }
    let excluded = |v: usize| params.conf_exclude.contains(&Some(v as u32));
    if excluded(token) || l[token] == f64::NEG_INFINITY {
        return (token as u32, 0.0);
    }
    let max = l
        .iter()
        .enumerate()
        .filter(|(v, _)| !excluded(*v))
        .map(|(_, &x)| x)
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = l
        .iter()
        .enumerate()
        .filter(|(v, _)| !excluded(*v))
        .map(|(_, &x)| (x - max).exp())
        .sum();
    (token as u32, ((l[token] - max).exp() / sum) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_maximum_and_softmax_probability() {
        let logits = [1.0f32, 3.0, 3.0, 0.0];
        let (tok, conf) = select_token(&logits, None, 0, &SelectParams::default());
        assert_eq!(tok, 1);
        let z = 1f64.exp() + 2.0 * 3f64.exp() + 1.0;
        assert!((conf as f64 - 3f64.exp() / z).abs() < 1e-7);
    }

    #[test]
    fn suppress_and_exclude() {
        let logits = [1.0f32, 3.0, 2.0];
        let p = SelectParams {
            suppress_token: Some(1),
            conf_exclude: [Some(0), None],
            ..SelectParams::default()
        };
        let (tok, conf) = select_token(&logits, None, 0, &p);
        assert_eq!((tok, conf), (2, 1.0));
        let p = SelectParams {
            conf_exclude: [Some(1), None],
            ..SelectParams::default()
        };
        assert_eq!(select_token(&logits, None, 0, &p), (1, 0.0));
    }

    #[test]
    fn cfg_extrapolates() {
        // w = 1: l = u + 2(c - u) = 2c - u.
        let c = [1.0f32, 0.0];
        let u = [0.0f32, -2.0];
        let p = SelectParams {
            cfg_scale: 1.0,
            ..SelectParams::default()
        };
        // l = [2, 2]: tie, first wins.
        assert_eq!(select_token(&c, Some(&u), 0, &p).0, 0);
    }
}
