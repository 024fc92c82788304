//! `unmask chat` with piped input: one answer per line, with and without a cache mode.

use serde_json::Value;

use super::{assert_ok, fixture, run_with_stdin, stdout, u64s};

#[test]
fn chat_answers_every_piped_line() {
    let fix = fixture();
    let args = ["chat", "--model", &fix, "--gen-length", "8", "--json"];
    let o = run_with_stdin(&args, "Hello\nWhat is 2+3?\n");
    assert_ok(&o);
    let turns: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(turns.len(), 2, "{}", stdout(&o));
    assert_eq!(turns[0]["turn"], 1);
    assert_eq!(turns[1]["user"], "What is 2+3?");
    for t in &turns {
        assert_eq!(u64s(&t["ids"]).len(), 8);
        assert!(t["text"].is_string());
    }
    // The second prompt holds the first exchange: its user turn, the answer and headers.
    let (p1, p2) = (
        turns[0]["prompt_tokens"].as_u64().expect("n"),
        turns[1]["prompt_tokens"].as_u64().expect("n"),
    );
    assert!(p2 > p1 + 4, "history not carried: {p1} then {p2}");

    // /reset starts over: the same question gets the same prompt and answer.
    let o = run_with_stdin(&args, "Hi\n/reset\n\nHi\n/quit\nignored\n");
    assert_ok(&o);
    let turns: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(turns.len(), 2);
    assert_eq!(turns[0]["prompt_tokens"], turns[1]["prompt_tokens"]);
    assert_eq!(turns[0]["ids"], turns[1]["ids"]);

    // Plain text: one answer per turn.
    let o = run_with_stdin(
        &["chat", "--model", &fix, "--gen-length", "8"],
        "one\ntwo\n",
    );
    assert_ok(&o);
    assert!(!stdout(&o).trim_start().starts_with('{'));
}

#[test]
fn chat_takes_a_cache_mode() {
    let fix = fixture();
    let args = [
        "chat",
        "--model",
        &fix,
        "--system",
        "Be brief.",
        "--gen-length",
        "8",
        "--threshold",
        "0.9",
        "--cache",
        "fast-dllm-dual",
        "--json",
    ];
    let o = run_with_stdin(&args, "Hello\nAnd then?\n");
    assert_ok(&o);
    let turns: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(turns.len(), 2);
    for t in &turns {
        assert_eq!(t["cache"], "fast-dllm-dual");
        assert_eq!(u64s(&t["ids"]).len(), 8);
        assert!(t["prefix_len"].as_u64() < t["prompt_tokens"].as_u64());
        assert!(t["timings"]["token_layer_passes"].as_u64().is_some());
    }
}
