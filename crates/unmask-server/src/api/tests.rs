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
        other => panic!("a masked-diffusion request, found {other:?}"),
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
            r#"{"messages":[{"role":"user","content":"q"}],"logprobs":2}"#,
            "logprobs",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"logprobs":true,"top_logprobs":21}"#,
            "top_logprobs",
        ),
        (
            r#"{"messages":[{"role":"user","content":"q"}],"top_logprobs":3}"#,
            "top_logprobs",
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
        (Sampling::Gemma(a), Sampling::Gemma(b)) => {
            assert_eq!((a.seed, b.seed), (0, 1));
            assert!(
                a.share_prompt && b.share_prompt,
                "choices share their prompt"
            );
        }
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
        (r#"{"prompt":"a","suffix":3}"#, "suffix"),
    ] {
        assert_eq!(
            check(body).unwrap_err().param.as_deref(),
            Some(field),
            "{body}"
        );
    }
}

/// OpenAI's `suffix` infills a completion's canvas before it; chats and DiffusionGemma
/// refuse it by name.
#[test]
fn a_completion_suffix_is_infilled_before() {
    let check = |body: &str, limits: &Limits| {
        CompletionRequest::parse(body.as_bytes())?.check(limits, "tiny")
    };
    let spec = check(r#"{"prompt":"a","suffix":" z.","n":2}"#, &limits()).unwrap();
    assert_eq!(masked(&spec).suffix.as_deref(), Some(" z."));
    assert_eq!(masked(&spec.choice(1)).suffix.as_deref(), Some(" z."));
    for body in [
        r#"{"prompt":"a","suffix":""}"#,
        r#"{"prompt":"a","suffix":null}"#,
    ] {
        assert_eq!(
            masked(&check(body, &limits()).unwrap()).suffix,
            None,
            "{body}"
        );
    }
    let e = chat(r#"{"messages":[{"role":"user","content":"q"}],"suffix":"z"}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("suffix"));
    assert!(e.message.contains("/v1/completions"), "{e}");
    let gemma = Limits {
        family: Family::DiffusionGemma,
        ..limits()
    };
    let e = check(r#"{"prompt":"a","suffix":"z"}"#, &gemma).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("suffix"));
    assert!(e.message.contains("DiffusionGemma"), "{e}");
    assert!(check(r#"{"prompt":"a","suffix":""}"#, &gemma).is_ok());
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
        other => panic!("{body}: a DiffusionGemma request, found {other:?}"),
    };
    let q = r#""messages":[{"role":"user","content":"q"}]"#;
    assert_eq!(
        sampling(&format!("{{{q}}}")),
        GemmaSampling {
            max_new_tokens: None,
            max_denoising_steps: None,
            seed: 0,
            share_prompt: false,
            logit_bias: Vec::new(),
        }
    );
    assert_eq!(
        sampling(&format!(
            r#"{{{q},"max_tokens":40,"steps":12,"seed":7,"stream":true,"stop":["x"],"logit_bias":{{"9":-100}}}}"#
        )),
        GemmaSampling {
            max_new_tokens: Some(40),
            max_denoising_steps: Some(12),
            seed: 7,
            share_prompt: false,
            logit_bias: vec![(9, -100.0)],
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

/// Request bodies a client may send, mutated at random (values swapped for extremes and
/// other types, characters cut, keys repeated): parsing and checking answer each with a
/// request or a named error, and never panic, for both families and both endpoints.
#[test]
fn mutated_bodies_never_panic() {
    let seeds = [
        r#"{"model":"tiny","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"q"}]}],"max_tokens":64,"steps":32,"block_length":32,"temperature":0.5,"top_p":0.9,"top_k":20,"seed":3,"n":2,"stop":["x","y"],"stream":true,"stream_options":{"include_usage":true,"include_canvas":true},"cache":"acache","affix":"s","anchor_ratio":0.25,"threshold":0.9,"remasking":"low_confidence","alg_temp":0.1,"eps":0.001}"#,
        r#"{"messages":[{"role":"user","content":"q"}],"cache":"dllm-cache","prompt_interval":10,"response_interval":3,"refresh_ratio":0.5,"verify_pick":"v","pin_block":true,"full_canvas":false,"max_completion_tokens":16,"logprobs":false,"tool_choice":"none","response_format":{"type":"text"}}"#,
        r#"{"prompt":"Bella city","max_tokens":32,"steps":32,"block_length":32,"seed":18446744073709551615}"#,
        r#"{"prompt":[1,2,3],"max_tokens":8,"n":1,"stop":"."}"#,
    ];
    let extremes = [
        "-1",
        "0",
        "1e309",
        "-1e309",
        "1e-400",
        "18446744073709551616",
        "4294967296",
        "9007199254740993",
        "0.5",
        "-0",
        "null",
        "true",
        r#""x""#,
        r#""""#,
        "[]",
        "{}",
        "[null]",
        r#"{"type":"image_url"}"#,
    ];
    let masked = limits();
    let gemma = Limits {
        family: Family::DiffusionGemma,
        ..limits()
    };
    // xorshift64*: a fixed sequence, so a failure repeats.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |n: usize| {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    };
    const ROUNDS: usize = 40_000;
    let mut answered = (0, 0);
    for round in 0..ROUNDS {
        let mut body = seeds[round % seeds.len()].to_string();
        for _ in 0..1 + next(3) {
            // Value starts: after a ':' or ',' or '[' outside strings is close enough for
            // mutations; quoting may break, which is a case too.
            let starts: Vec<usize> = body
                .char_indices()
                .filter(|&(_, c)| c == ':' || c == '[' || c == ',')
                .map(|(i, _)| i + 1)
                .collect();
            let at = starts[next(starts.len())];
            let end = body[at..]
                .find([',', '}', ']'])
                .map_or(body.len(), |e| at + e);
            match next(4) {
                0 | 1 => body.replace_range(at..end, extremes[next(extremes.len())]),
                2 => {
                    let cut = (at + 1 + next(8)).min(body.len());
                    if body.is_char_boundary(cut) {
                        body.replace_range(at..cut, "");
                    }
                }
                _ => {
                    let key = [
                        "\"n\"",
                        "\"steps\"",
                        "\"seed\"",
                        "\"max_tokens\"",
                        "\"stop\"",
                    ][next(5)];
                    body.insert_str(1, &format!("{key}:{},", extremes[next(extremes.len())]));
                }
            }
        }
        for limits in [&masked, &gemma] {
            let chat = ChatRequest::parse(body.as_bytes()).and_then(|r| r.check(limits, "tiny"));
            let completion =
                CompletionRequest::parse(body.as_bytes()).and_then(|r| r.check(limits, "tiny"));
            for result in [chat, completion] {
                match result {
                    Ok(spec) => {
                        answered.0 += 1;
                        assert!(
                            (1..=MOST_CHOICES as usize).contains(&spec.choices),
                            "{body}"
                        );
                    }
                    Err(e) => {
                        answered.1 += 1;
                        assert!(!e.message.is_empty(), "{body}: an error without a message");
                    }
                }
            }
        }
    }
    eprintln!(
        "[check] {ROUNDS} mutated bodies: {} requests accepted, {} refused with a message",
        answered.0, answered.1
    );
    assert!(answered.0 > 100 && answered.1 > 100, "{answered:?}");
}

#[test]
fn logprobs_in_both_spellings() {
    let chat_lp = |body: &str| chat(body).map(|s| s.logprobs);
    let q = r#""messages":[{"role":"user","content":"q"}]"#;
    assert_eq!(chat_lp(&format!("{{{q}}}")).unwrap(), None);
    assert_eq!(
        chat_lp(&format!(r#"{{{q},"logprobs":false}}"#)).unwrap(),
        None
    );
    assert_eq!(
        chat_lp(&format!(r#"{{{q},"logprobs":true}}"#)).unwrap(),
        Some(0)
    );
    assert_eq!(
        chat_lp(&format!(r#"{{{q},"logprobs":true,"top_logprobs":0}}"#)).unwrap(),
        Some(0)
    );
    // OpenAI's neutral values pass without asking for anything.
    assert_eq!(
        chat_lp(&format!(r#"{{{q},"logprobs":null,"top_logprobs":0}}"#)).unwrap(),
        None
    );
    let completion = |body: &str| {
        CompletionRequest::parse(body.as_bytes())?
            .check(&limits(), "tiny")
            .map(|s| s.logprobs)
    };
    assert_eq!(
        completion(r#"{"prompt":"p","logprobs":0}"#).unwrap(),
        Some(0)
    );
    assert_eq!(
        completion(r#"{"prompt":"p","logprobs":false}"#).unwrap(),
        None
    );
    assert_eq!(
        completion(r#"{"prompt":"p","logprobs":null}"#).unwrap(),
        None
    );
    for (body, field) in [
        (r#"{"prompt":"p","logprobs":true}"#, "logprobs"),
        (r#"{"prompt":"p","logprobs":6}"#, "logprobs"),
        (
            r#"{"prompt":"p","logprobs":0,"top_logprobs":1}"#,
            "top_logprobs",
        ),
    ] {
        let e = completion(body).expect_err(body);
        assert_eq!(e.param.as_deref(), Some(field), "{body}: {e}");
    }
    assert_eq!(
        chat_lp(&format!(r#"{{{q},"logprobs":true,"top_logprobs":20}}"#)).unwrap(),
        Some(20)
    );
    assert_eq!(
        completion(r#"{"prompt":"p","logprobs":5}"#).unwrap(),
        Some(5)
    );
    // DiffusionGemma reports no alternatives: asking for them is refused by name.
    let gemma = Limits {
        family: Family::DiffusionGemma,
        ..limits()
    };
    let body = format!(r#"{{{q},"logprobs":true,"top_logprobs":2}}"#);
    let e = ChatRequest::parse(body.as_bytes())
        .and_then(|r| r.check(&gemma, "tiny"))
        .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("top_logprobs"), "{e}");
    assert!(e.message.contains("found 2"), "{e}");
    let body = format!(r#"{{{q},"logprobs":true}}"#);
    let spec = ChatRequest::parse(body.as_bytes()).and_then(|r| r.check(&gemma, "tiny"));
    assert_eq!(spec.unwrap().logprobs, Some(0));
}
