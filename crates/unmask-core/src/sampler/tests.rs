use super::*;

const MASK: u32 = 99;

fn params(gen_length: usize, steps: usize, block_length: usize) -> GenerationParams {
    GenerationParams {
        gen_length,
        steps,
        block_length,
        round_confidence_bf16: false,
        ..GenerationParams::default()
    }
}

/// Runs to the end, predicting token `1000 + position` with confidence `conf(position)`.
pub(super) fn run(sampler: &mut Sampler, conf: impl Fn(u32) -> f32) -> Vec<StepRecord> {
    let mut records = Vec::new();
    while !sampler.is_done() {
        let rows = sampler.rows_to_predict();
        assert!(!rows.is_empty());
        let predictions: Vec<(u32, f32)> = rows.iter().map(|&p| (1000 + p, conf(p))).collect();
        records.push(sampler.commit(&predictions).unwrap());
    }
    records
}

pub(super) fn counts(records: &[StepRecord]) -> Vec<usize> {
    records.iter().map(|r| r.committed.len()).collect()
}

#[test]
fn defaults_are_the_reference_ones() {
    let p = GenerationParams::default();
    assert_eq!((p.gen_length, p.steps, p.block_length), (128, 128, 32));
    assert_eq!(p.temperature, 0.0);
    assert_eq!(p.remasking, Remasking::LowConfidence);
    assert_eq!(p.cfg_scale, 0.0);
    assert_eq!(p.threshold, None);
    assert!(!p.logits_eos_inf && !p.confidence_eos_eot_inf);
    assert_eq!(p.seed, 0);
    assert!(p.round_confidence_bf16);
}

#[test]
fn the_answer_is_final_once_everything_before_its_stop_is_committed() {
    const STOP: u32 = 7;
    // Prompt of 2, canvas of 6 in one block, one commit per step, lowest position
    // committed last: the stop at canvas position 2 is committed before positions 0, 1.
    let mut s = Sampler::new(&[1, 2], params(6, 6, 6), MASK, 64).unwrap();
    assert_eq!(s.steps_left(), Some(6));
    let mut finals = Vec::new();
    while !s.is_done() {
        let rows = s.rows_to_predict();
        let predictions: Vec<(u32, f32)> = rows
            .iter()
            .map(|&p| (if p == 4 { STOP } else { 1000 + p }, p as f32 / 100.0))
            .collect();
        s.commit(&predictions).unwrap();
        finals.push(s.final_answer_len(&[STOP]));
    }
    // Commits go 7, 6, 5, 4 (the stop), 3, 2: final after position 2 is committed.
    assert_eq!(finals, vec![None, None, None, None, None, Some(2)]);
    assert_eq!(s.steps_left(), Some(0));
    // Left to right: final after the third step, with three steps of the schedule left.
    let mut s = Sampler::new(&[1, 2], params(6, 6, 6), MASK, 64).unwrap();
    let mut at = None;
    while at.is_none() {
        let rows = s.rows_to_predict();
        let predictions: Vec<(u32, f32)> = rows
            .iter()
            .map(|&p| (if p == 4 { STOP } else { 1000 + p }, 1.0 - p as f32 / 100.0))
            .collect();
        s.commit(&predictions).unwrap();
        at = s.final_answer_len(&[STOP]);
    }
    assert_eq!((at, s.steps_left(), s.is_done()), (Some(2), Some(3), false));
}

