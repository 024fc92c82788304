//! What the browser tests share: the tiny LLaDA and Dream fixtures and their goldens as
//! bytes in the test binary, the fixture as streamed `MemoryFiles`, JSON to and from
//! JavaScript values, and the engine loaded and called as JavaScript calls it.

use serde_json::Value;
use unmask::GenerationParams;
use unmask_goldens::{self as goldens, ids, params};
use unmask_wasm::{MemoryFiles, WebEngine};
use wasm_bindgen::JsCast;
use wasm_bindgen::JsValue;
use wasm_bindgen_futures::JsFuture;

macro_rules! fixture_file {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!("../../../../tests/fixtures/tiny/", $name)).as_slice(),
        )
    };
}

const FIXTURE: [(&str, &[u8]); 7] = [
    fixture_file!("config.json"),
    fixture_file!("generation_config.json"),
    fixture_file!("tokenizer.json"),
    fixture_file!("special_tokens_map.json"),
    fixture_file!("model.safetensors.index.json"),
    fixture_file!("model-00001-of-00002.safetensors"),
    fixture_file!("model-00002-of-00002.safetensors"),
];

const GOLDENS: &str = include_str!("../../../../tests/fixtures/tiny/goldens/generate.json");
pub(crate) const INFILL_GOLDENS: &str =
    include_str!("../../../../tests/fixtures/tiny/goldens/infill.json");
pub(crate) const ACACHE_GOLDENS: &str =
    include_str!("../../../../tests/fixtures/tiny/goldens/acache.json");
pub(crate) const DLLM_CACHE_GOLDENS: &str =
    include_str!("../../../../tests/fixtures/tiny/goldens/dllm_cache.json");

macro_rules! dream_file {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!("../../../../tests/fixtures/tiny-dream/", $name)).as_slice(),
        )
    };
}

/// The tiny Dream folder as a person would pick it (tokenizer_config.json included).
pub(crate) const DREAM: [(&str, &[u8]); 7] = [
    dream_file!("config.json"),
    dream_file!("tokenizer.json"),
    dream_file!("tokenizer_config.json"),
    dream_file!("special_tokens_map.json"),
    dream_file!("model.safetensors.index.json"),
    dream_file!("model-00001-of-00002.safetensors"),
    dream_file!("model-00002-of-00002.safetensors"),
];

pub(crate) const DREAM_GOLDENS: &str =
    include_str!("../../../../tests/fixtures/tiny-dream/goldens/generate.json");

fn files(piece: usize) -> MemoryFiles {
    MemoryFiles::new(
        FIXTURE.iter().map(|(n, b)| (n.to_string(), b.to_vec())),
        piece,
    )
}

pub(crate) fn js(json: &str) -> JsValue {
    js_sys::JSON::parse(json).unwrap()
}

/// `json` as a JavaScript object with `numbers` set on it: NaN, Infinity and exact large
/// numbers, which JSON text cannot carry.
pub(crate) fn js_with(json: &str, numbers: &[(&str, f64)]) -> JsValue {
    let obj = js(json);
    for &(key, n) in numbers {
        js_sys::Reflect::set(&obj, &key.into(), &JsValue::from_f64(n)).unwrap();
    }
    obj
}

pub(crate) fn to_json(v: &JsValue) -> Value {
    serde_json::from_str(&String::from(js_sys::JSON::stringify(v).unwrap())).unwrap()
}

/// `engine.generate(request)` awaited: its result, or the message of the `Error` it
/// rejected with (anything else it rejects with fails the test).
pub(crate) async fn generate(web: &WebEngine, request: JsValue) -> Result<Value, String> {
    match JsFuture::from(web.generate(request, None)).await {
        Ok(v) => Ok(to_json(&v)),
        Err(e) => match e.dyn_ref::<js_sys::Error>() {
            Some(e) => Err(String::from(e.message())),
            None => panic!("generate rejects with an Error, not {e:?}"),
        },
    }
}

pub(crate) async fn load(options: &str, piece: usize) -> WebEngine {
    match WebEngine::load(&mut files(piece), js(options), None).await {
        Ok(e) => e,
        Err(e) => panic!("the fixture loads: {:?}", JsValue::from(e)),
    }
}

/// The non-random golden cases: (name, prompt, params, expected prompt + canvas).
pub(crate) fn golden_cases() -> Vec<(String, Vec<u32>, GenerationParams, Vec<u32>)> {
    goldens::cases(GOLDENS)
        .iter()
        .filter(|c| c["params"]["remasking"] == "low_confidence")
        .map(|c| {
            let name = c["name"].as_str().unwrap().to_string();
            (name, ids(&c["prompt"]), params(c), ids(&c["output"]))
        })
        .collect()
}

/// The ids of the fixture tokenizer's special tokens (added tokens marked special).
pub(crate) fn special_ids() -> Vec<u32> {
    let (_, bytes) = FIXTURE
        .iter()
        .find(|(name, _)| *name == "tokenizer.json")
        .unwrap();
    let t: Value = serde_json::from_slice(bytes).unwrap();
    let ids: Vec<u32> = t["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["special"] == true)
        .map(|a| a["id"].as_u64().unwrap() as u32)
        .collect();
    assert!(
        ids.len() >= 6,
        "BOS, EOS, the header pair, EoT and the mask: {ids:?}"
    );
    ids
}

/// A greedy generation's `logprobs` and `topLogprobs` (`top` alternatives): every committed
/// position's value is at most 0 and heads its alternatives with the committed id.
pub fn assert_greedy_logprobs(result: &Value, top: usize) {
    let (ids, lps, tops) = (&result["ids"], &result["logprobs"], &result["topLogprobs"]);
    let mut committed = 0;
    for (i, lp) in lps.as_array().expect("logprobs").iter().enumerate() {
        let Some(lp) = lp.as_f64() else { continue };
        assert!(lp <= 0.0, "position {i}: {lp}");
        assert_eq!(
            tops[i].as_array().map(Vec::len),
            Some(top),
            "position {i}: {tops}"
        );
        assert_eq!(
            tops[i][0][0], ids[i],
            "position {i}: the chosen id heads them"
        );
        assert_eq!(tops[i][0][1].as_f64(), Some(lp), "position {i}");
        committed += 1;
    }
    assert!(committed > 0, "{result}");
}
