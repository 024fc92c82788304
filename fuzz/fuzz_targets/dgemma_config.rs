//! A DiffusionGemma folder's config.json, optionally followed by a NUL and its
//! generation_config.json, read as `DgemmaModel`/`DgemmaEngine` read them; a config that
//! parses is then used the way loading and `unmask info` use it (the tensor list, the
//! parameter counts).
#![no_main]

use libfuzzer_sys::fuzz_target;
use unmask_core::config::{DiffusionGemmaConfig, entropy_bound_params};
use unmask_fuzz::split_nul;

fuzz_target!(|data: &[u8]| {
    let (config, generation) = split_nul(data);
    if let Some(generation) = generation.and_then(|g| std::str::from_utf8(g).ok()) {
        let _ = entropy_bound_params(generation, "generation_config.json");
    }
    let Ok(config) = std::str::from_utf8(config) else {
        return;
    };
    let Ok(parsed) = DiffusionGemmaConfig::from_json_str(config, "config.json") else {
        return;
    };
    let _ = parsed.tensor_specs();
    let _ = parsed.parameter_counts();
});
