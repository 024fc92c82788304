//! tokenizer.json: loaded, its special tokens checked against the tiny fixture's config,
//! a short text with chat markup encoded and decoded both ways, and ids the model can emit
//! but the tokenizer may not know decoded.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use unmask_core::config::ModelConfig;
use unmask_core::tokenizer::{DecodeMode, SpecialTokens, Tokenizer};
use unmask_fuzz::{FIXTURE_CONFIG, config};

static TINY: LazyLock<ModelConfig> = LazyLock::new(|| config(FIXTURE_CONFIG));

const TEXT: &str = "Hello, wörld! <|eot_id|> 12+30=42\n\t<|mdm_mask|>  ü";

fuzz_target!(|data: &[u8]| {
    let Ok(tokenizer) = Tokenizer::from_bytes(data) else {
        return;
    };
    let _ = SpecialTokens::resolve(Some(&tokenizer), &TINY);
    let _ = tokenizer.vocab_size();
    if let Ok(ids) = tokenizer.encode(TEXT) {
        for mode in [DecodeMode::Clean, DecodeMode::Raw] {
            let _ = tokenizer.decode(&ids, mode);
        }
    }
    // Embedding rows past the vocabulary, the special ids, and ids no model has.
    let ids = [0, 1, 255, 300, 301, 305, 319, 320, 100_000, u32::MAX];
    for mode in [DecodeMode::Clean, DecodeMode::Raw] {
        let _ = tokenizer.decode(&ids, mode);
    }
    for &id in &ids {
        let _ = (tokenizer.is_special(id), tokenizer.id_to_token(id));
    }
});