#[test]
fn quotas_with_remainders() {
    // 12 masks in 5 steps: 3, 3, 2, 2, 2.
    let mut s = Sampler::new(&[1, 2, 3], params(12, 5, 12), MASK, 64).unwrap();
    assert_eq!(s.quota(), Some(3));
    let records = run(&mut s, |p| p as f32 / 100.0);
    assert_eq!(counts(&records), vec![3, 3, 2, 2, 2]);
    assert_eq!(
        records.iter().map(|r| r.step).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    // Highest confidence first: the last positions are committed first.
    assert_eq!(
        records[0].committed,
        vec![(12, 1012), (13, 1013), (14, 1014)]
    );
    assert!(s.tokens()[3..].iter().all(|&t| t != MASK));
    assert_eq!(s.generated().len(), 12);
}

#[test]
fn more_steps_than_masks_skips_empty_steps() {
    // 2 masks in 4 steps: quotas 1, 1, 0, 0; the empty steps are not requested.
    let mut s = Sampler::new(&[1], params(2, 4, 2), MASK, 64).unwrap();
    let records = run(&mut s, |_| 0.5);
    assert_eq!(counts(&records), vec![1, 1]);
    assert_eq!(s.global_step(), 2);
    assert!(s.is_done());
    assert!(s.rows_to_predict().is_empty());
    assert_eq!(s.commit(&[]), Err(SamplerError::Finished));

    // 1e12 steps: the same schedule, and no table sized by the step count.
    let mut s = Sampler::new(&[1], params(4, 1_000_000_000_000, 2), MASK, 64).unwrap();
    let records = run(&mut s, |_| 0.5);
    assert_eq!(counts(&records), vec![1, 1, 1, 1]);
    assert!(s.quotas.len() <= 2);
}

#[test]
fn block_transitions() {
    // 4 blocks of 4, 2 steps per block, 2 tokens per step.
    let prompt = [5, 6, 7];
    let mut s = Sampler::new(&prompt, params(16, 8, 4), MASK, 64).unwrap();
    assert_eq!(s.num_blocks(), 4);
    assert_eq!(s.steps_per_block(), Some(2));
    for block in 0..4 {
        for step in 0..2 {
            assert_eq!(s.block_index(), block);
            assert_eq!(s.block(), 3 + 4 * block..7 + 4 * block);
            assert_eq!(s.step_in_block(), step);
            assert_eq!(s.global_step(), 2 * block + step);
            let rows = s.rows_to_predict();
            // Only the current block is predicted; earlier blocks are complete.
            assert!(rows.iter().all(|&p| s.block().contains(&(p as usize))));
            assert_eq!(rows.len(), 4 - 2 * step);
            let preds: Vec<(u32, f32)> = rows.iter().map(|&p| (p, 0.5)).collect();
            let r = s.commit(&preds).unwrap();
            assert_eq!((r.block, r.step), (block, step));
            assert_eq!(r.committed.len(), 2);
        }
    }
    assert!(s.is_done());
    assert_eq!(s.block(), 19..19);
    assert_eq!(&s.tokens()[..3], &prompt);
    assert_eq!(s.generated(), (3..19).collect::<Vec<u32>>().as_slice());
}

#[test]
fn ties_go_to_the_lowest_position() {
    let mut s = Sampler::new(&[1], params(6, 3, 6), MASK, 64).unwrap();
    let r = s
        .commit(&[
            (10, 0.5),
            (11, 0.5),
            (12, 0.5),
            (13, 0.5),
            (14, 0.5),
            (15, 0.5),
        ])
        .unwrap();
    assert_eq!(r.committed, vec![(1, 10), (2, 11)]);
    // The tie only matters at the boundary: a higher one still wins.
    let r = s
        .commit(&[(12, 0.5), (13, 0.5), (14, 0.5), (15, 0.75)])
        .unwrap();
    assert_eq!(r.committed, vec![(3, 12), (6, 15)]);
}

#[test]
fn bf16_rounding_creates_ties() {
    // 0.5 and 0.5 + 2^-12 are distinct in f32 but equal in bf16.
    let high = 0.5 + 1.0 / 4096.0;
    let preds = [(10, 0.5), (11, high)];
    let mut p = params(2, 2, 2);
    let mut exact = Sampler::new(&[1], p.clone(), MASK, 64).unwrap();
    assert_eq!(exact.commit(&preds).unwrap().committed, vec![(2, 11)]);
    p.round_confidence_bf16 = true;
    let mut rounded = Sampler::new(&[1], p, MASK, 64).unwrap();
    assert_eq!(rounded.commit(&preds).unwrap().committed, vec![(1, 10)]);
}

#[test]
fn nan_and_negative_zero_confidences() {
    let mut s = Sampler::new(&[1], params(3, 3, 3), MASK, 64).unwrap();
    let r = s.commit(&[(10, f32::NAN), (11, -0.0), (12, 0.0)]).unwrap();
    assert_eq!(r.committed, vec![(2, 11)]);
    let r = s.commit(&[(10, f32::NAN), (12, -1.0)]).unwrap();
    assert_eq!(r.committed, vec![(3, 12)]);
}

/// A prediction of the mask token commits nothing: threshold decoding passes it over (the
/// next most confident prediction is committed) and refuses a step where every row
/// predicts it, instead of repeating that step for ever.
#[test]
fn threshold_decoding_never_stalls_on_mask_predictions() {
    let mut p = params(4, 1, 4);
    p.threshold = Some(0.9);
    let mut s = Sampler::new(&[1, 2], p, MASK, 64).unwrap();
    let r = s
        .commit(&[(MASK, 0.99), (11, 0.5), (MASK, 0.95), (13, 0.2)])
        .unwrap();
    assert_eq!(r.committed, vec![(3, 11)]);
    let e = s
        .commit(&[(MASK, 0.9), (MASK, 0.1), (MASK, 0.3)])
        .unwrap_err();
    assert!(e.to_string().contains("3 masked positions"), "{e}");
}

#[test]
fn threshold_mode() {
    let mut p = params(8, 1, 4);
    p.threshold = Some(0.9);
    let mut s = Sampler::new(&[1, 2], p, MASK, 64).unwrap();
    assert_eq!(s.steps_per_block(), None);
    assert_eq!(s.quota(), None);
    // Every prediction at or above the threshold is committed.
    let r = s
        .commit(&[(10, 0.95), (11, 0.2), (12, 0.9), (13, 0.3)])
        .unwrap();
    assert_eq!(r.committed, vec![(2, 10), (4, 12)]);
    // None above: only the most confident one.
    let r = s.commit(&[(11, 0.2), (13, 0.3)]).unwrap();
    assert_eq!(r.committed, vec![(5, 13)]);
    assert_eq!(s.block(), 2..6);
    let r = s.commit(&[(11, 0.1)]).unwrap();
    assert_eq!((r.block, r.step), (0, 2));
    // The block has no masks left: the next block starts.
    assert_eq!(s.block(), 6..10);
    assert_eq!(s.step_in_block(), 0);
    let r = s
        .commit(&[(20, 1.0), (21, 1.0), (22, 1.0), (23, 1.0)])
        .unwrap();
    assert_eq!(r.committed.len(), 4);
    assert!(s.is_done());
    assert_eq!(s.global_step(), 4);
    assert_eq!(s.tokens(), &[1, 2, 10, 11, 12, 13, 20, 21, 22, 23]);
}

#[test]
fn masked_prompt_positions_compete_for_the_quota() {
    // Prompt [7, MASK, 8]: the masked prompt position is predicted in every block and
    // takes a commit from the block's quota when it is the most confident.
    let prompt = [7, MASK, 8];
    let mut s = Sampler::new(&prompt, params(4, 4, 2), MASK, 64).unwrap();
    assert_eq!(s.rows_to_predict(), vec![1, 3, 4]);
    assert_eq!(
        s.unconditional_tokens(),
        vec![MASK, MASK, MASK, MASK, MASK, MASK, MASK]
    );
    let r = s.commit(&[(50, 0.9), (51, 0.1), (52, 0.2)]).unwrap();
    assert_eq!(r.committed, vec![(1, 50)]);
    assert_eq!(s.rows_to_predict(), vec![3, 4]);
    let r = s.commit(&[(51, 0.1), (52, 0.2)]).unwrap();
    assert_eq!(r.committed, vec![(4, 52)]);
    // Block 0's two steps are used up with position 3 still masked: it is predicted
    // again in block 1 and competes there.
    assert_eq!(s.block(), 5..7);
    assert_eq!(s.rows_to_predict(), vec![3, 5, 6]);
    // The unconditional input masks only the original prompt tokens.
    let unconditional = s.unconditional_tokens();
    assert_eq!(&unconditional[..3], &[MASK, 50, MASK]);
    assert_eq!(unconditional[4], 52);
    let r = s.commit(&[(60, 0.9), (61, 0.1), (62, 0.2)]).unwrap();
    assert_eq!(r.committed, vec![(3, 60)]);
    let r = s.commit(&[(61, 0.1), (62, 0.2)]).unwrap();
    assert_eq!(r.committed, vec![(6, 62)]);
    // As in the reference, quotas are spent and a mask is left in the output.
    assert!(s.is_done());
    assert_eq!(s.tokens(), &[7, 50, 8, 60, 52, MASK, 62]);
}

#[test]
fn random_remasking_is_seeded() {
    let mut p = params(16, 16, 16);
    p.remasking = Remasking::Random;
    let positions = |seed: u64| {
        let mut p = p.clone();
        p.seed = seed;
        let mut s = Sampler::new(&[1, 2], p, MASK, 64).unwrap();
        // The model's confidences are ignored: a constant changes nothing.
        let records = run(&mut s, |_| 1.0);
        records
            .iter()
            .map(|r| r.committed[0].0)
            .collect::<Vec<u32>>()
    };
    let a = positions(7);
    assert_eq!(a, positions(7));
    assert_ne!(a, positions(8));
    let mut sorted = a.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (2..18).collect::<Vec<u32>>());
    assert_ne!(a, sorted, "a random order is not left to right");
}

