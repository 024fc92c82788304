//! The confidences token selection reports, against the f64 oracle: the three kinds
//! (probability, margin, negative entropy) at odd and even vocabulary sizes, with and without
//! CFG, greedy and noised; exact and near ties and a dominant logit; the ids excluded from the
//! confidence; and the tolerances at a full Dream-sized vocabulary.

use crate::common::select::{
    KINDS, assert_choices, assert_kind_choices, chunk_ranges, oracle_rows, path, positions, run_gpu,
};
use crate::common::{ctx, random_vec};
use unmask_gpu::ops::sampling::{ConfidenceKind, SelectParams};

#[test]
fn confidence_exclusions() {
    let ctx = ctx();
    let (rows, n) = (4, 600);
    let mut logits = random_vec(41, rows * n, 2.0);
    // Rows 0, 1: id 10 is the argmax and excluded -> confidence 0. Rows 2, 3: id 20 is the
    // argmax, ids 10 and 30 are excluded but not chosen -> larger confidence.
    for r in 0..rows {
        let top = if r < 2 { 10 } else { 20 };
        logits[r * n + top] = 9.0;
        if r >= 2 {
            logits[r * n + 10] = 8.5;
            logits[r * n + 30] = 8.0;
        }
    }
    let pos = positions(rows);
    let params = SelectParams {
        conf_exclude: [Some(10), Some(30)],
        ..SelectParams::default()
    };
    let want = oracle_rows(&logits, None, n, &pos, &params);
    let unexcluded = oracle_rows(&logits, None, n, &pos, &SelectParams::default());
    assert_eq!(want[0], (10, 0.0));
    assert!(want[2].0 == 20 && want[2].1 > unexcluded[2].1 * 1.5);
    for parts in [1, 7] {
        let chunks = chunk_ranges(n, parts);
        let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
        assert_choices(&format!("conf_exclude {}", path(&chunks)), &got, &want);
    }
}

/// Every kind at odd and even vocabulary sizes and several chunkings (one reversed), with and
/// without CFG, greedy and noised: the token is the same for every kind and the confidence
/// (from the untempered softmax) matches the oracle's.
#[test]
fn confidence_kinds_match_oracle() {
    let ctx = ctx();
    let rows = 5;
    let pos = positions(rows);
    for &n in &[1usize, 7, 1000, 3001, 4096] {
        let cond = random_vec(100 + n as u64, rows * n, 4.0);
        let uncond = random_vec(200 + n as u64, rows * n, 4.0);
        for cfg in [false, true] {
            let u = cfg.then_some(uncond.as_slice());
            for temperature in [0.0f32, 0.8] {
                let mut tokens = Vec::new();
                for kind in KINDS {
                    let params = SelectParams {
                        temperature,
                        cfg_scale: if cfg { 1.5 } else { 0.0 },
                        seed: 0xfeed_beef,
                        step: 4,
                        confidence: kind,
                        ..SelectParams::default()
                    };
                    let want = oracle_rows(&cond, u, n, &pos, &params);
                    tokens.push(want.iter().map(|c| c.0).collect::<Vec<_>>());
                    for parts in [1, 4, 7] {
                        let mut chunks = chunk_ranges(n, parts);
                        let order = if parts == 7 {
                            chunks.reverse();
                            " reversed"
                        } else {
                            ""
                        };
                        let got = run_gpu(&ctx, &cond, u, rows, n, &pos, &chunks, &params);
                        assert_kind_choices(
                            &format!("n={n} cfg={cfg} T={temperature} {}{order}", path(&chunks)),
                            kind,
                            cfg,
                            &got,
                            &want,
                        );
                    }
                }
                assert!(
                    tokens.iter().all(|t| *t == tokens[0]),
                    "n={n} cfg={cfg} T={temperature}: the token depends on the kind"
                );
            }
        }
    }
}

