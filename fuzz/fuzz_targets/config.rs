//! config.json, optionally followed by a NUL and a generation_config.json, read as the
//! engine reads a model folder's configuration; a config that parses is then used the way
//! loading uses it (tensor plan, parameter count, special tokens).
#![no_main]

use libfuzzer_sys::fuzz_target;
use unmask_core::config::ModelConfig;
use unmask_core::tokenizer::SpecialTokens;
use unmask_fuzz::split_nul;

fuzz_target!(|data: &[u8]| {
    let (config, generation) = split_nul(data);
    let Ok(config) = std::str::from_utf8(config) else {
        return;
    };
    // Also the decoded-value entry point, which the browser build uses.
    if let Ok(value) = serde_json::from_str::<serde_json::Value>(config) {
        let _ = ModelConfig::from_json_value(&value);
    }
    let Ok(mut parsed) = ModelConfig::from_json_str(config) else {
        return;
    };
    if let Some(generation) = generation.and_then(|g| std::str::from_utf8(g).ok()) {
        match parsed.with_generation_config(generation, "generation_config.json") {
            Ok(with_bos) => parsed = with_bos,
            Err(_) => return,
        }
    }
    let _ = (parsed.head_dim(), parsed.n_kv_groups());
    let _ = parsed.parameter_count();
    let _ = parsed.tensor_specs();
    let _ = SpecialTokens::from_config(&parsed);
});