#[test]
fn commit_with_confidences_uses_them_as_given() {
    let mut p = params(4, 4, 4);
    p.remasking = Remasking::Random;
    p.round_confidence_bf16 = true;
    let mut s = Sampler::new(&[1], p, MASK, 64).unwrap();
    let high = 0.5 + 1.0 / 4096.0;
    let r = s
        .commit_with_confidences(&[10, 11, 12, 13], &[0.5, 0.1, high, 0.2])
        .unwrap();
    // Rounded to bf16, 0.5 at position 1 would have tied and won.
    assert_eq!(r.committed, vec![(3, 12)]);
    assert_eq!(
        s.commit_with_confidences(&[10, 11, 13], &[0.1]),
        Err(SamplerError::ConfidenceCount {
            tokens: 3,
            confidences: 1
        })
    );
    assert_eq!(
        s.commit_with_confidences(&[11], &[0.1]),
        Err(SamplerError::PredictionCount {
            expected: 3,
            found: 1
        })
    );
}

#[test]
fn wrong_prediction_count_is_an_error() {
    let mut s = Sampler::new(&[1], params(4, 4, 4), MASK, 64).unwrap();
    assert_eq!(
        s.commit(&[(1, 0.5)]),
        Err(SamplerError::PredictionCount {
            expected: 4,
            found: 1
        })
    );
    // Nothing changed.
    assert_eq!(s.rows_to_predict().len(), 4);
    assert_eq!(s.global_step(), 0);
}

