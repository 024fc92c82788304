//! The mapping's checks: requests, options, events and results as the page sees them.

use super::*;
use unmask::{CacheMode, DecodeMode, Remasking, StepEvent, StepRecord};

/// The tiny fixture's shape (tests/fixtures/tiny/config.json).
const LIMITS: Limits = Limits {
    context: 256,
    vocab: 320,
    layers: 2,
};

fn parse(v: Value) -> Result<Request, String> {
    request(&v, &LIMITS)
}

#[test]
fn a_chat_request_maps_every_field() {
    let r = parse(json!({
        "system": "Be terse.", "prompt": "Hi", "genLength": 32, "steps": 16,
        "blockLength": 16, "temperature": 0.5, "remasking": "random", "cfgScale": 1.5,
        "threshold": 0.9, "logitsEosInf": true, "confidenceEosEotInf": true, "seed": 7,
        "cache": "bicache-dual", "prefixLen": 5, "depth": 1, "refreshEvery": 4,
        "decode": "raw"
    }))
    .unwrap();
    let Prompt::Chat(m) = &r.prompt else {
        panic!("a chat")
    };
    assert_eq!(
        (m.len(), m[0].role, m[1].content.as_str()),
        (2, Role::System, "Hi")
    );
    let p = &r.params;
    assert_eq!(
        (p.gen_length, p.steps, p.block_length, p.seed),
        (32, 16, 16, 7)
    );
    assert_eq!(
        (p.temperature, p.cfg_scale, p.threshold),
        (0.5, 1.5, Some(0.9))
    );
    assert!(p.logits_eos_inf && p.confidence_eos_eot_inf);
    assert_eq!(p.remasking, Remasking::Random);
    assert_eq!(r.cache, CacheMode::BicacheDual);
    assert_eq!(
        (r.prefix_len, r.depth, r.refresh_every),
        (Some(5), Some(1), 4)
    );
    assert_eq!(r.decode, DecodeMode::Raw);
}

#[test]
fn logit_bias_and_penalties_map_with_their_errors() {
    let r = parse(json!({
        "ids": [1, 2], "logitBias": {"5": -100, "300": 2}, "presencePenalty": 0.5,
        "frequencyPenalty": 0.25
    }))
    .unwrap();
    let b = &r.params.bias;
    assert_eq!(b.ids, vec![(5, -100.0), (300, 2.0)]);
    assert_eq!((b.presence_penalty, b.frequency_penalty), (0.5, 0.25));
    let err = |v: Value| parse(v).err().unwrap();
    let e = err(json!({"ids": [1], "logitBias": {"320": 1}}));
    assert!(
        e.starts_with("logitBias: expected token ids") && e.contains("vocabulary size 320"),
        "{e}"
    );
    let e = err(json!({"ids": [1], "frequencyPenalty": 4}));
    assert!(
        e.starts_with("frequencyPenalty: expected a number from -2 to 2"),
        "{e}"
    );
    let r = parse(json!({"ids": [1], "repetitionPenalty": 1.25, "minP": 0.05})).unwrap();
    assert_eq!(
        (r.params.bias.repetition_penalty, r.params.min_p),
        (1.25, Some(0.05))
    );
    let e = err(json!({"ids": [1], "repetitionPenalty": 0}));
    assert!(
        e.starts_with("repetitionPenalty: expected a number from 0.01 to 100"),
        "{e}"
    );
    let e = err(json!({"ids": [1], "minP": 1.5}));
    assert!(e.starts_with("minP: expected a number from 0 to 1"), "{e}");
}

#[test]
fn defaults_and_errors() {
    let r = parse(json!({"ids": [1, 2, 3], "genLength": 8})).unwrap();
    assert!(matches!(r.prompt, Prompt::Ids(ref v) if v == &[1, 2, 3]));
    assert_eq!((r.params.steps, r.params.block_length), (8, 8));
    assert_eq!(r.cache, CacheMode::None);
    let err = |v: Value| parse(v).err().unwrap();
    assert!(err(json!({"prompt": "x", "cache": "lru"})).starts_with("cache: expected one of"));
    assert!(err(json!({"prompt": "x", "steps": "many"})).contains("steps"));
    assert!(err(json!({})).contains("prompt"));
    assert!(err(json!([1, 2])).contains("must be an object"));
    assert!(engine_options(&json!({"weights": "q3"})).is_err());
    assert!(
        engine_options(&json!({"kv": "bf16"}))
            .unwrap_err()
            .contains("kv")
    );
    assert_eq!(
        engine_options(&json!({"kv": "f16"})).unwrap().kv_dtype,
        unmask_gpu::DType::F16
    );
    let o = engine_options(&json!({"weights": "q4", "embedWeights": "f16"})).unwrap();
    assert_eq!(
        (o.weight_format, o.embed_format),
        (WeightFormat::Q4, Some(WeightFormat::F16Native))
    );
}

