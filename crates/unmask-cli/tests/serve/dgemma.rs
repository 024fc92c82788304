//! `unmask serve` on a DiffusionGemma folder (the test fixture): answers equal to `unmask
//! generate`'s, the system turn encoded once per server, the stream's text and canvases,
//! and the masked-diffusion settings refused by name.

use super::{Server, unmask, workspace};

const SYSTEM: &str = "You answer in one word.";

fn fixture() -> std::path::PathBuf {
    workspace().join("tests/fixtures/tiny-dgemma")
}

fn chat(user: &str, extra: serde_json::Value) -> String {
    let mut body = serde_json::json!({
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user},
        ],
        "max_tokens": 32, "steps": 8, "seed": 3,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body.to_string()
}

impl Server {
    fn post(&self, body: &str) -> (u16, String) {
        self.request(
            "POST",
            "/v1/chat/completions",
            &["Content-Type: application/json"],
            body,
        )
    }
}

/// The `data:` payloads of a server-sent event stream, `[DONE]` left out.
fn events(body: &str) -> Vec<serde_json::Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON event"))
        .collect()
}

#[test]
fn a_diffusion_gemma_server_answers_as_generate_and_encodes_a_shared_system_turn_once() {
    let model = fixture();
    let server = Server::start_model(&model, &[], None);
    let whole = |user: &str| {
        let (status, reply) = server.post(&chat(user, serde_json::json!({})));
        assert_eq!(status, 200, "{reply}\n{}", server.stderr());
        let v: serde_json::Value = serde_json::from_str(&reply).expect("JSON reply");
        v
    };
    let first = whole("Name a colour.");
    let report = &first["unmask"];
    assert_eq!(report["family"], "diffusion_gemma", "{report}");
    assert_eq!(report["prefix"]["use"], "stored", "{report}");
    let content = first["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let tokens = first["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=32).contains(&tokens), "{first}");
    let reason = first["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(reason == "stop" || reason == "length", "{first}");
    // The same request from the CLI.
    let out = unmask()
        .args(["generate", "--model", model.to_str().unwrap()])
        .args(["--system", SYSTEM, "--prompt", "Name a colour."])
        .args(["--gen-length", "32", "--steps", "8", "--seed", "3"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8_lossy(&out.stdout);
    assert_eq!(content.trim(), generated.trim(), "served vs generated");
    // Another question after the same system prompt reuses its K/V; the same question gives
    // the same answer from the stored turn.
    let other = whole("Name an animal.");
    assert_eq!(other["unmask"]["prefix"]["use"], "hit", "{other}");
    assert!(other["unmask"]["prefix"]["reused_tokens"].as_u64() > Some(0));
    let again = whole("Name a colour.");
    assert_eq!(again["choices"][0]["message"]["content"], content.as_str());
    assert_eq!(again["unmask"]["batch"], 1, "alone in its passes");
    // Three requests at once are denoised together (one decoder pass per step) and answer
    // as each did alone.
    let questions = ["Name a colour.", "Name an animal.", "Name a colour."];
    let together: Vec<serde_json::Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = questions.iter().map(|q| scope.spawn(|| whole(q))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (q, v) in questions.iter().zip(&together) {
        let alone = if q.contains("animal") { &other } else { &first };
        assert_eq!(
            v["choices"][0]["message"]["content"], alone["choices"][0]["message"]["content"],
            "{q}"
        );
    }
    let widest = together
        .iter()
        .filter_map(|v| v["unmask"]["batch"].as_u64())
        .max();
    assert!(
        widest >= Some(2),
        "requests sent at once share passes: {together:?}"
    );
    // Canvases of 16 tokens: max_tokens 20 generates two and answers with at most 20.
    let (status, reply) = server.post(&chat(
        "Name a colour.",
        serde_json::json!({"max_tokens": 20}),
    ));
    assert_eq!(status, 200, "{reply}");
    let cut: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert!(
        cut["usage"]["completion_tokens"].as_u64() <= Some(20),
        "{cut}"
    );

    // Streamed: the text chunks add up to the whole answer; every step shows its canvas.
    let (status, body) = server.post(&chat(
        "Name a colour.",
        serde_json::json!({"stream": true, "stream_options": {"include_canvas": true, "include_usage": true}}),
    ));
    assert_eq!(status, 200, "{body}");
    let events = events(&body);
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content, "streamed vs whole");
    let canvases: Vec<&serde_json::Value> = events.iter().filter_map(|e| e.get("canvas")).collect();
    let steps: u64 = first["unmask"]["canvases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["steps"].as_u64().unwrap())
        .sum();
    assert_eq!(canvases.len() as u64, steps, "one canvas event per step");
    let last = canvases.last().unwrap();
    assert_eq!(last["step"].as_u64(), Some(steps));
    assert!(
        events
            .iter()
            .any(|e| e["usage"]["completion_tokens"].as_u64() == Some(tokens)),
        "{body}"
    );

    // LLaDA's settings are refused by name, as are impossible lengths.
    for (extra, field) in [
        (serde_json::json!({"cache": "bicache-dual"}), "cache"),
        (serde_json::json!({"temperature": 0.7}), "temperature"),
        (serde_json::json!({"block_length": 8}), "block_length"),
        (serde_json::json!({"steps": 100_000}), "steps"),
        (serde_json::json!({"max_tokens": 5000}), "max_tokens"),
    ] {
        let (status, reply) = server.post(&chat("Name a colour.", extra.clone()));
        assert_eq!(status, 400, "{extra}: {reply}");
        let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
        assert_eq!(v["error"]["param"], field, "{extra}: {reply}");
    }
    // Scoring is defined for masked models only.
    let (status, reply) = server.request(
        "POST",
        "/v1/loglikelihood",
        &["Content-Type: application/json"],
        r#"{"prompt": "Name a colour.", "continuation": " red"}"#,
    );
    assert_eq!(status, 400, "{reply}");
    assert!(reply.contains("DiffusionGemma's decoder"), "{reply}");
    let (_, metrics) = server.request("GET", "/metrics", &[], "");
    let ok = metrics
        .lines()
        .find_map(|l| l.strip_prefix("unmask_requests_total{outcome=\"ok\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert_eq!(ok, Some(8.0), "{metrics}");
    // The stored system turn is the K/V the server keeps: its bytes and their share of the
    // store's budget, the gauge routers read.
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    assert_eq!(
        value("unmask_prefix_store_entries "),
        Some(1.0),
        "{metrics}"
    );
    let bytes = value("unmask_prefix_store_bytes ").expect("store bytes");
    assert!(bytes > 0.0, "{metrics}");
    let usage = value("vllm:kv_cache_usage_perc ").expect("K/V usage");
    assert!(usage > 0.0 && usage <= 1.0, "{metrics}");
}

#[test]
fn flags_a_diffusion_gemma_server_cannot_honour_are_refused_before_loading() {
    let model = fixture();
    for (flag, value) in [("--cache", "none"), ("--kv-events", "tcp://127.0.0.1:1")] {
        let out = unmask()
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
            .args([flag, value])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag}: {err}");
        assert!(
            err.contains(flag) && err.contains("DiffusionGemma"),
            "{err}"
        );
    }
}
