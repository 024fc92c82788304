//! The request checks: defaults, every bad field named, both families.

use super::*;

fn limits() -> Limits {
    Limits {
        max_tokens: 256,
        default_max_tokens: 64,
        default_cache: CacheMode::BicacheDual,
        family: Family::MaskedDiffusion,
    }
}

fn masked(spec: &JobSpec) -> &MaskedSampling {
    match &spec.sampling {
        Sampling::Masked(m) => m,
        Sampling::Gemma(g) => panic!("a masked-diffusion request, found {g:?}"),
    }
}

fn chat(body: &str) -> Result<JobSpec, ApiError> {
    ChatRequest::parse(body.as_bytes())?.check(&limits(), "tiny")
}

#[test]
fn defaults_follow_the_cli() {
    let spec =
        chat(r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"q"}]}"#)
            .unwrap();
    assert_eq!(masked(&spec).params.gen_length, 64);
    assert_eq!(masked(&spec).params.block_length, 32);
    assert_eq!(masked(&spec).params.steps, 64);
    assert_eq!(masked(&spec).params.temperature, 0.0);
    assert_eq!(masked(&spec).cache, CacheMode::BicacheDual);
    assert_eq!(
        spec.input,
        Input::Chat(vec![Message::system("s"), Message::user("q")])
    );
    let spec = chat(r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_tokens":48,"cache":"none"}"#).unwrap();
    assert_eq!(masked(&spec).params.block_length, 48);
    assert_eq!(masked(&spec).cache, CacheMode::None);
    assert_eq!(spec.input, Input::Chat(vec![Message::user("ab")]));
    assert_eq!(
        (masked(&spec).params.top_p, masked(&spec).params.top_k),
        (None, None)
    );
    let cut = |body| {
        let p = masked(&chat(body).unwrap()).params.clone();
        (p.top_p, p.top_k)
    };
    assert_eq!(
        cut(r#"{"messages":[{"role":"user","content":"q"}],"top_p":0.9,"top_k":20}"#),
        (Some(0.9), Some(20))
    );
    assert_eq!(
        cut(r#"{"messages":[{"role":"user","content":"q"}],"top_p":1,"top_k":-1}"#),
        (Some(1.0), Some(u32::MAX))
    );
}

#[test]
fn every_bad_field_is_named() {
    let cases = [
        (r#"{"messages":[]}"#, "messages"),
        (r#"{"model":"x"}"#, "messages"),
        (r#"{"messages":"hi"}"#, "messages"),
        (
            r#"{"messages":[{"role":"tool","content":"x"}]}"#,
            "messages[0].role",
        ),
        (
            r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
            "messages[0].content[0]",
        ),
        (
            r#"{"messages":[{"role":"system","content":"x"}]}"#,
            "messages",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"max_tokens":0}"#,
            "max_tokens",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"max_tokens":100000}"#,
            "max_tokens",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"max_tokens":"many"}"#,
            "max_tokens",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"temperature":-1}"#,
            "temperature",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"top_p":1.5}"#,
            "top_p",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"top_k":-3}"#,
            "top_k",
        ),
        (r#"{"messages":[{"role":"user","content":"q"}],"n":0}"#, "n"),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"n":65}"#,
            "n",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"n":1.5}"#,
            "n",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"max_tokens":64,"block_length":48}"#,
            "block_length",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"max_tokens":64,"steps":3}"#,
            "steps",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"threshold":1.5}"#,
            "threshold",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"cache":"lru"}"#,
            "cache",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"remasking":"top"}"#,
            "remasking",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"alg":"greedy"}"#,
            "remasking",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"alg_temp":-1}"#,
            "alg_temp",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"eps":1.5}"#,
            "eps",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"stop":["a","b","c","d","e"]}"#,
            "stop",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"logprobs":true}"#,
            "logprobs",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function"}]}"#,
            "tools",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"stream_options":{"include_usage":true}}"#,
            "stream_options",
        ),
    ];
    for (body, field) in cases {
        let e = chat(body).expect_err(body);
        assert_eq!(e.status, 400, "{body}: {e}");
        assert_eq!(e.param.as_deref(), Some(field), "{body}: {e}");
        assert!(
            e.message.contains(field.split('[').next().unwrap()),
            "{body}: {e}"
        );
    }
    let e = chat(r#"{"messages":[{"role":"user","content":"q"}],"model":"gpt-4"}"#).unwrap_err();
    assert_eq!((e.status.as_u16(), e.code), (404, Some("model_not_found")));
    let e = chat("{not json").unwrap_err();
    assert_eq!(e.status, 400);
    assert!(e.message.contains("not valid JSON"), "{e}");
}