/// Exact ties between the two largest logits give a margin of exactly 0 wherever the two
/// meet (different chunks, one vec4 load, one invocation's strided loop, every id), a near
/// tie a small margin without cancellation; one dominant logit gives margin ~1 and entropy
/// ~0.
#[test]
fn margin_ties_and_a_dominant_logit() {
    let ctx = ctx();
    let (rows, n) = (7, 1000);
    let mut logits = random_vec(7, rows * n, 1.0);
    // Row 0: ids 3 and 999 (different chunks); row 1: 600 and 601 (one vec4 load); row 2:
    // 40 and 296 (one lane of the scalar loop, 256 apart); row 3: every id ties; row 4: id
    // 123 is 59 or more above the rest; row 5: id 77 leads by 10 or more; row 6: id 500
    // leads id 900 by 2 ulps.
    for (row, ids) in [(0, [3, 999]), (1, [600, 601]), (2, [40, 296])] {
        for id in ids {
            logits[row * n + id] = 7.0;
        }
    }
    logits[3 * n..4 * n].fill(-0.75);
    logits[4 * n + 123] = 60.0;
    logits[5 * n + 77] = 12.0;
    logits[6 * n + 500] = 7.0;
    logits[6 * n + 900] = 7.0 - 2.0 * f32::EPSILON * 4.0;
    let pos = positions(rows);
    let three = chunk_ranges(n, 3);
    let reversed: Vec<_> = three.iter().rev().copied().collect();
    let chunkings = [chunk_ranges(n, 1), three, reversed];
    for kind in KINDS {
        let params = SelectParams {
            confidence: kind,
            ..SelectParams::default()
        };
        let want = oracle_rows(&logits, None, n, &pos, &params);
        assert_eq!(
            want.iter().map(|c| c.0).collect::<Vec<_>>(),
            vec![3, 600, 40, 0, 123, 77, 500]
        );
        match kind {
            ConfidenceKind::Margin => {
                assert!(want[..4].iter().all(|c| c.1 == 0.0), "{want:?}");
                assert!(want[4].1 == 1.0 && want[5].1 > 0.99, "{want:?}");
                assert!(want[6].1 > 0.0 && want[6].1 < 1e-5, "{want:?}");
            }
            ConfidenceKind::NegEntropy => {
                assert!((want[3].1 as f64 + (n as f64).ln()).abs() < 1e-6);
                assert!(want[4].1 <= 0.0 && want[4].1 > -1e-20, "{want:?}");
                assert!(want[5].1 < -1e-3 && want[5].1 > -0.2, "{want:?}");
            }
            ConfidenceKind::Probability => {}
        }
        for (i, chunks) in chunkings.iter().enumerate() {
            let got = run_gpu(&ctx, &logits, None, rows, n, &pos, chunks, &params);
            let order = if i == 2 { " reversed" } else { "" };
            assert_kind_choices(
                &format!("ties and a dominant logit {}{order}", path(chunks)),
                kind,
                false,
                &got,
                &want,
            );
            match kind {
                ConfidenceKind::Margin => assert_eq!(got[4].1, 1.0),
                ConfidenceKind::NegEntropy => assert!(got[4].1 <= 0.0 && got[4].1 > -1e-20),
                ConfidenceKind::Probability => {}
            }
        }
    }
}

/// `conf_exclude` only changes the probability; the suppressed id leaves every kind's
/// softmax.
#[test]
fn exclusions_only_change_the_probability() {
    let ctx = ctx();
    let (rows, n) = (3, 513);
    let mut logits = random_vec(51, rows * n, 2.0);
    // Id 10 is the argmax and excluded; id 20, the runner-up, is suppressed.
    for r in 0..rows {
        logits[r * n + 10] = 9.0;
        logits[r * n + 20] = 8.5;
    }
    let pos = positions(rows);
    for kind in KINDS {
        let params = SelectParams {
            conf_exclude: [Some(10), Some(30)],
            suppress_token: Some(20),
            confidence: kind,
            ..SelectParams::default()
        };
        let want = oracle_rows(&logits, None, n, &pos, &params);
        let unexcluded = SelectParams {
            conf_exclude: [None; 2],
            ..params
        };
        let unsuppressed = SelectParams {
            suppress_token: None,
            ..unexcluded
        };
        let unexcluded = oracle_rows(&logits, None, n, &pos, &unexcluded);
        let unsuppressed = oracle_rows(&logits, None, n, &pos, &unsuppressed);
        assert!(want.iter().all(|c| c.0 == 10));
        if kind == ConfidenceKind::Probability {
            assert!(want.iter().all(|c| c.1 == 0.0));
        } else {
            assert_eq!(want, unexcluded);
            assert!(want.iter().zip(&unsuppressed).all(|(a, b)| a.1 != b.1));
        }
        for parts in [1, 4] {
            let chunks = chunk_ranges(n, parts);
            let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
            assert_kind_choices(
                &format!("exclude 10, 30, suppress 20 {}", path(&chunks)),
                kind,
                false,
                &got,
                &want,
            );
        }
    }
}

/// A Dream-sized vocabulary (152064 ids) in 5 chunks, with noise: the tolerances hold at
/// full size.
#[test]
fn confidence_kinds_full_vocabulary() {
    let ctx = ctx();
    let (rows, n) = (4, 152_064);
    let logits = random_vec(98, rows * n, 5.0);
    let pos = positions(rows);
    let chunks = chunk_ranges(n, 5);
    for kind in KINDS {
        let params = SelectParams {
            temperature: 1.0,
            seed: 8,
            step: 1,
            confidence: kind,
            ..SelectParams::default()
        };
        let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
        let want = oracle_rows(&logits, None, n, &pos, &params);
        assert_kind_choices(
            &format!("n={n} T=1 {}", path(&chunks)),
            kind,
            false,
            &got,
            &want,
        );
    }
}
