//! The reference sampler's goldens (tests/fixtures/tiny/goldens/generate.json, written by
//! tools/llada_ref.py) as the engine's types, so that the sampler's, the engine's and the
//! browser's tests read the same cases the same way. Goldens are test data: a malformed
//! case panics.

pub mod dgemma;

use serde_json::Value;

use unmask_core::sampler::{GenerationParams, Remasking, Schedule};

/// The cases of a goldens file, from its text.
pub fn cases(text: &str) -> Vec<Value> {
    let v: Value = serde_json::from_str(text).expect("goldens are JSON");
    v["cases"].as_array().expect("goldens have cases").clone()
}

/// A case's generation parameters: LLaDA's (`remasking`) or Dream's (`alg`).
pub fn params(case: &Value) -> GenerationParams {
    let p = &case["params"];
    if let Some(alg) = p["alg"].as_str() {
        return GenerationParams {
            gen_length: p["gen_length"].as_u64().unwrap() as usize,
            steps: p["steps"].as_u64().unwrap() as usize,
            block_length: p["block_length"].as_u64().unwrap() as usize,
            temperature: p["temperature"].as_f64().unwrap() as f32,
            remasking: Remasking::parse(alg).unwrap_or_else(|| panic!("unknown alg {alg}")),
            threshold: p["threshold"].as_f64().map(|t| t as f32),
            seed: p["seed"].as_u64().unwrap(),
            round_confidence_bf16: false,
            schedule: Schedule::Dream {
                eps: p["eps"].as_f64().unwrap(),
            },
            alg_temp: p["alg_temp"].as_f64().unwrap_or(0.0) as f32,
            top_p: p["top_p"].as_f64().map(|t| t as f32),
            top_k: p["top_k"].as_u64().map(|k| k as u32),
            ..GenerationParams::default()
        };
    }
    GenerationParams {
        gen_length: p["gen_length"].as_u64().unwrap() as usize,
        steps: p["steps"].as_u64().unwrap() as usize,
        block_length: p["block_length"].as_u64().unwrap() as usize,
        temperature: p["temperature"].as_f64().unwrap() as f32,
        remasking: {
            let name = p["remasking"].as_str().unwrap();
            Remasking::parse(name).unwrap_or_else(|| panic!("unknown remasking {name}"))
        },
        cfg_scale: p["cfg_scale"].as_f64().unwrap() as f32,
        threshold: p["threshold"].as_f64().map(|t| t as f32),
        logits_eos_inf: p["logits_eos_inf"].as_bool().unwrap(),
        confidence_eos_eot_inf: p["confidence_eos_eot_inf"].as_bool().unwrap(),
        seed: p["seed"].as_u64().unwrap(),
        // The numpy reference ranks unrounded confidences; ours stay unrounded to compare.
        round_confidence_bf16: false,
        ..GenerationParams::default()
    }
}

/// A JSON array of token ids (a prompt, an output, a step's committed positions).
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}
