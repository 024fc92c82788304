//! BiCache through the command line: `generate`'s report of its hits and fallbacks, and
//! `eval` and `chat` sharing a system prompt through its prefix store.

use serde_json::Value;

use super::{
    assert_fails, assert_ok, f64_of, fixture, joined, json, run, run_with_stdin, stderr, stdout,
    tiny_set, u64s,
};

/// `generate --json` with BiCache's flags on a prompt whose system turn is the prefix.
fn bicache_generate(extra: &[&str]) -> Value {
    let fix = fixture();
    let mut args = vec![
        "generate",
        "--model",
        fix.as_str(),
        "--system",
        "Alice: Oslo, cat, 31. Bruno: Rome, dog, 27. Answer after ####.",
        "--prompt",
        "Which city is Alice from?",
        "--gen-length",
        "16",
        "--block-length",
        "16",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = run(&args);
    assert_ok(&o);
    json(&o)
}

#[test]
fn generate_reports_bicache_and_its_fallbacks() {
    let v = bicache_generate(&["--cache", "bicache", "--depth", "1", "--refresh", "4"]);
    assert_eq!(v["cache"], "bicache");
    let b = &v["bicache"];
    assert_eq!(b["depth"], 1, "{b}");
    assert_eq!(b["hit"], false, "one process, one request: a miss");
    assert!(b["fallback"].is_null(), "{b}");
    assert_eq!(b["entry_tokens"], v["prefix_len"]);
    assert!(b["entry_bytes"].as_u64().is_some_and(|n| n > 0), "{b}");
    let prompt = u64s(&v["prompt_ids"]).len() as f64;
    let p = f64_of(&v["prefix_len"]);
    let r = (100.0 * p / (prompt + 16.0)).round();
    assert_eq!(f64_of(&b["ratio"]), r, "{b}");
    assert_eq!(u64s(&v["ids"]).len(), 16);

    // A budget of 4 tokens cannot hold the prefix: the request runs uncached and says why.
    let v = bicache_generate(&["--cache", "bicache", "--depth", "1", "--cache-budget", "4"]);
    let why = v["bicache"]["fallback"].as_str().expect("fallback reason");
    assert!(
        why.contains("budget") && why.contains("ran as none"),
        "{why}"
    );
    let v = bicache_generate(&[
        "--cache",
        "bicache-dual",
        "--depth",
        "1",
        "--cache-budget",
        "1000,1K",
    ]);
    let why = v["bicache"]["fallback"].as_str().expect("fallback reason");
    assert!(
        why.contains("fast-dllm-dual") && why.contains("1024 bytes"),
        "{why}"
    );
    // Without a depth table or --depth.
    let v = bicache_generate(&["--cache", "bicache"]);
    let why = v["bicache"]["fallback"].as_str().expect("fallback reason");
    assert!(why.contains("bicache_depth.json"), "{why}");
    // Other modes have no report.
    assert!(bicache_generate(&["--cache", "none"])["bicache"].is_null());

    let fix = fixture();
    let f = fix.as_str();
    let base = [
        "generate",
        "--model",
        f,
        "--prompt-ids",
        "1,2",
        "--cache",
        "bicache",
    ];
    assert_fails(&joined(&base, &["--depth", "-1"]), 2, "--depth");
    assert_fails(&joined(&base, &["--refresh", "0"]), 2, "--refresh");
    assert_fails(
        &joined(&base, &["--cache-budget", "many"]),
        2,
        "--cache-budget",
    );
    assert_fails(
        &joined(&base, &["--cache-budget", "4,2T"]),
        2,
        "--cache-budget",
    );
}

#[test]
fn eval_and_chat_share_the_system_prompt_through_bicache() {
    let o = run(&[
        "eval",
        "--model",
        &fixture(),
        "--set",
        &tiny_set(),
        "--cache",
        "none,bicache,bicache-dual",
        "--depth",
        "1",
        "--gen-length",
        "8",
        "--json",
    ]);
    assert_ok(&o);
    let v = json(&o);
    let modes = v["modes"].as_array().expect("modes");
    // Three items share group g1's system prompt, the fourth has its own: two entries are
    // built, then every later request of the run finds its prefix stored.
    assert_eq!(modes[1]["cache"], "bicache");
    assert_eq!(modes[1]["cache_misses"], 2);
    assert_eq!(modes[1]["cache_hits"], 2);
    assert_eq!(modes[2]["cache_misses"], 0);
    assert_eq!(modes[2]["cache_hits"], 4);
    for m in &modes[1..] {
        assert_eq!(m["fallbacks"], 0, "{m}");
        assert!(m["first_fallback"].is_null());
        assert!(
            f64_of(&m["cache_bytes"]) > f64_of(&m["kv_arena_bytes"]),
            "the store's entries count: {m}"
        );
        assert!(
            f64_of(&m["mean_token_layer_passes"]) < f64_of(&modes[0]["mean_token_layer_passes"]),
            "{m}"
        );
    }
    let err = stderr(&o);
    assert!(err.contains("BiCache depth 1 at r = "), "{err}");
    assert!(err.contains(", hit)"), "{err}");

    // Up to 3 items at once (continuous batching) give each item's tokens of one at a time
    // (one matmul kernel for every row count, so batched rows round as alone).
    let items_at = |batch: &str| {
        let o = run(&[
            "eval",
            "--model",
            &fixture(),
            "--set",
            &tiny_set(),
            "--cache",
            "bicache-dual",
            "--depth",
            "1",
            "--gen-length",
            "8",
            "--matmul",
            "tiled",
            "--batch",
            batch,
            "--json",
        ]);
        assert_ok(&o);
        json(&o)["modes"][0]["items"]
            .as_array()
            .expect("items")
            .clone()
    };
    let (alone, batched) = (items_at("1"), items_at("3"));
    assert_eq!(alone.len(), 4);
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(a["ids"], b["ids"], "{} differs in a batch", a["id"]);
        assert_eq!(a["bicache"]["batch"], 1);
    }
    let most = batched
        .iter()
        .filter_map(|i| i["bicache"]["batch"].as_u64())
        .max();
    assert_eq!(most, Some(3), "g1's three items share the forward passes");

    let args = [
        "chat",
        "--model",
        &fixture(),
        "--system",
        "Be brief.",
        "--gen-length",
        "8",
        "--cache",
        "bicache",
        "--depth",
        "1",
        "--json",
    ];
    let o = run_with_stdin(&args, "Hello\n");
    assert_ok(&o);
    let turn: Value = serde_json::from_str(stdout(&o).trim()).expect("JSON line");
    assert_eq!(turn["bicache"]["depth"], 1, "{turn}");
    assert!(turn["bicache"]["fallback"].is_null(), "{turn}");
}
