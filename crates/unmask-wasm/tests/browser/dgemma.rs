//! DiffusionGemma in the browser: the tiny fixture (tests/fixtures/tiny-dgemma, made with
//! the transformers reference), given to `Engine` like any folder, is recognised from its
//! config.json; its encoder, commit and decoder logits are within 1e-3 of the reference's
//! float32 goldens and every recorded generation replays step for step, as the native tests
//! check (tests/all/dgemma.rs); from JavaScript, a chat request answers, reports its steps,
//! stores its system turn and takes it from the store the next time; settings of the other
//! families are refused by name.

use serde_json::Value;
use unmask_core::checkpoint::Checkpoint;
use unmask_goldens::dgemma::{RunCanvas, generation_cases};
use unmask_goldens::ids;
use unmask_wasm::{MemoryFiles, WebEngine};
use wasm_bindgen::closure::Closure;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use wasm_bindgen_test::*;

use crate::{generate, js, to_json};

macro_rules! dgemma_file {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!("../../../../tests/fixtures/tiny-dgemma/", $name)).as_slice(),
        )
    };
}

const FOLDER: [(&str, &[u8]); 7] = [
    dgemma_file!("config.json"),
    dgemma_file!("generation_config.json"),
    dgemma_file!("tokenizer.json"),
    dgemma_file!("tokenizer_config.json"),
    dgemma_file!("model.safetensors.index.json"),
    dgemma_file!("model-00001-of-00002.safetensors"),
    dgemma_file!("model-00002-of-00002.safetensors"),
];

const GENERATIONS: &str =
    include_str!("../../../../tests/fixtures/tiny-dgemma/goldens/generate.json");
const LOGITS_META: &str =
    include_str!("../../../../tests/fixtures/tiny-dgemma/goldens/logits.json");
const LOGITS: &[u8] =
    include_bytes!("../../../../tests/fixtures/tiny-dgemma/goldens/logits.safetensors");