/// Each bad field of a request: the error names the field, says what it expected and
/// shows what it found (the number as given, never wrapped or rounded).
#[test]
fn every_bad_number_is_rejected_naming_its_field() {
    let two_32 = 1u64 << 32;
    let cases: Vec<(Value, &str, String)> = vec![
        // Too large for the context, and past 2^32, which a 32-bit usize would wrap.
        (
            json!({"genLength": 1_000_000_000}),
            "genLength",
            "1000000000".into(),
        ),
        (
            json!({"genLength": two_32}),
            "genLength",
            two_32.to_string(),
        ),
        (
            json!({"genLength": two_32 + 32}),
            "genLength",
            (two_32 + 32).to_string(),
        ),
        (json!({"genLength": 256}), "genLength", "256".into()),
        (json!({"genLength": 0}), "genLength", "0".into()),
        (json!({"genLength": -8}), "genLength", "-8".into()),
        (json!({"genLength": 31.5}), "genLength", "31.5".into()),
        (json!({"genLength": 1e21}), "genLength", "1e+21".into()),
        (json!({"genLength": "32"}), "genLength", "\"32\"".into()),
        (json!({"genLength": true}), "genLength", "true".into()),
        (
            json!({"genLength": 32, "steps": 1_000_000_000}),
            "steps",
            "1000000000".into(),
        ),
        (
            json!({"genLength": 32, "steps": two_32}),
            "steps",
            two_32.to_string(),
        ),
        (json!({"genLength": 32, "steps": 33}), "steps", "33".into()),
        (json!({"genLength": 32, "steps": 0}), "steps", "0".into()),
        (json!({"genLength": 32, "steps": -1}), "steps", "-1".into()),
        (
            json!({"genLength": 32, "steps": 2.5}),
            "steps",
            "2.5".into(),
        ),
        (
            json!({"genLength": 32, "blockLength": 64}),
            "blockLength",
            "64".into(),
        ),
        (
            json!({"genLength": 32, "blockLength": 0}),
            "blockLength",
            "0".into(),
        ),
        (
            json!({"genLength": 32, "blockLength": 5}),
            "blockLength",
            "5".into(),
        ),
        (
            json!({"genLength": 32, "blockLength": two_32}),
            "blockLength",
            two_32.to_string(),
        ),
        // 8 blocks of 4: the steps are shared out evenly, so 12 cannot be.
        (
            json!({"genLength": 32, "blockLength": 4, "steps": 12}),
            "steps",
            "12".into(),
        ),
        (json!({"temperature": -1}), "temperature", "-1".into()),
        // Finite as f64, infinite as the f32 the sampler uses.
        (
            json!({"temperature": 1e300}),
            "temperature",
            "1e+300".into(),
        ),
        (json!({"cfgScale": -0.5}), "cfgScale", "-0.5".into()),
        (json!({"threshold": 0}), "threshold", "0".into()),
        (json!({"threshold": 1.5}), "threshold", "1.5".into()),
        (json!({"seed": -1}), "seed", "-1".into()),
        (json!({"seed": 0.5}), "seed", "0.5".into()),
        (
            json!({"seed": MAX_SAFE_INTEGER + 1}),
            "seed",
            (MAX_SAFE_INTEGER + 1).to_string(),
        ),
        (json!({"prefixLen": 256}), "prefixLen", "256".into()),
        (
            json!({"prefixLen": two_32}),
            "prefixLen",
            two_32.to_string(),
        ),
        (json!({"depth": 3}), "depth", "3".into()),
        (json!({"refreshEvery": 0}), "refreshEvery", "0".into()),
        (
            json!({"refreshEvery": two_32}),
            "refreshEvery",
            two_32.to_string(),
        ),
    ];
    for (fields, field, found) in cases {
        let mut obj = json!({"prompt": "What is 2 + 3?"});
        for (k, v) in fields.as_object().unwrap() {
            obj[k] = v.clone();
        }
        let e = parse(obj.clone())
            .err()
            .unwrap_or_else(|| panic!("{obj} is refused"));
        assert!(
            e.starts_with(&format!("{field}: expected ")),
            "{obj}: names {field}: {e}"
        );
        assert!(
            e.ends_with(&format!("found {found}")),
            "{obj}: shows what it found: {e}"
        );
    }
}