/// `n` choices: each a request of its own with the seed moved on by its index (choice 0 is
/// the request itself), for both families.
#[test]
fn choices_take_consecutive_seeds() {
    let spec = chat(r#"{"messages":[{"role":"user","content":"q"}],"n":3,"seed":7}"#).unwrap();
    assert_eq!(spec.choices, 3);
    let seeds: Vec<u64> = (0..3)
        .map(|i| {
            let choice = spec.choice(i);
            assert_eq!(choice.choices, 1);
            masked(&choice).params.seed
        })
        .collect();
    assert_eq!(seeds, [7, 8, 9]);
    assert_eq!(
        chat(r#"{"messages":[{"role":"user","content":"q"}]}"#)
            .unwrap()
            .choices,
        1
    );
    let gemma = Limits {
        family: Family::DiffusionGemma,
        ..limits()
    };
    let spec = ChatRequest::parse(br#"{"messages":[{"role":"user","content":"q"}],"n":2}"#)
        .unwrap()
        .check(&gemma, "tiny")
        .unwrap();
    match (&spec.choice(0).sampling, &spec.choice(1).sampling) {
        (Sampling::Gemma(a), Sampling::Gemma(b)) => assert_eq!((a.seed, b.seed), (0, 1)),
        other => panic!("DiffusionGemma choices, found {other:?}"),
    }
}

#[test]
fn completion_prompts() {
    let check = |body: &str| CompletionRequest::parse(body.as_bytes())?.check(&limits(), "tiny");
    assert_eq!(
        check(r#"{"prompt":"hi"}"#).unwrap().input,
        Input::Text("hi".into())
    );
    assert_eq!(
        check(r#"{"prompt":["hi"]}"#).unwrap().input,
        Input::Text("hi".into())
    );
    assert_eq!(
        check(r#"{"prompt":[1,2,3]}"#).unwrap().input,
        Input::Ids(vec![1, 2, 3])
    );
    for (body, field) in [
        (r#"{"prompt":["a","b"]}"#, "prompt"),
        (r#"{"prompt":""}"#, "prompt"),
        (r#"{"prompt":"a","echo":true}"#, "echo"),
        (r#"{"prompt":"a","best_of":3}"#, "best_of"),
        (r#"{"prompt":"a","suffix":"z"}"#, "suffix"),
    ] {
        assert_eq!(
            check(body).unwrap_err().param.as_deref(),
            Some(field),
            "{body}"
        );
    }
}

/// Numbers are checked as the f32 the sampler uses, and the error says the value given.
#[test]
fn numbers_are_checked_in_the_precision_they_are_used_in() {
    for (body, field, needles) in [
        (
            r#"{"messages":[{"role":"user","content":"q"}],"top_p":1e-300}"#,
            "top_p",
            &["found 1e-300", "single precision"][..],
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"threshold":1e-300}"#,
            "threshold",
            &["found 1e-300"][..],
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"alg_temp":1e300}"#,
            "alg_temp",
            &["found 1e300", "single precision"][..],
        ),
    ] {
        let e = chat(body).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(field), "{body}");
        for n in needles {
            assert!(e.message.contains(n), "{n} not in {}", e.message);
        }
    }
    // The smallest positive f32 itself is taken.
    let spec = chat(r#"{"messages":[{"role":"user","content":"q"}],"top_p":1e-45}"#).unwrap();
    let p = &masked(&spec).params;
    assert!(p.top_p.is_some_and(|p| p > 0.0));
}

/// A DiffusionGemma server takes max_tokens, steps and seed, and names every
/// masked-diffusion setting it is given.
#[test]
fn diffusion_gemma_requests() {
    let gemma = Limits {
        family: Family::DiffusionGemma,
        ..limits()
    };
    let check = |body: &str| ChatRequest::parse(body.as_bytes())?.check(&gemma, "tiny");
    let sampling = |body: &str| match check(body).unwrap().sampling {
        Sampling::Gemma(g) => g,
        Sampling::Masked(m) => panic!("{body}: a DiffusionGemma request, found {m:?}"),
    };
    let q = r#""messages":[{"role":"user","content":"q"}]"#;
    assert_eq!(
        sampling(&format!("{{{q}}}")),
        GemmaSampling {
            max_new_tokens: None,
            max_denoising_steps: None,
            seed: 0
        }
    );
    assert_eq!(
        sampling(&format!(
            r#"{{{q},"max_tokens":40,"steps":12,"seed":7,"stream":true,"stop":["x"]}}"#
        )),
        GemmaSampling {
            max_new_tokens: Some(40),
            max_denoising_steps: Some(12),
            seed: 7
        }
    );
    for field in [
        "temperature",
        "top_p",
        "block_length",
        "cache",
        "remasking",
        "threshold",
        "full_canvas",
    ] {
        let value = match field {
            "cache" | "remasking" => "\"none\"",
            "full_canvas" => "true",
            "block_length" => "8",
            _ => "0.5",
        };
        let e = check(&format!(r#"{{{q},"{field}":{value}}}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(field), "{e}");
        assert!(e.message.contains("not a DiffusionGemma setting"), "{e}");
    }
    for (body, field) in [
        (format!(r#"{{{q},"steps":5000}}"#), "steps"),
        (format!(r#"{{{q},"steps":0}}"#), "steps"),
        (format!(r#"{{{q},"max_tokens":1000}}"#), "max_tokens"),
    ] {
        let e = check(&body).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(field), "{body}: {e}");
    }
}