#[test]
fn validation_errors() {
    let ok = params(8, 4, 4);
    let err = |p: GenerationParams, prompt: &[u32], max_len: usize| {
        Sampler::new(prompt, p, MASK, max_len).unwrap_err()
    };
    assert!(Sampler::new(&[1], ok.clone(), MASK, 9).is_ok());
    assert_eq!(err(params(0, 4, 4), &[1], 64), SamplerError::ZeroGenLength);
    assert_eq!(
        err(params(8, 4, 0), &[1], 64),
        SamplerError::ZeroBlockLength
    );
    assert_eq!(
        err(params(10, 4, 4), &[1], 64),
        SamplerError::GenNotMultipleOfBlock {
            gen_length: 10,
            block_length: 4
        }
    );
    assert_eq!(
        err(params(8, 3, 4), &[1], 64),
        SamplerError::StepsNotMultipleOfBlocks {
            steps: 3,
            num_blocks: 2
        }
    );
    assert_eq!(
        err(params(8, 1, 4), &[1], 64),
        SamplerError::TooFewSteps {
            steps: 1,
            num_blocks: 2
        }
    );
    assert_eq!(
        err(params(8, 0, 4), &[1], 64),
        SamplerError::TooFewSteps {
            steps: 0,
            num_blocks: 2
        }
    );
    for threshold in [0.0, -0.5, 1.5, f32::NAN] {
        let mut p = ok.clone();
        p.threshold = Some(threshold);
        assert!(matches!(
            err(p, &[1], 64),
            SamplerError::ThresholdOutOfRange { .. }
        ));
    }
    // Threshold mode does not use steps.
    let mut p = params(8, 1, 4);
    p.threshold = Some(1.0);
    assert!(Sampler::new(&[1], p, MASK, 64).is_ok());
    for temperature in [-0.1, f32::INFINITY, f32::NAN] {
        let mut p = ok.clone();
        p.temperature = temperature;
        assert!(matches!(
            err(p, &[1], 64),
            SamplerError::BadTemperature { .. }
        ));
    }
    for cfg_scale in [-1.0, f32::NAN] {
        let mut p = ok.clone();
        p.cfg_scale = cfg_scale;
        assert!(matches!(err(p, &[1], 64), SamplerError::BadCfgScale { .. }));
    }
    assert_eq!(err(ok.clone(), &[], 64), SamplerError::EmptyPrompt);
    assert_eq!(
        err(ok.clone(), &[1, 2], 9),
        SamplerError::TooLong {
            prompt_len: 2,
            gen_length: 8,
            suffix_len: 0,
            total: 10,
            max_len: 9
        }
    );
    let text = err(ok, &[1, 2], 9).to_string();
    assert!(text.contains("10") && text.contains('9'), "{text}");
}