#[test]
fn bad_prompts_are_rejected_naming_the_item() {
    let err = |v: Value| parse(v).err().unwrap();
    let e = err(json!({"ids": [1, 320]}));
    assert!(
        e.starts_with("ids[1]: expected a token id from 0 to 319"),
        "{e}"
    );
    assert!(err(json!({"ids": [1, -2]})).starts_with("ids[1]: "));
    assert!(err(json!({"ids": [1.5]})).starts_with("ids[0]: "));
    assert!(err(json!({"ids": [1, 4294967297u64]})).starts_with("ids[1]: "));
    let e = err(json!({"ids": []}));
    assert!(
        e.starts_with("ids: expected 1 to 255 token ids") && e.ends_with("found 0"),
        "{e}"
    );
    let e = err(json!({"ids": vec![1; 256]}));
    assert!(e.ends_with("found 256"), "{e}");
    assert!(err(json!({"ids": "1 2 3"})).starts_with("ids: expected an array"));
    let e = err(json!({"messages": [{"role": "user", "content": "hi"}, {"role": "robot"}]}));
    assert!(
        e.starts_with("messages[1].role: expected") && e.ends_with("found \"robot\""),
        "{e}"
    );
    let e = err(json!({"messages": [{"content": "hi"}]}));
    assert!(
        e.starts_with("messages[0].role: ") && e.ends_with("found nothing"),
        "{e}"
    );
    let e = err(json!({"messages": [{"role": "user", "content": 5}]}));
    assert!(
        e.starts_with("messages[0].content: expected a string") && e.ends_with("found 5"),
        "{e}"
    );
    assert!(err(json!({"prompt": 7})).starts_with("prompt: expected a string"));
}

#[test]
fn the_bounds_admit_their_edges() {
    // The whole context less one prompt token, in one block, one token a step.
    let r = parse(
        json!({"ids": [1], "genLength": 255, "blockLength": 255, "steps": 255,
        "seed": MAX_SAFE_INTEGER, "depth": 2, "prefixLen": 0, "threshold": 1,
        "refreshEvery": u32::MAX}),
    )
    .unwrap();
    assert_eq!(
        (r.params.gen_length, r.params.steps, r.params.seed),
        (255, 255, MAX_SAFE_INTEGER)
    );
    assert_eq!(r.refresh_every, u32::MAX as usize);
    fit_prompt(&r, 1, &LIMITS).unwrap();
    // One step, the fewest; threshold decoding takes any step count up to genLength.
    parse(json!({"prompt": "x", "genLength": 8, "steps": 1, "blockLength": 8})).unwrap();
    parse(
        json!({"prompt": "x", "genLength": 8, "steps": 3, "blockLength": 4,
        "threshold": 0.9}),
    )
    .unwrap();
}

#[test]
fn the_prompt_and_the_canvas_fit_the_context_together() {
    let r = parse(json!({"prompt": "x", "genLength": 200, "blockLength": 8})).unwrap();
    fit_prompt(&r, 56, &LIMITS).unwrap();
    let e = fit_prompt(&r, 57, &LIMITS).unwrap_err();
    assert_eq!(
        e,
        "genLength: expected at most 199 (the model's context of 256 tokens less the \
         prompt's 57), found 200"
    );
    let e = fit_prompt(&r, 256, &LIMITS).unwrap_err();
    assert!(
        e.starts_with("prompt: expected fewer than 256 tokens") && e.ends_with("found 256"),
        "{e}"
    );
    assert!(
        fit_prompt(&r, 0, &LIMITS)
            .unwrap_err()
            .starts_with("prompt: ")
    );
    let r = parse(json!({"prompt": "x", "genLength": 8, "prefixLen": 12})).unwrap();
    let e = fit_prompt(&r, 10, &LIMITS).unwrap_err();
    assert_eq!(
        e,
        "prefixLen: expected at most the prompt's 10 tokens, found 12"
    );
    fit_prompt(&r, 12, &LIMITS).unwrap();
}

