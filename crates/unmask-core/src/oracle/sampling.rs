//! Token selection from one row of LM-head logits, in f64: the reference for the GPU's
//! streaming argmax / confidence reduction.

use crate::rng::{hash4, uniform_open};
pub use crate::sampler::{ConfidenceKind, SelectParams};

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

/// The chosen token id of a full logits row and its confidence.
///
/// Token: argmax of `l + T * gumbel` (first index on ties), where `l` is the
/// CFG-combined, suppressed logit, -inf for ids the top-p/top-k cut removes (`cut_mask`).
/// Confidence by `params.confidence`, over `l / T` when `params.tempered` and T > 0, over
/// `l` otherwise:
/// - `Probability`: `softmax(l)[token]` over the ids not in `conf_exclude`, and 0 when the
///   token is excluded or suppressed;
/// - `Margin`: the largest minus the second largest entry of `softmax(l)`;
/// - `NegEntropy`: `sum p ln p` over `p = softmax(l)` (terms with `p = 0` count 0).
///
/// The last two see every id but the suppressed one; a row without any is 0.
pub fn select_token(
    logits: &[f32],
    uncond: Option<&[f32]>,
    position: u32,
    params: &SelectParams,
) -> (u32, f32) {
    let mut l = combined(logits, uncond, params.cfg_scale);
    if let Some(x) = params.suppress_token.and_then(|s| l.get_mut(s as usize)) {
        *x = f64::NEG_INFINITY;
    }
    if params.cuts() {
        let keep = cut_mask(&l, params);
        for (x, keep) in l.iter_mut().zip(keep) {
            if !keep {
                *x = f64::NEG_INFINITY;
            }
        }
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
    if params.tempered && t > 0.0 {
        l.iter_mut().for_each(|x| *x /= t);
    }
    let confidence = match params.confidence {
        ConfidenceKind::Probability => probability(&l, token, &params.conf_exclude),
        ConfidenceKind::Margin => margin(&l),
        ConfidenceKind::NegEntropy => neg_entropy(&l),
    };
    (token as u32, confidence as f32)
}

/// The CFG-combined logits `u + (w + 1)(c - u)`, or the logits without `uncond`.
fn combined(logits: &[f32], uncond: Option<&[f32]>, cfg_scale: f32) -> Vec<f64> {
    let w = cfg_scale as f64;
    match uncond {
        Some(u) => {
            assert_eq!(u.len(), logits.len(), "uncond row length");
            logits
                .iter()
                .zip(u)
                .map(|(&c, &u)| u as f64 + (w + 1.0) * (c as f64 - u as f64))
                .collect()
        }
        None => logits.iter().map(|&c| c as f64).collect(),
    }
}

/// `SelectParams::logprob`: the log-probability of `token` under the model's softmax, the
/// CFG-combined logits of the whole row at temperature 1 (no suppression, no cut).
pub fn model_logprob(logits: &[f32], uncond: Option<&[f32]>, token: u32, cfg_scale: f32) -> f64 {
    let l = combined(logits, uncond, cfg_scale);
    let max = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = l.iter().map(|&x| (x - max).exp()).sum();
    l[token as usize] - max - sum.ln()
}

/// Which ids of a row of (CFG-combined, suppressed) logits survive the top-p / top-k /
/// min-p cut of `params` (see `SelectParams::top_p`): id v stays when its logit is at least
/// the row's largest plus `SelectParams::min_p_gap` (in f32, as the kernel adds them),
/// fewer than k ids have a larger logit, and the probability `softmax(l / T)` (T = 1 at
/// temperature 0) of the ids with a larger logit is at most `top_p`, that softmax taken
/// over the ids min-p keeps (vLLM's order: min-p first). Ids at -inf never stay.
pub fn cut_mask(l: &[f64], params: &SelectParams) -> Vec<bool> {
    let t = params.temperature as f64;
    let scale = if t > 0.0 { 1.0 / t } else { 1.0 };
    let max = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return vec![false; l.len()];
    }
    let weight = |x: f64| ((x - max) * scale).exp();
    let floor = params
        .min_p_gap()
        .map_or(f64::NEG_INFINITY, |gap| (max as f32 + gap) as f64);
    // min-p first (vLLM's order): top-p's probabilities are over what it keeps.
    let total: f64 = l.iter().filter(|&&x| x >= floor).map(|&x| weight(x)).sum();
    let mut order: Vec<usize> = (0..l.len()).filter(|&v| l[v] > f64::NEG_INFINITY).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    let mut keep = vec![false; l.len()];
    // Walk groups of equal logits from the top: what lies strictly above a group decides it.
    let (mut above, mut mass_above) = (0usize, 0.0f64);
    let mut i = 0;
    while i < order.len() {
        let x = l[order[i]];
        let end = i + order[i..].iter().take_while(|&&v| l[v] == x).count();
        let by_k = params.top_k.is_none_or(|k| above < k as usize);
        let by_p = params.top_p.is_none_or(|p| mass_above <= p as f64 * total);
        if !(by_k && by_p && x >= floor) {
            break;
        }
        for &v in &order[i..end] {
            keep[v] = true;
        }
        above += end - i;
        mass_above += order[i..end].iter().map(|&v| weight(l[v])).sum::<f64>();
        i = end;
    }
    keep
}