#[test]
fn a_suffix_is_context_after_the_canvas_and_never_predicted() {
    const STOP: u32 = 7;
    // Prompt of 2, canvas of 4 in two blocks, suffix of 3.
    let mut s = Sampler::with_suffix(&[1, 2], &[50, 51, 52], params(4, 4, 2), MASK, 64).unwrap();
    assert_eq!(s.tokens(), &[1, 2, MASK, MASK, MASK, MASK, 50, 51, 52]);
    assert_eq!((s.canvas(), s.suffix_len()), (2..6, 3));
    assert_eq!(s.block(), 2..4);
    let mut predicted = Vec::new();
    while !s.is_done() {
        let rows = s.rows_to_predict();
        predicted.extend_from_slice(&rows);
        let predictions: Vec<(u32, f32)> = rows
            .iter()
            .map(|&p| (if p == 5 { STOP } else { 1000 + p }, 1.0))
            .collect();
        s.commit(&predictions).unwrap();
    }
    assert!(
        predicted.iter().all(|&p| (2..6).contains(&p)),
        "{predicted:?}"
    );
    assert_eq!(s.generated(), &[1002, 1003, 1004, STOP]);
    assert_eq!(&s.tokens()[6..], &[50, 51, 52]);
    // The suffix is not part of the answer: its stop-free tail does not hide the canvas's.
    assert_eq!(s.final_answer_len(&[STOP]), Some(3));
    assert_eq!(s.block(), 6..6);
    // CFG's unconditional input masks the suffix with the prompt, not the canvas.
    assert_eq!(
        s.unconditional_tokens(),
        vec![MASK, MASK, 1002, 1003, 1004, STOP, MASK, MASK, MASK]
    );
}

#[test]
fn a_suffix_counts_in_the_length_and_holds_no_mask() {
    let err = Sampler::with_suffix(&[1, 2], &[3, 4], params(8, 8, 8), MASK, 11).unwrap_err();
    assert_eq!(
        err,
        SamplerError::TooLong {
            prompt_len: 2,
            gen_length: 8,
            suffix_len: 2,
            total: 12,
            max_len: 11
        }
    );
    let text = err.to_string();
    assert!(text.contains("suffix (2 tokens) = 12"), "{text}");
    assert!(Sampler::with_suffix(&[1, 2], &[3], params(8, 8, 8), MASK, 11).is_ok());
    let err = Sampler::with_suffix(&[1], &[3, MASK], params(8, 8, 8), MASK, 64).unwrap_err();
    assert_eq!(err, SamplerError::MaskInSuffix { position: 1 });
    assert!(err.to_string().contains("suffix position 1"), "{err}");
}