/// Infilling's suffix: text or ids (checked like the prompt's), never both, and it takes its
/// room in the context with the prompt and the canvas.
#[test]
fn a_suffix_is_text_or_ids_and_fits_with_the_prompt() {
    let s = |v: Value| suffix(&v, &LIMITS);
    assert_eq!(s(json!({"prompt": "x"})), Ok(None));
    assert_eq!(s(json!({"prompt": "x", "suffix": ""})), Ok(None));
    assert_eq!(
        s(json!({"prompt": "x", "suffix": " end."})),
        Ok(Some(SuffixInput::Text(" end.".into())))
    );
    assert_eq!(
        s(json!({"ids": [1], "suffixIds": [4, 5]})),
        Ok(Some(SuffixInput::Ids(vec![4, 5])))
    );
    for (v, want) in [
        (json!({"suffix": 3}), "suffix: expected a string, found 3"),
        (
            json!({"suffix": "a", "suffixIds": [1]}),
            "suffix and suffixIds: give one of them",
        ),
        (
            json!({"suffixIds": [1, 320]}),
            "suffixIds[1]: expected a token id from 0 to 319 (the model's vocabulary), found 320",
        ),
        (
            json!({"suffixIds": []}),
            "suffixIds: expected 1 to 255 token ids (the model's context of 256 tokens, less \
             one for the answer), found 0",
        ),
    ] {
        assert_eq!(s(v.clone()), Err(want.to_string()), "{v}");
    }
    let mut r = parse(json!({"prompt": "x", "genLength": 200, "blockLength": 8})).unwrap();
    r.suffix = vec![7; 6];
    fit_prompt(&r, 50, &LIMITS).unwrap();
    let e = fit_prompt(&r, 51, &LIMITS).unwrap_err();
    assert_eq!(
        e,
        "genLength: expected at most 199 (the model's context of 256 tokens less the \
         prompt's 51 and the suffix's 6), found 200"
    );
}

#[test]
fn load_options_are_bounded() {
    let two_32 = 1u64 << 32;
    let e = engine_options(&json!({"cacheTokens": two_32})).unwrap_err();
    assert!(
        e.starts_with("cacheTokens: expected") && e.ends_with(&format!("found {two_32}")),
        "{e}"
    );
    assert!(engine_options(&json!({"cacheTokens": -1})).is_err());
    let e = engine_options(&json!({"cacheBytes": MAX_SAFE_INTEGER + 1})).unwrap_err();
    assert!(e.starts_with("cacheBytes: expected"), "{e}");
    let o = engine_options(&json!({"cacheTokens": 4096, "cacheBytes": two_32})).unwrap();
    assert_eq!(
        (o.cache_budget.max_tokens, o.cache_budget.max_bytes),
        (4096, two_32)
    );
    let e = device_options(&json!({"maxBindingBytes": 100})).unwrap_err();
    assert!(
        e.starts_with("maxBindingBytes: expected a whole number from 4096"),
        "{e}"
    );
    assert!(device_options(&json!({"maxBindingBytes": 150_000})).is_ok());
    assert!(
        device_options(&json!({"shaderF16": "no"}))
            .unwrap_err()
            .starts_with("shaderF16: ")
    );
    assert_eq!(
        device_options(&json!({"maxBindingBytes": 49152, "shaderF16": false})).unwrap(),
        DeviceOptions {
            max_binding_bytes: Some(49152),
            shader_f16: false
        }
    );
}

/// Infilling: a mask inside the prompt is predicted and committed like the canvas's;
/// its position is before the canvas, where `position - prompt_len` would wrap.
#[test]
fn a_step_that_fills_a_prompt_mask_reports_it_apart() {
    const MASK: u32 = 99;
    let record = StepRecord {
        step: 0,
        block: 0,
        committed: vec![(1, 7), (3, 9)],
    };
    // Prompt [5, mask -> 7, 6], canvas [9, mask].
    let canvas = [5, 7, 6, 9, MASK];
    let event = StepEvent {
        record: &record,
        global_step: 1,
        canvas: &canvas,
        prompt_len: 3,
        suffix_len: 0,
        mask_id: MASK,
        elapsed_s: 0.5,
        rows: &[1, 3, 4],
        predictions: &[(7, 0.9), (9, 0.75), (8, 0.25)],
        logprobs: None,
    };
    let mut tracker = CanvasTracker::new(2);
    let v = tracker.event(&event, None);
    assert_eq!(v["committed"], json!([[0, 9]]));
    assert_eq!(v["infilled"], json!([[1, 7]]));
    assert_eq!(v["canvas"], json!([9, MASK]));
    assert_eq!(v["masked"], json!([1]));
    assert_eq!(v["confidence"], json!([0.75, 0.25]));
    assert_eq!(v["predicted"], json!([null, "8"]));
    assert_eq!(v["pieces"], json!(["9", null]));
}
