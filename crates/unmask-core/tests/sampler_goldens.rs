//! Replays the commit schedule of tests/fixtures/tiny/goldens/generate.json through the
//! sampler without a model. Each golden step's committed tokens are final, so the golden
//! output gives every prediction's token. Random-remasking cases use the stored random
//! confidences, so their positions are the sampler's own decisions; the other cases mark
//! the golden step's positions confident, which checks the quotas, the threshold rule, and
//! the block and step order (the model's confidences are covered by the GPU end-to-end test).

use unmask_core::sampler::{Remasking, Sampler};
use unmask_goldens::{self as goldens, ids};

const GOLDENS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/tiny/goldens/generate.json"
);

#[test]
fn golden_commit_schedules_replay() {
    let cases = goldens::cases(&std::fs::read_to_string(GOLDENS).unwrap());
    assert!(!cases.is_empty());
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let p = goldens::params(case);
        let mask_id = case["params"]["mask_id"].as_u64().unwrap() as u32;
        let prompt = ids(&case["prompt"]);
        let output = ids(&case["output"]);
        let steps = case["steps"].as_array().unwrap();
        let random = p.remasking == Remasking::Random;
        let mut sampler = Sampler::new(&prompt, p, mask_id, 256).unwrap();

        for (i, golden) in steps.iter().enumerate() {
            assert!(!sampler.is_done(), "{name}: done before step {i}");
            let positions = ids(&golden["committed"]);
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
            assert_eq!(written, ids(&golden["tokens"]), "{name}: step {i}");
            assert_eq!(sampler.global_step(), i + 1);
        }
        assert!(sampler.is_done(), "{name}: not done after the golden steps");
        assert_eq!(sampler.tokens(), output.as_slice(), "{name}");
    }
}