async fn load() -> WebEngine {
    let mut files = MemoryFiles::new(
        FOLDER.iter().map(|(n, b)| (n.to_string(), b.to_vec())),
        4099,
    );
    match WebEngine::load(&mut files, js(r#"{"weights": "f32"}"#), None).await {
        Ok(e) => e,
        Err(e) => panic!("the DiffusionGemma fixture loads: {:?}", JsValue::from(e)),
    }
}

/// Largest difference relative to the largest reference value.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-12);
    got.iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

#[wasm_bindgen_test]
async fn diffusion_gemma_logits_and_generations_match_the_reference() {
    let web = load().await;
    assert!(web.engine().is_none(), "not a masked-diffusion engine");
    let engine = web.dgemma().expect("config.json names DiffusionGemma");
    let (model, ctx) = (engine.model(), engine.ctx());
    assert_eq!(ctx.info.backend, wgpu::Backend::BrowserWebGpu);
    let v = model.cfg.vocab_size;
    let goldens = Checkpoint::from_bytes(vec![("logits".into(), LOGITS.to_vec())], None).unwrap();
    let golden = |name: &str, rows: usize| {
        let mut out = vec![0.0; rows * v];
        goldens
            .tensor(name, &[rows, v])
            .unwrap()
            .read_f32(0, &mut out);
        out
    };
    let meta: Value = serde_json::from_str(LOGITS_META).unwrap();
    let cases = meta["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 8);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut cache = model.new_cache(ctx, 64).unwrap();
        let prompt = ids(&case["prompt"]);
        // Encoder cases have no canvas.
        let canvas = if case["canvas"].is_null() {
            Vec::new()
        } else {
            ids(&case["canvas"])
        };
        let got = match case["pass"].as_str().unwrap() {
            "encoder" => model.encode_async(ctx, &mut cache, &prompt, true).await,
            "commit" => {
                model.append(ctx, &mut cache, &prompt).unwrap();
                model.encode_async(ctx, &mut cache, &canvas, true).await
            }
            _ => {
                model.append(ctx, &mut cache, &prompt).unwrap();
                for commit in case["commits"].as_array().unwrap() {
                    model.append(ctx, &mut cache, &ids(commit)).unwrap();
                }
                let sc = case["self_conditioning"]
                    .as_str()
                    .map(|n| golden(n, canvas.len()));
                model
                    .decode_async(ctx, &cache, &canvas, sc.as_deref())
                    .await
                    .map(Some)
            }
        };
        let got = got.unwrap_or_else(|e| panic!("{name}: {e}")).unwrap();
        let err = relative_error(&got, &golden(name, got.len() / v));
        assert!(err < 1e-3, "{name}: relative error {err}");
        console_log!("[check] DiffusionGemma {name} in the browser: {err:.1e}");
    }
    let mut early_stops = 0;
    for case in generation_cases(GENERATIONS) {
        let mut draws = case.draws.clone();
        let (got, _) = model
            .generate_async(
                ctx,
                &case.prompt,
                None,
                &case.params,
                &mut draws,
                0,
                &mut |_| std::ops::ControlFlow::Continue(()),
            )
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let canvases: Vec<RunCanvas<'_>> = got
            .canvases
            .iter()
            .map(|c| RunCanvas {
                steps: &c.steps,
                output: &c.output,
            })
            .collect();
        early_stops += case.assert_run(&canvases, &got.sequence);
    }
    assert!(early_stops > 0, "some canvas stopped early");
}

/// From JavaScript: `info` names the family, a chat request answers with its steps reported,
/// the system turn is stored and then reused (same answer), and settings the family does
/// not have are refused by name.
#[wasm_bindgen_test]
async fn diffusion_gemma_answers_from_javascript() {
    let web = load().await;
    let info = to_json(&web.info());
    assert_eq!(info["family"], "diffusion_gemma", "{info}");
    assert_eq!(info["experts"], 8);
    let steps = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let sink = steps.clone();
    let on_step = Closure::<dyn FnMut(JsValue)>::new(move |v: JsValue| {
        sink.borrow_mut().push(to_json(&v));
    });
    let request = r#"{"system": "You answer in one word.", "prompt": "Name a colour.",
        "genLength": 16, "steps": 6, "seed": 3}"#;
    let promise = web.generate(
        js(request),
        Some(on_step.as_ref().unchecked_ref::<js_sys::Function>().clone()),
    );
    let first = to_json(&JsFuture::from(promise).await.expect("the request runs"));
    assert_eq!(first["prefix"]["use"], "stored", "{first}");
    assert_eq!(first["ids"].as_array().unwrap().len(), 16);
    for c in first["canvases"].as_array().unwrap() {
        let lps = c["logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), c["output"].as_array().unwrap().len(), "{c}");
        assert!(
            lps.iter().all(|l| l.as_f64().is_some_and(|l| l <= 0.0)),
            "{c}"
        );
    }
    {
        let events = steps.borrow();
        let reported: u64 = first["canvases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["steps"].as_u64().unwrap())
            .sum();
        assert_eq!(events.len() as u64, reported, "one event per step");
        let last = events.last().unwrap();
        assert_eq!(last["canvas"].as_array().unwrap().len(), 16);
        assert_eq!(
            last["masked"].as_array().unwrap().len() + last["committed"].as_array().unwrap().len(),
            16,
            "every position is accepted or renoised: {last}"
        );
    }
    let again = generate(&web, js(request)).await.unwrap();
    assert_eq!(again["prefix"]["use"], "hit", "{again}");
    assert_eq!(
        again["ids"], first["ids"],
        "a stored system turn changes nothing"
    );
    assert_eq!(again["store"]["hits"], 1);
    let e = generate(&web, js(r#"{"prompt": "Hi", "cache": "bicache"}"#))
        .await
        .unwrap_err();
    assert!(e.starts_with("cache: not a DiffusionGemma setting"), "{e}");
    let e = generate(&web, js(r#"{"prompt": "Hi", "genLength": 100000}"#))
        .await
        .unwrap_err();
    assert!(e.starts_with("genLength: expected a whole number"), "{e}");
    // Scoring is defined for masked models only.
    let e = JsFuture::from(web.score(js(r#"{"prompt": "Hi", "answers": [" red"]}"#)))
        .await
        .expect_err("DiffusionGemma refuses score");
    let message = String::from(e.dyn_ref::<js_sys::Error>().unwrap().message());
    assert!(message.contains("DiffusionGemma's decoder"), "{message}");
    // `onStep` returning false stops the generation: the promise rejects saying so, and
    // the engine (its store back in place) answers the next request as before.
    let stop = js_sys::Function::new_with_args("event", "return event.step < 2;");
    let e = JsFuture::from(web.generate(js(request), Some(stop)))
        .await
        .expect_err("a stopped generation rejects");
    let message = String::from(e.dyn_ref::<js_sys::Error>().unwrap().message());
    assert!(
        message.contains("cancelled after 2 denoising steps"),
        "{message}"
    );
    let after = generate(&web, js(request)).await.unwrap();
    assert_eq!(after["ids"], first["ids"]);
    assert_eq!(web.clear_cache(), 1);
}
