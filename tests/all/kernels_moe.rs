//! Mixture-of-experts routing (`ops::moe::moe_route`) against a CPU oracle in f64: the same
//! experts in the same order and their weights, on DiffusionGemma's shape (128 experts, top 8),
//! a small one, exact ties, and bad shapes refused with the field named.

use crate::common::{ctx, random_vec};
use unmask_gpu::ops::moe::moe_route;
use unmask_gpu::{DType, StepEncoder, Tensor};

/// softmax, the top k (ties to the lower expert), renormalised, times the expert's scale.
fn oracle(logits: &[f32], scale: &[f32], top_k: usize) -> (Vec<u32>, Vec<f32>) {
    let e = scale.len();
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for row in logits.chunks(e) {
        let m = row.iter().fold(f64::MIN, |a, &b| a.max(f64::from(b)));
        let ex: Vec<f64> = row.iter().map(|&x| (f64::from(x) - m).exp()).collect();
        let sum: f64 = ex.iter().sum();
        let p: Vec<f64> = ex.iter().map(|x| x / sum).collect();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let top = &order[..top_k];
        let picked: f64 = top.iter().map(|&j| p[j]).sum();
        for &j in top {
            ids.push(j as u32);
            weights.push((p[j] / picked * f64::from(scale[j])) as f32);
        }
    }
    (ids, weights)
}

fn run(logits: &[f32], scale: &[f32], rows: usize, top_k: usize) -> (Vec<u32>, Vec<f32>) {
    let ctx = ctx();
    let e = scale.len();
    let lt = Tensor::from_f32(&ctx, &[rows, e], logits, "logits").unwrap();
    let st = Tensor::from_f32(&ctx, &[e], scale, "scale").unwrap();
    let ids = Tensor::zeros(&ctx, DType::U32, &[rows, top_k], "ids").unwrap();
    let w = Tensor::zeros(&ctx, DType::F32, &[rows, top_k], "weights").unwrap();
    let mut step = StepEncoder::new(&ctx, "moe route");
    moe_route(&mut step, &lt, &st, &ids, &w, rows, top_k).unwrap();
    step.submit().unwrap();
    (ids.read_u32(&ctx).unwrap(), w.read_f32(&ctx).unwrap())
}

#[test]
fn routing_matches_the_oracle() {
    for (rows, experts, top_k, seed) in [(5, 128, 8, 1u64), (7, 8, 2, 2), (3, 200, 16, 3)] {
        // Spread logits (router scores of a few units) and scales near 1, as published.
        let logits = random_vec(seed, rows * experts, 4.0);
        let scale: Vec<f32> = random_vec(seed + 10, experts, 0.5)
            .iter()
            .map(|s| 1.0 + s)
            .collect();
        let (ids, w) = run(&logits, &scale, rows, top_k);
        let (want_ids, want_w) = oracle(&logits, &scale, top_k);
        assert_eq!(ids, want_ids, "experts of {rows} x {experts}, top {top_k}");
        for (i, (g, x)) in w.iter().zip(&want_w).enumerate() {
            assert!(
                (g - x).abs() <= 2e-6 * x.abs().max(1.0),
                "{rows} x {experts} top {top_k}: weight {i}: {g} against {x}"
            );
        }
    }
}

#[test]
fn exact_ties_go_to_the_lower_expert() {
    // Experts 1, 3 and 6 tie for the top; with top 2, experts 1 and 3 win, each half the
    // weight before their scales (2 and 3).
    let logits = [0.0, 2.0, 0.0, 2.0, 1.0, 0.0, 2.0, 0.0];
    let scale = [1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0];
    let (ids, w) = run(&logits, &scale, 1, 2);
    assert_eq!(ids, [1, 3]);
    assert!(
        (w[0] - 1.0).abs() < 1e-6 && (w[1] - 1.5).abs() < 1e-6,
        "{w:?}"
    );
}

#[test]
fn bad_routing_shapes_are_refused() {
    let ctx = ctx();
    let scale = Tensor::from_f32(&ctx, &[4], &[1.0; 4], "scale").unwrap();
    let logits = Tensor::from_f32(&ctx, &[2, 4], &[0.0; 8], "logits").unwrap();
    let ids = Tensor::zeros(&ctx, DType::U32, &[2, 4], "ids").unwrap();
    let w = Tensor::zeros(&ctx, DType::F32, &[2, 4], "w").unwrap();
    let mut step = StepEncoder::new(&ctx, "moe route errors");
    // More experts per token than experts.
    let err = moe_route(&mut step, &logits, &scale, &ids, &w, 2, 5).unwrap_err();
    assert!(err.to_string().contains("top_k 5"), "{err}");
    // ids of the wrong dtype.
    let err = moe_route(&mut step, &logits, &scale, &w, &w, 2, 2).unwrap_err();
    assert!(err.to_string().contains("moe_route ids"), "{err}");
    // Fewer logits than rows x experts.
    let err = moe_route(&mut step, &logits, &scale, &ids, &w, 3, 2).unwrap_err();
    assert!(err.to_string().contains("moe_route logits"), "{err}");
}
