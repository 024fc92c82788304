//! Replays the commit schedule of tests/fixtures/tiny/goldens/generate.json through the
//! sampler without a model. Each golden step's committed tokens are final, so the golden
//! output gives every prediction's token. Random-remasking cases use the stored random
//! confidences, so their positions are the sampler's own decisions; the other cases mark
//! the golden step's positions confident, which checks the quotas, the threshold rule, and
//! the block and step order (the model's confidences are covered by the GPU end-to-end test).

use serde_json::Value;
use unmask_core::sampler::{GenerationParams, Remasking, Sampler};

const GOLDENS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/tiny/goldens/generate.json"
);

fn params(p: &Value) -> GenerationParams {
    GenerationParams {
        gen_length: p["gen_length"].as_u64().unwrap() as usize,
        steps: p["steps"].as_u64().unwrap() as usize,
        block_length: p["block_length"].as_u64().unwrap() as usize,
        temperature: p["temperature"].as_f64().unwrap() as f32,
        remasking: match p["remasking"].as_str().unwrap() {
            "low_confidence" => Remasking::LowConfidence,
            "random" => Remasking::Random,
            other => panic!("unknown remasking {other}"),
        },
        cfg_scale: p["cfg_scale"].as_f64().unwrap() as f32,
        threshold: p["threshold"].as_f64().map(|t| t as f32),
        logits_eos_inf: p["logits_eos_inf"].as_bool().unwrap(),
        confidence_eos_eot_inf: p["confidence_eos_eot_inf"].as_bool().unwrap(),
        seed: p["seed"].as_u64().unwrap(),
        // The goldens rank float64 softmax probabilities.
        round_confidence_bf16: false,
    }
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn golden_commit_schedules_replay() {
    let text = std::fs::read_to_string(GOLDENS).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let cases = goldens["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let p = params(&case["params"]);
        let mask_id = case["params"]["mask_id"].as_u64().unwrap() as u32;
        let prompt = u32s(&case["prompt"]);
        let output = u32s(&case["output"]);
        let steps = case["steps"].as_array().unwrap();
        let random = p.remasking == Remasking::Random;
        let mut sampler = Sampler::new(&prompt, p, mask_id, 256).unwrap();

        for (i, golden) in steps.iter().enumerate() {
            assert!(!sampler.is_done(), "{name}: done before step {i}");
            let positions = u32s(&golden["committed"]);
            let rows = sampler.rows_to_predict();
            let tokens: Vec<u32> = rows.iter().map(|&r| output[r as usize]).collect();
            let confidences: Vec<f32> = if random {
                let all = &case["random_confidences"][i];
                rows.iter()
                    .map(|&r| all[r as usize].as_f64().unwrap() as f32)
                    .collect()
            } else {
                rows.iter()
                    .map(|r| if positions.contains(r) { 0.9 } else { 0.1 })
                    .collect()
            };
            let record = sampler
                .commit_with_confidences(&tokens, &confidences)
                .unwrap();
            assert_eq!(
                (record.block, record.step),
                (
                    golden["block"].as_u64().unwrap() as usize,
                    golden["step"].as_u64().unwrap() as usize
                ),
                "{name}: step {i}"
            );
            let committed: Vec<u32> = record.committed.iter().map(|&(p, _)| p).collect();
            assert_eq!(committed, positions, "{name}: step {i}");
            let written: Vec<u32> = record.committed.iter().map(|&(_, t)| t).collect();
            assert_eq!(written, u32s(&golden["tokens"]), "{name}: step {i}");
            assert_eq!(sampler.global_step(), i + 1);
        }
        assert!(sampler.is_done(), "{name}: not done after the golden steps");
        assert_eq!(sampler.tokens(), output.as_slice(), "{name}");
    }
}
