//! In headless Chromium (WebGPU on SwiftShader): the tiny fixture, streamed from memory in
//! odd-sized pieces like a download, generates exactly the reference goldens the native
//! tests check (tests/generate_goldens.rs), through the same async engine; and the
//! JavaScript-facing `generate` reports every step of the canvas.
//!
//! Run: `scripts/test-web.sh`, or `CHROMEDRIVER=/usr/bin/chromedriver cargo test --target
//! wasm32-unknown-unknown -p unmask-wasm` from crates/unmask-wasm (webdriver.json there
//! holds the Chromium flags).
#![cfg(target_arch = "wasm32")]

use std::cell::RefCell;
use std::rc::Rc;

use serde_json::Value;
use unmask::{GenerationParams, Request};
use unmask_core::goldens::{self, ids, params};
use unmask_wasm::{MemoryFiles, WebEngine};
use wasm_bindgen::JsCast;
use wasm_bindgen::JsValue;
use wasm_bindgen::closure::Closure;
use wasm_bindgen_futures::JsFuture;
use wasm_bindgen_test::*;

wasm_bindgen_test_configure!(run_in_browser);

macro_rules! fixture_file {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!("../../../tests/fixtures/tiny/", $name)).as_slice(),
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

const GOLDENS: &str = include_str!("../../../tests/fixtures/tiny/goldens/generate.json");

fn files(piece: usize) -> MemoryFiles {
    MemoryFiles::new(
        FIXTURE.iter().map(|(n, b)| (n.to_string(), b.to_vec())),
        piece,
    )
}

fn js(json: &str) -> JsValue {
    js_sys::JSON::parse(json).unwrap()
}

async fn load(options: &str, piece: usize) -> WebEngine {
    match WebEngine::load(&mut files(piece), js(options), None).await {
        Ok(e) => e,
        Err(e) => panic!("the fixture loads: {:?}", JsValue::from(e)),
    }
}

/// The non-random golden cases: (name, prompt, params, expected prompt + canvas).
fn golden_cases() -> Vec<(String, Vec<u32>, GenerationParams, Vec<u32>)> {
    goldens::cases(GOLDENS)
        .iter()
        .filter(|c| c["params"]["remasking"] == "low_confidence")
        .map(|c| {
            let name = c["name"].as_str().unwrap().to_string();
            (name, ids(&c["prompt"]), params(c), ids(&c["output"]))
        })
        .collect()
}

#[wasm_bindgen_test]
async fn the_tiny_fixture_generates_the_native_goldens() {
    let web = load(r#"{"weights": "f32"}"#, 4099).await;
    let engine = web.engine();
    assert_eq!(engine.ctx.info.backend, wgpu::Backend::BrowserWebGpu);
    web_sys::console::log_1(&engine.ctx.describe().into());
    let cases = golden_cases();
    assert_eq!(cases.len(), 7, "every non-random golden case");
    for (name, prompt, params, want) in cases {
        let request = Request::ids(prompt.clone()).with_params(params);
        let out = engine
            .generate_async(&request, &mut |_| {})
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut got = prompt;
        got.extend(&out.ids);
        assert_eq!(got, want, "{name}: tokens differ from the reference");
        web_sys::console::log_1(&format!("[golden] {name}: {} tokens equal", out.ids.len()).into());
    }
}

#[wasm_bindgen_test]
async fn weights_split_over_small_bindings_give_the_same_tokens() {
    // 48 KiB bindings split the embedding and LM head into chunks, as 128 MiB bindings
    // split LLaDA-8B's (and still hold the activations).
    let web = load(r#"{"weights": "f32", "maxBindingBytes": 49152}"#, 1 << 20).await;
    let engine = web.engine();
    assert!(engine.model.weights.embedding.chunks.len() > 1);
    let (name, prompt, params, want) = golden_cases().remove(0);
    let out = engine
        .generate_async(
            &Request::ids(prompt.clone()).with_params(params),
            &mut |_| {},
        )
        .await
        .unwrap();
    let mut got = prompt;
    got.extend(&out.ids);
    assert_eq!(got, want, "{name}: chunked weights change the tokens");
}

#[wasm_bindgen_test]
async fn generate_from_javascript_reports_every_step() {
    let web = load("{}", 1 << 20).await;
    let events: Rc<RefCell<Vec<Value>>> = Rc::default();
    let sink = events.clone();
    let on_step = Closure::<dyn FnMut(JsValue)>::new(move |v: JsValue| {
        let text = js_sys::JSON::stringify(&v).unwrap();
        sink.borrow_mut()
            .push(serde_json::from_str(&String::from(text)).unwrap());
    });
    let request = js(r#"{"system": "You are terse.", "prompt": "What is 2 + 3?",
        "genLength": 16, "steps": 8, "blockLength": 8, "cache": "bicache", "depth": 1}"#);
    let promise = web.generate(
        request,
        Some(on_step.as_ref().unchecked_ref::<js_sys::Function>().clone()),
    );
    let result = JsFuture::from(promise).await.expect("generation succeeds");
    let result: Value =
        serde_json::from_str(&String::from(js_sys::JSON::stringify(&result).unwrap())).unwrap();
    let events = events.borrow().clone();
    assert_eq!(events.len(), 8, "one event per step");
    let masked: Vec<usize> = events
        .iter()
        .map(|e| e["masked"].as_array().unwrap().len())
        .collect();
    assert!(
        masked.windows(2).all(|w| w[1] < w[0]),
        "masks fill in: {masked:?}"
    );
    assert_eq!(*masked.last().unwrap(), 0);
    let last = events.last().unwrap();
    assert_eq!(last["canvas"], result["ids"]);
    assert!(
        last["confidence"]
            .as_array()
            .unwrap()
            .iter()
            .all(Value::is_f64)
    );
    assert_eq!(result["cache"], "bicache");
    assert_eq!(result["bicache"]["hit"], false);
    assert_eq!(result["bicache"]["depth"], 1);
    assert_eq!(result["store"]["misses"], 1);
    // The same system prompt again: the shared entry is found.
    let again = js(r#"{"system": "You are terse.", "prompt": "And 4 + 4?",
        "genLength": 16, "steps": 8, "blockLength": 8, "cache": "bicache", "depth": 1}"#);
    let result = JsFuture::from(web.generate(again, None)).await.unwrap();
    let result: Value =
        serde_json::from_str(&String::from(js_sys::JSON::stringify(&result).unwrap())).unwrap();
    assert_eq!(result["bicache"]["hit"], true, "{result}");
    assert_eq!(result["store"]["hits"], 1);
}