fn probability(l: &[f64], token: usize, conf_exclude: &[Option<u32>; 2]) -> f64 {
    let excluded = |v: usize| conf_exclude.contains(&Some(v as u32));
    if excluded(token) || l[token] == f64::NEG_INFINITY {
        return 0.0;
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
    (l[token] - max).exp() / sum
}

/// The row's softmax over its finite logits, or `None` when it has none.
fn softmax(l: &[f64]) -> Option<Vec<f64>> {
    let max = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return None;
    }
    let e: Vec<f64> = l.iter().map(|&x| (x - max).exp()).collect();
    let z: f64 = e.iter().sum();
    Some(e.into_iter().map(|x| x / z).collect())
}

fn margin(l: &[f64]) -> f64 {
    let Some(p) = softmax(l) else {
        return 0.0;
    };
    let (mut top1, mut top2) = (0.0f64, 0.0f64);
    for &x in &p {
        if x > top1 {
            top2 = top1;
            top1 = x;
        } else if x > top2 {
            top2 = x;
        }
    }
    top1 - top2
}

fn neg_entropy(l: &[f64]) -> f64 {
    let Some(p) = softmax(l) else {
        return 0.0;
    };
    p.iter().filter(|&&x| x > 0.0).map(|&x| x * x.ln()).sum()
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
    fn margin_and_negative_entropy() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let z: f64 = [1.0f64, 3.0, 2.0, 0.0].iter().map(|x| x.exp()).sum();
        let p: Vec<f64> = [1.0f64, 3.0, 2.0, 0.0]
            .iter()
            .map(|x| x.exp() / z)
            .collect();
        let with = |confidence| SelectParams {
            confidence,
            // Ignored by both kinds.
            conf_exclude: [Some(1), None],
            ..SelectParams::default()
        };
        let (tok, m) = select_token(&logits, None, 0, &with(ConfidenceKind::Margin));
        assert_eq!(tok, 1);
        assert!((m as f64 - (p[1] - p[2])).abs() < 1e-7);
        // (1 - e^(l2 - l1)) / Z with Z relative to the maximum, as the kernel computes it.
        let z1 = z / 3f64.exp();
        assert!((m as f64 - (1.0 - (-1f64).exp()) / z1).abs() < 1e-7);
        let (tok, h) = select_token(&logits, None, 0, &with(ConfidenceKind::NegEntropy));
        assert_eq!(tok, 1);
        let want: f64 = p.iter().map(|x| x * x.ln()).sum();
        assert!((h as f64 - want).abs() < 1e-6 && h < 0.0);
        // Streaming form: S1 / S0 - ln S0 over d = l - max.
        let s0: f64 = [1.0f64, 3.0, 2.0, 0.0]
            .iter()
            .map(|x| (x - 3.0).exp())
            .sum();
        let s1: f64 = [1.0f64, 3.0, 2.0, 0.0]
            .iter()
            .map(|x| (x - 3.0).exp() * (x - 3.0))
            .sum();
        assert!((s1 / s0 - s0.ln() - want).abs() < 1e-12);
    }

    #[test]
    fn margin_ties_single_column_and_suppression() {
        let margin = SelectParams {
            confidence: ConfidenceKind::Margin,
            ..SelectParams::default()
        };
        let entropy = SelectParams {
            confidence: ConfidenceKind::NegEntropy,
            ..SelectParams::default()
        };
        assert_eq!(select_token(&[2.0, 5.0, 5.0], None, 0, &margin), (1, 0.0));
        assert_eq!(select_token(&[-4.0], None, 0, &margin), (0, 1.0));
        assert_eq!(select_token(&[-4.0], None, 0, &entropy), (0, 0.0));
        // Flat row of n: entropy ln n.
        let (_, h) = select_token(&[0.5; 8], None, 0, &entropy);
        assert!((h as f64 + 8f64.ln()).abs() < 1e-6);
        // The suppressed id leaves the softmax: [_, 5, 5] -> margin 0; a suppressed
        // single column has no confidence.
        let suppress = |p: SelectParams, s| SelectParams {
            suppress_token: Some(s),
            ..p
        };
        assert_eq!(
            select_token(&[9.0, 5.0, 5.0], None, 0, &suppress(margin, 0)),
            (1, 0.0)
        );
        assert_eq!(
            select_token(&[9.0], None, 0, &suppress(margin, 0)),
            (0, 0.0)
        );
        assert_eq!(
            select_token(&[9.0], None, 0, &suppress(entropy, 0)),
            (0, 0.0)
        );
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

    #[test]
    fn top_k_keeps_ties_and_top_p_keeps_what_lies_under_p() {
        let l = [1.0f64, 3.0, 2.0, 3.0, f64::NEG_INFINITY, 0.0];
        let with = |top_p, top_k, temperature| SelectParams {
            top_p,
            top_k,
            temperature,
            ..SelectParams::default()
        };
        // k = 1 keeps both ids tied at the maximum; k = 3 reaches 2.0.
        let k1 = cut_mask(&l, &with(None, Some(1), 0.0));
        assert_eq!(k1, [false, true, false, true, false, false]);
        let k3 = cut_mask(&l, &with(None, Some(3), 0.0));
        assert_eq!(k3, [false, true, true, true, false, false]);
        // p: the two maxima hold 2e^3 / Z; 2.0 stays while that is <= p.
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0, 0.0].iter().map(|x| x.exp()).sum();
        let top2 = 2.0 * 3f64.exp() / z;
        let below = with(Some((top2 - 1e-3) as f32), None, 0.0);
        assert_eq!(cut_mask(&l, &below), k1);
        let above = with(Some((top2 + 1e-3) as f32), None, 0.0);
        assert_eq!(cut_mask(&l, &above), k3);
        // A tiny p keeps the maximum; p = 1 keeps every finite id.
        assert_eq!(cut_mask(&l, &with(Some(1e-6), None, 0.0)), k1);
        let all = cut_mask(&l, &with(Some(1.0), None, 0.0));
        assert_eq!(all, [true, true, true, true, false, true]);
        // Both: an id must pass both.
        assert_eq!(cut_mask(&l, &with(Some(1.0), Some(1), 0.0)), k1);
        // Temperature sharpens (T < 1) the distribution the cut reads.
        let z_cold: f64 = [1.0f64, 3.0, 2.0, 3.0, 0.0]
            .iter()
            .map(|x| (x / 0.25).exp())
            .sum();
        let top2_cold = 2.0 * (3.0f64 / 0.25).exp() / z_cold;
        assert!(top2_cold > top2);
        let p = ((top2 + top2_cold) / 2.0) as f32;
        assert_eq!(cut_mask(&l, &with(Some(p), None, 1.0)), k3);
        assert_eq!(cut_mask(&l, &with(Some(p), None, 0.25)), k1);
    }

    #[test]
    fn min_p_keeps_ids_at_least_that_share_of_the_most_probable() {
        let l = [1.0f64, 3.0, 2.0, 3.0, f64::NEG_INFINITY, 0.0];
        let with = |min_p, temperature| SelectParams {
            min_p: Some(min_p),
            temperature,
            ..SelectParams::default()
        };
        // p(2.0) / p(3.0) = e^-1 = 0.368 at T = 1 (and at T = 0, which reads softmax(l)).
        let k3 = [false, true, true, true, false, false];
        assert_eq!(cut_mask(&l, &with(0.36, 0.0)), k3);
        assert_eq!(
            cut_mask(&l, &with(0.37, 1.0)),
            [false, true, false, true, false, false]
        );
        // T = 2 flattens: p(1.0) / p(3.0) = e^-1, so 1.0 stays at 0.36 but 0.0 does not.
        assert_eq!(
            cut_mask(&l, &with(0.36, 2.0)),
            [true, true, true, true, false, false]
        );
        // min-p first: top-p reads the probabilities of what min-p kept. Over the ids at
        // 3, 3 and 2 (kept by min-p 0.36), the maxima hold 2e^3 / (2e^3 + e^2) = 0.845; over
        // the whole row less. A top-p between the two keeps 2.0 only without min-p.
        let kept = 2.0 * 3f64.exp() / (2.0 * 3f64.exp() + 2f64.exp());
        let whole = 2.0 * 3f64.exp()
            / [1.0f64, 3.0, 2.0, 3.0, 0.0]
                .iter()
                .map(|x| x.exp())
                .sum::<f64>();
        let p = ((kept + whole) / 2.0) as f32;
        let both = SelectParams {
            top_p: Some(p),
            ..with(0.36, 0.0)
        };
        assert_eq!(
            cut_mask(&l, &both),
            [false, true, false, true, false, false]
        );
        let top_p_alone = SelectParams {
            min_p: None,
            ..both
        };
        assert_eq!(cut_mask(&l, &top_p_alone), k3);
        // 1 keeps only the maxima; 0 cuts nothing.
        assert_eq!(
            cut_mask(&l, &with(1.0, 0.7))[..4],
            [false, true, false, true]
        );
        assert!(!with(0.0, 1.0).cuts() && with(0.0, 1.0).min_p_gap().is_none());
    }

    #[test]
    fn cut_and_tempering_change_the_confidence_not_the_greedy_token() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let z: f64 = [1.0f64, 3.0, 2.0].iter().map(|x| x.exp()).sum();
        let k3 = SelectParams {
            top_k: Some(3),
            ..SelectParams::default()
        };
        let (tok, conf) = select_token(&logits, None, 0, &k3);
        assert_eq!(tok, 1);
        assert!((conf as f64 - 3f64.exp() / z).abs() < 1e-7);
        // Tempered at T = 0.5: softmax(2 l) over the kept ids; the noisy token is kept.
        let hot = SelectParams {
            temperature: 0.5,
            tempered: true,
            top_k: Some(2),
            seed: 7,
            ..SelectParams::default()
        };
        for position in 0..32 {
            let (tok, conf) = select_token(&logits, None, position, &hot);
            assert!(tok == 1 || tok == 2, "token {tok} was cut");
            let z2 = 6f64.exp() + 4f64.exp();
            let want = (2.0 * logits[tok as usize] as f64).exp() / z2;
            assert!((conf as f64 - want).abs() < 1e-7);
        }
    }
}
