//! `POST /v1/loglikelihood`: the estimates `unmask score` gives for the same prompt,
//! continuations and seed (ids, and a chat prompt with text continuations), the best one
//! named, and bad requests refused by field.

use serde_json::{Value, json};

use unmask_core::likelihood::window_seed;

use super::super::unmask;
use super::Server;

fn post(server: &Server, body: &Value) -> (u16, Value) {
    let (status, reply) = server.request(
        "POST",
        "/v1/loglikelihood",
        &["Content-Type: application/json"],
        &body.to_string(),
    );
    let v = serde_json::from_str(&reply)
        .unwrap_or_else(|e| panic!("{e}: {reply}\n{}", server.stderr()));
    (status, v)
}

/// `unmask score ... --json`'s estimates, in the order the answers were given.
fn cli_estimates(model: &str, args: &[&str], labels: &[&str]) -> Vec<f64> {
    let out = unmask()
        .args(["score", "--model", model, "--json"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let answers = v["answers"].as_array().unwrap();
    labels
        .iter()
        .map(|label| {
            let a = answers.iter().find(|a| a["answer"] == *label).unwrap();
            a["log_likelihood"].as_f64().unwrap()
        })
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-4 * a.abs().max(1.0)
}

#[test]
fn scores_answer_as_unmask_score_and_bad_requests_name_their_field() {
    let model = super::super::workspace().join("models/tiny");
    let dir = model.to_str().unwrap();
    let server = Server::start(&["--max-queue", "4"]);
    // Ids: two continuations after a prompt of ids.
    let body = json!({
        "prompt": [300, 5, 6, 7], "continuations": [[10, 11, 12], [40, 41]],
        "mc_num": 8, "mc_batch": 4, "seed": 2,
    });
    let (status, v) = post(&server, &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "loglikelihood");
    let data = v["data"].as_array().unwrap();
    let got: Vec<f64> = data
        .iter()
        .map(|d| d["log_likelihood"].as_f64().unwrap())
        .collect();
    let want = cli_estimates(
        dir,
        &[
            "--prompt-ids",
            "300,5,6,7",
            "--answer-ids",
            "10,11,12",
            "--answer-ids",
            "40,41",
            "--mc-num",
            "8",
            "--mc-batch",
            "4",
            "--seed",
            "2",
        ],
        &["10,11,12", "40,41"],
    );
    assert!(
        got.iter().zip(&want).all(|(g, w)| close(*g, *w)),
        "{got:?} against {want:?}"
    );
    assert_eq!(
        (&data[0]["tokens"], &data[1]["tokens"]),
        (&json!(3), &json!(2))
    );
    let best = if got[0] >= got[1] { 0 } else { 1 };
    assert_eq!(v["best"], best);
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(v["usage"]["continuation_tokens"], 5);
    assert_eq!(v["unmask"]["sequences"], 16);

    // `greedy`: the canvas `generate` decodes at temperature 0, one token per step, is
    // greedy; the same with its first token changed is not.
    let out = unmask()
        .args([
            "generate",
            "--model",
            dir,
            "--prompt-ids",
            "300,5,6,7",
            "--json",
        ])
        .args([
            "--gen-length",
            "3",
            "--steps",
            "3",
            "--block-length",
            "3",
            "--full-canvas",
        ])
        .args(["--cache", "none"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated: Value = serde_json::from_slice(&out.stdout).unwrap();
    let canvas: Vec<u64> = generated["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(canvas.len(), 3, "{generated}");
    let mut other = canvas.clone();
    other[0] = if other[0] == 10 { 11 } else { 10 };
    let body = json!({
        "prompt": [300, 5, 6, 7], "continuations": [canvas, other], "mc_num": 4,
        "greedy": true,
    });
    let (status, v) = post(&server, &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["data"][0]["is_greedy"], true, "{v}");
    assert_eq!(v["data"][1]["is_greedy"], false, "{v}");

    // A chat prompt (ending with the assistant's header) and text continuations.
    let body = json!({
        "messages": [{"role": "system", "content": "Alice: Oslo."},
                     {"role": "user", "content": "Which city?"}],
        "continuations": ["#### Oslo", "#### Rome"], "mc_num": 16,
    });
    let (status, v) = post(&server, &body);
    assert_eq!(status, 200, "{v}");
    let got: Vec<f64> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["log_likelihood"].as_f64().unwrap())
        .collect();
    let want = cli_estimates(
        dir,
        &[
            "--system",
            "Alice: Oslo.",
            "--prompt",
            "Which city?",
            "--answer",
            "#### Oslo",
            "--answer",
            "#### Rome",
            "--mc-num",
            "16",
        ],
        &["#### Oslo", "#### Rome"],
    );
    assert!(
        got.iter().zip(&want).all(|(g, w)| close(*g, *w)),
        "{got:?} against {want:?}"
    );

    // Refusals, each naming its field.
    let mask = 825; // models/tiny's mask token id (config.json)
    for (body, status, param) in [
        (json!({"prompt": [1, 2]}), 400, "continuations"),
        (json!({"continuation": "x"}), 400, "prompt"),
        (
            json!({"prompt": [1], "messages": [], "continuation": "x"}),
            400,
            "messages",
        ),
        (
            json!({"prompt": [1, 2], "continuations": [[3], []]}),
            400,
            "continuations[1]",
        ),
        (
            json!({"prompt": [1, 2], "continuation": [3, mask]}),
            400,
            "continuations[0]",
        ),
        (
            json!({"prompt": [1, 2], "continuation": [3], "mc_num": 20}),
            400,
            "mc_num",
        ),
        (
            json!({"prompt": [1, 2], "continuation": [3], "pass_samples": 0}),
            400,
            "pass_samples",
        ),
        (
            json!({"prompt": [1, 2], "continuation": [3], "model": "other"}),
            404,
            "model",
        ),
    ] {
        let (got, v) = post(&server, &body);
        assert_eq!(got, status, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
}

/// A scoring request on a thread of its own: (status, body) and when it came back.
fn score_later(
    port: u16,
    body: Value,
) -> std::thread::JoinHandle<((u16, String), std::time::Instant)> {
    std::thread::spawn(move || {
        let reply = super::Port(port).request(
            "POST",
            "/v1/loglikelihood",
            &["Content-Type: application/json"],
            &body.to_string(),
        );
        (reply, std::time::Instant::now())
    })
}

#[test]
fn a_long_estimate_does_not_hold_a_generation_back() {
    let server = Server::start(&[]);
    let port = server.port;
    // 512 passes of one sample each: seconds of work, done a pass per round.
    let long = score_later(
        port,
        json!({
            "prompt": [300, 5, 6, 7], "continuation": [10, 11, 12, 13], "mc_num": 512,
            "pass_samples": 1,
        }),
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    // A second estimate waits for the first (one estimate's buffers at a time), in the
    // queue meanwhile.
    let short = score_later(
        port,
        json!({"prompt": [300, 5], "continuation": [10], "mc_num": 4}),
    );
    let probe = Server::probe(port);
    let waited = (0..50).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(20));
        probe() == Some(1.0)
    });
    let body = json!({
        "prompt": [300, 5, 6, 7], "max_tokens": 8, "steps": 8, "block_length": 8,
        "cache": "none",
    });
    let (status, reply) = server.request(
        "POST",
        "/v1/completions",
        &["Content-Type: application/json"],
        &body.to_string(),
    );
    let generated = std::time::Instant::now();
    assert_eq!(status, 200, "{reply}");
    let ((status, reply), long_done) = long.join().unwrap();
    assert_eq!(status, 200, "{reply}");
    let v: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(v["unmask"]["forward_passes"], 512, "{v}");
    let ((status, reply), short_done) = short.join().unwrap();
    assert_eq!(status, 200, "{reply}");
    assert!(
        generated < long_done,
        "the completion waited for the whole estimate"
    );
    assert!(
        long_done <= short_done,
        "the second estimate ran before the first ended"
    );
    assert!(waited, "the second estimate waited in the queue");
    assert_eq!(probe(), Some(0.0), "the queue is empty again");
}

#[test]
fn rolling_windows_sum_to_the_estimates_of_their_own_requests() {
    let server = Server::start(&[]);
    let ll = |body: Value| {
        let (status, v) = post(&server, &body);
        assert_eq!(status, 200, "{v}");
        v["data"][0].clone()
    };
    // 1100 ordinary ids, no prompt, on a model of 1024 positions: windows of 512 tokens, the
    // second and third after the 512 before them.
    let text: Vec<u32> = (0..1100u32).map(|k| 10 + (k * 7) % 800).collect();
    let settings = json!({"mc_num": 4, "mc_batch": 4, "seed": 5});
    let with = |mut body: Value| {
        for (k, v) in settings.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let rolled = ll(with(
        json!({"prompt": [], "continuation": text, "rolling": true}),
    ));
    assert_eq!(
        (rolled["windows"].as_u64(), rolled["tokens"].as_u64()),
        (Some(3), Some(1100))
    );
    // Each window draws its masks with its own seed (the first with the request's).
    let windows = [
        (&text[..0], &text[..512]),
        (&text[..512], &text[512..1024]),
        (&text[512..1024], &text[1024..]),
    ];
    let parts: Vec<Value> = windows
        .iter()
        .enumerate()
        .map(|(i, (context, answer))| {
            let mut body = with(json!({"prompt": context, "continuation": answer}));
            body["seed"] = json!(window_seed(5, i));
            ll(body)
        })
        .collect();
    let sum: f64 = parts
        .iter()
        .map(|p| p["log_likelihood"].as_f64().unwrap())
        .sum();
    let got = rolled["log_likelihood"].as_f64().unwrap();
    assert!(close(got, sum), "rolled {got} against the windows' {sum}");
    let se: f64 = parts
        .iter()
        .map(|p| p["standard_error"].as_f64().unwrap().powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(
        close(rolled["standard_error"].as_f64().unwrap(), se),
        "{rolled}"
    );
    // A text that fits is one window: the unconditional estimate itself.
    let short = ll(with(
        json!({"prompt": [], "continuation": &text[..40], "rolling": true}),
    ));
    let plain = ll(with(json!({"prompt": [], "continuation": &text[..40]})));
    assert_eq!(short["windows"], 1);
    assert_eq!(short["log_likelihood"], plain["log_likelihood"]);
    // Guidance needs a prompt to mask, and greedy decoding one to decode after.
    let (status, v) = post(
        &server,
        &json!({"prompt": [], "continuation": [10], "greedy": true}),
    );
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("greedy")),
        "{v}"
    );
    let (status, v) = post(
        &server,
        &json!({"prompt": [], "continuation": [10], "cfg_scale": 1.0}),
    );
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("prompt")),
        "{v}"
    );
}
