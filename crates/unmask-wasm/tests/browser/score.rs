//! `score` from JavaScript: the reference's estimate of the seeded likelihood golden from
//! the seed alone (tools/make_likelihood_goldens.py draws its masks with the runtime's draw,
//! ported), the same answer given as text, a text without a prompt (rolled, it is the same
//! one-window estimate), and bad requests named.

use serde_json::{Value, json};
use unmask_goldens as goldens;
use unmask_wasm::WebEngine;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;
use wasm_bindgen_test::*;

use crate::support::{js, load, to_json};

const LIKELIHOOD: &str = include_str!("../../../../tests/fixtures/tiny/goldens/likelihood.json");

/// `engine.score(request)` awaited: its result, or the message of the `Error` it rejected
/// with.
async fn score(web: &WebEngine, request: &Value) -> Result<Value, String> {
    match JsFuture::from(web.score(js(&request.to_string()))).await {
        Ok(v) => Ok(to_json(&v)),
        Err(e) => match e.dyn_ref::<js_sys::Error>() {
            Some(e) => Err(String::from(e.message())),
            None => panic!("score rejects with an Error, not {e:?}"),
        },
    }
}

#[wasm_bindgen_test]
async fn score_gives_the_seeded_reference_estimate_and_names_bad_fields() {
    let web = load(r#"{"weights": "f32"}"#, 4099).await;
    let cases = goldens::cases(LIKELIHOOD);
    let case = cases
        .iter()
        .find(|c| c["seed"].is_u64())
        .expect("a seeded likelihood golden");
    let want = case["log_likelihood"].as_f64().unwrap();
    let request = json!({
        "ids": case["prompt"], "answers": [case["answer"], case["answer_text"]],
        "mcNum": case["samples"].as_array().unwrap().len(), "mcBatch": case["mc_batch"],
        "seed": case["seed"],
    });
    let out = score(&web, &request).await.expect("the golden scores");
    let answers = out["answers"].as_array().unwrap();
    assert_eq!(answers.len(), 2, "{out}");
    for a in answers {
        let got = a["logLikelihood"].as_f64().unwrap();
        assert!(
            (got - want).abs() <= 1e-4 * want.abs(),
            "{}: {got} against the reference's {want}",
            a["index"]
        );
        assert_eq!(a["tokens"], case["answer"].as_array().unwrap().len());
    }
    // Equal estimates: the first is the best.
    assert_eq!(out["best"], 0, "{out}");
    assert_eq!(
        out["promptTokens"],
        case["prompt"].as_array().unwrap().len()
    );
    web_sys::console::log_1(&format!("[score] {want:.4} from seed {}", case["seed"]).into());

    // No prompt: the text's own likelihood. Rolled, a text that fits the context is one
    // window drawn from the same seed, so the same estimate.
    let own = |rolling: bool| {
        json!({"ids": [], "answers": [case["answer_text"]], "mcNum": 8, "mcBatch": 8,
               "seed": 3, "rolling": rolling})
    };
    let plain = score(&web, &own(false)).await.expect("no prompt scores");
    let rolled = score(&web, &own(true)).await.expect("rolling scores");
    let (p, r) = (&plain["answers"][0], &rolled["answers"][0]);
    let value = p["logLikelihood"].as_f64().unwrap();
    assert!(value.is_finite() && value < 0.0, "{plain}");
    assert_eq!(
        p["logLikelihood"], r["logLikelihood"],
        "{plain} vs {rolled}"
    );
    assert_eq!(
        (r["windows"].as_u64(), plain["promptTokens"].as_u64()),
        (Some(1), Some(0))
    );

    for (request, start) in [
        (
            json!({"ids": [1, 2], "answers": []}),
            "answers: expected 1 to 64 answers",
        ),
        (
            json!({"ids": [1, 2]}),
            "answers: a score request needs them",
        ),
        (
            json!({"ids": [1], "answers": [[3]], "genLength": 8}),
            "genLength: not a field of a score request",
        ),
        (
            json!({"ids": [1], "answers": [[3], ""]}),
            "answers[1]: expected a non-empty text",
        ),
        (
            json!({"ids": [1], "answers": [[3]], "mcNum": 20}),
            "mcNum: expected a positive multiple",
        ),
        (
            json!({"ids": [1], "answers": [[3, 305]]}),
            "answers[0]: answer: expected token ids",
        ),
        (
            json!({"ids": [], "answers": [[3]], "cfgScale": 1}),
            "prompt: expected at least one token under cfg_scale > 0",
        ),
        (
            json!({"ids": [1], "answers": [[3]], "rolling": "yes"}),
            "rolling: expected true or false",
        ),
    ] {
        let e = score(&web, &request).await.unwrap_err();
        assert!(e.starts_with(start), "{request}: {e}");
    }
}
