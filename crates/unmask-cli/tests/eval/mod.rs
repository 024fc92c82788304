//! `unmask eval` over a small task set: every cache mode, exact-match scores, item limits,
//! the reports it writes, and errors naming the value, the file and the line.

use serde_json::Value;

use super::{
    assert_fails, assert_ok, f64_of, fixture, json, run, stderr, stdout, temp_path, tiny_set, u64s,
};

/// What `--cache all` runs.
const ALL_CACHE_MODES: [&str; 9] = [
    "none",
    "fast-dllm-prefix",
    "fast-dllm-dual",
    "prefix-arm",
    "bicache",
    "bicache-dual",
    "acache",
    "dllm-cache",
    "bicache-dllm",
];

#[test]
fn eval_runs_every_cache_mode_over_the_set() {
    let set = tiny_set();
    let md = temp_path("eval.md");
    let out = temp_path("eval.json");
    let (md_arg, out_arg) = (md.display().to_string(), out.display().to_string());
    let o = run(&[
        "eval",
        "--model",
        &fixture(),
        "--set",
        &set,
        "--cache",
        "all",
        "--gen-length",
        "8",
        "--full-canvas",
        "--json",
        "--markdown",
        &md_arg,
        "--out",
        &out_arg,
    ]);
    assert_ok(&o);
    let v = json(&o);
    assert!(v["adapter"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(v["backend"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(v["model"].as_str().is_some_and(|s| s.contains("tiny")));
    assert_eq!(v["set"], set.as_str());
    assert_eq!(v["n_items"], 4);
    // Eval's defaults: steps and block length follow the generation length.
    assert_eq!(v["params"]["gen_length"], 8);
    assert_eq!(v["params"]["steps"], 8);
    assert_eq!(v["params"]["block_length"], 8);
    assert_eq!(v["params"]["temperature"], 0.0);

    let modes = v["modes"].as_array().expect("modes");
    let names: Vec<&str> = modes
        .iter()
        .map(|m| m["cache"].as_str().expect("cache"))
        .collect();
    assert_eq!(names, ALL_CACHE_MODES);
    for m in modes {
        let name = &m["cache"];
        assert_eq!(m["n_items"], 4, "{name}");
        let accuracy = f64_of(&m["accuracy"]);
        assert!((0.0..=1.0).contains(&accuracy), "{name}: {accuracy}");
        assert_eq!(
            accuracy,
            f64_of(&m["correct"]) / 4.0,
            "{name}: accuracy is correct / items"
        );
        for task in ["lookup", "pair", "record", "format"] {
            let a = f64_of(&m["accuracy_per_task"][task]);
            assert!((0.0..=1.0).contains(&a), "{name}: {task}");
            assert_eq!(m["items_per_task"][task], 1, "{name}: {task}");
        }
        for key in [
            "total_s",
            "mean_s",
            "throughput_canvas",
            "throughput_answer",
            "mean_token_layer_passes",
            "mean_forward_passes",
            "mean_ttft_s",
            "agreement_with_none",
            "cache_bytes",
            "kv_arena_bytes",
        ] {
            assert!(f64_of(&m[key]) >= 0.0, "{name}: {key}");
        }
        assert_eq!(m["canvas_tokens"], 32, "{name}");
        assert!(f64_of(&m["throughput_canvas"]) > 0.0, "{name}");
        // Measured on the device: the weights and at least the mode's K/V.
        let peak = m["peak_gpu_bytes"].as_u64().expect("peak_gpu_bytes");
        assert!(
            peak > m["kv_arena_bytes"].as_u64().unwrap_or(u64::MAX),
            "{name}: {peak}"
        );
        assert!(f64_of(&m["agreement_with_none"]) <= 1.0, "{name}");
        // The fixture has no depth table and no --depth is given: BiCache falls back on
        // every item, says why, and holds nothing in the store.
        assert_eq!(m["cache_bytes"], m["kv_arena_bytes"]);
        assert_eq!(m["cache_hits"], 0, "{name}");
        assert_eq!(m["cache_misses"], 0, "{name}");
        if name.as_str().is_some_and(|n| n.starts_with("bicache")) {
            assert_eq!(m["fallbacks"], 4, "{name}");
            let why = m["first_fallback"].as_str().expect("first_fallback");
            assert!(why.contains("bicache_depth.json"), "{name}: {why}");
        } else if name == "acache" {
            // The set names no span and the store holds none: the dual cache runs.
            assert_eq!(m["fallbacks"], 4, "{name}");
            let why = m["first_fallback"].as_str().expect("first_fallback");
            assert!(why.contains("no shared span"), "{name}: {why}");
        } else {
            assert_eq!(m["fallbacks"], 0, "{name}");
            assert!(m["first_fallback"].is_null(), "{name}");
        }
        // Several modes: the per-item lists go only to --out.
        assert!(m.get("items").is_none(), "{name}: items on stdout");
    }
    let passes = |i: usize| f64_of(&modes[i]["mean_token_layer_passes"]);
    assert!(
        passes(2) < passes(0),
        "dual {} vs none {}",
        passes(2),
        passes(0)
    );
    assert_eq!(modes[0]["agreement_with_none"], 1.0);
    assert_eq!(modes[0]["mean_forward_passes"], 8.0);
    // K and V of 2 layers x 2 heads x 16 dims in f32 over every position: 512 bytes each.
    let kv = modes[0]["kv_arena_bytes"].as_u64().expect("bytes");
    assert_eq!(kv % 4, 0);
    assert!(kv > 512 * 8, "{kv}");

    let full: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("read --out")).expect("JSON");
    let _ = std::fs::remove_file(&out);
    let full_modes = full["modes"].as_array().expect("modes");
    assert_eq!(full_modes.len(), ALL_CACHE_MODES.len());
    for (m, full_m) in modes.iter().zip(full_modes) {
        assert_eq!(m["accuracy"], full_m["accuracy"]);
        let items = full_m["items"].as_array().expect("items in --out");
        let ids: Vec<&str> = items
            .iter()
            .map(|i| i["id"].as_str().expect("id"))
            .collect();
        assert_eq!(ids, ["g1-lookup", "g1-pair", "g1-record", "g2-format"]);
        for item in items {
            assert_eq!(u64s(&item["ids"]).len(), 8);
            assert!(item["output"].is_string());
            assert!(item["answer"].is_string());
            assert!(item["correct"].is_boolean());
            assert!(f64_of(&item["total_s"]) >= 0.0);
            assert!(item["token_layer_passes"].as_u64().is_some_and(|n| n > 0));
            if m["cache"]
                .as_str()
                .is_some_and(|n| n.starts_with("bicache"))
            {
                assert!(item["bicache"]["fallback"].is_string(), "{item}");
            } else {
                assert!(item["bicache"].is_null(), "{item}");
            }
        }
    }

    let table = std::fs::read_to_string(&md).expect("read --markdown");
    let _ = std::fs::remove_file(&md);
    let header = table.lines().next().expect("header line");
    for needle in [
        "adapter:",
        "model:",
        "set:",
        "gen_length=8",
        "unmask eval",
        "--cache all",
    ] {
        assert!(header.contains(needle), "`{needle}` not in {header}");
    }
    assert!(table.contains("| cache | accuracy | lookup | pair | record | format |"));
    assert!(table.contains(
        "| TTFT (s) | agreement with none | shared entry hit/miss/fallback | anchors (on asked lines / asked lines' tokens anchored) | peak GPU memory (MiB) |"
    ));
    for mode in ALL_CACHE_MODES {
        let rows = table
            .lines()
            .filter(|l| {
                // dLLM-Cache rows name their settings: `| dllm-cache (ρ 0.25, …) |`.
                l.starts_with(&format!("| {mode} |")) || l.starts_with(&format!("| {mode} ("))
            })
            .count();
        assert_eq!(rows, 1, "{mode} rows in\n{table}");
    }
    assert_eq!(
        table.lines().filter(|l| l.starts_with("| ")).count(),
        2 + ALL_CACHE_MODES.len()
    );
}

#[test]
fn eval_scores_exact_matches_and_limits_items() {
    let fix = fixture();
    // Defaults (32 tokens, 32 steps, one block) over the first two items.
    let o = run(&[
        "eval",
        "--model",
        &fix,
        "--set",
        &tiny_set(),
        "--limit",
        "2",
        "--json",
    ]);
    assert_ok(&o);
    let v = json(&o);
    assert_eq!(v["params"]["gen_length"], 32);
    assert_eq!(v["params"]["steps"], 32);
    assert_eq!(v["params"]["block_length"], 32);
    assert_eq!(v["n_items"], 2);
    assert_eq!(v["limit"], 2);
    let modes = v["modes"].as_array().expect("modes");
    assert_eq!(modes.len(), 1);
    assert_eq!(modes[0]["cache"], "none");
    assert_eq!(modes[0]["n_items"], 2);
    assert_eq!(modes[0]["items_per_task"]["lookup"], 1);
    assert_eq!(modes[0]["items_per_task"]["record"], 0);
    assert!(modes[0]["accuracy_per_task"]["record"].is_null());
    let items = modes[0]["items"].as_array().expect("items with one mode");
    assert_eq!(items.len(), 2);
    for item in items {
        assert_eq!(u64s(&item["ids"]).len(), 32);
    }
    let first_output = items[0]["output"].as_str().expect("output").to_string();

    // The same items, the first expecting exactly what the model answered and the second
    // garbage: half right. A set of garbage answers scores 0.
    let line = |id: &str, task: &str, answer: &str, system: &str, user: &str| {
        serde_json::json!({
            "id": id, "task": task, "system": system, "user": user,
            "answer": answer, "prompt_group": "g1",
        })
        .to_string()
    };
    let system = "Alice: Oslo, cat, 31. Bruno: Rome, dog, 27. Answer after ####.";
    let scored = temp_path("scored.jsonl");
    std::fs::write(
        &scored,
        format!(
            "{}\n{}\n",
            line(
                "g1-lookup",
                "lookup",
                &first_output,
                system,
                "Which city is Alice from?"
            ),
            line(
                "g1-pair",
                "combine",
                "§ no model says this §",
                system,
                "What pet has the person from Rome?"
            ),
        ),
    )
    .expect("write set");
    let scored_arg = scored.display().to_string();
    let o = run(&["eval", "--model", &fix, "--set", &scored_arg, "--json"]);
    let _ = std::fs::remove_file(&scored);
    assert_ok(&o);
    let v = json(&o);
    let m = &v["modes"][0];
    assert_eq!(m["accuracy"], 0.5);
    assert_eq!(m["accuracy_per_task"]["lookup"], 1.0);
    assert_eq!(m["accuracy_per_task"]["combine"], 0.0);
    assert_eq!(m["items"][0]["correct"], true);
    assert_eq!(m["items"][1]["correct"], false);
    assert_eq!(
        m["items"][0]["ids"], items[0]["ids"],
        "temperature 0 is deterministic"
    );

    // Without --json: a progress line per item on stderr and the table on stdout.
    let garbage = temp_path("garbage.jsonl");
    std::fs::write(
        &garbage,
        format!(
            "{}\n",
            line("x1", "arithmetic", "§§§ 1234567 §§§", system, "Sum?")
        ),
    )
    .expect("write set");
    let garbage_arg = garbage.display().to_string();
    let o = run(&[
        "eval",
        "--model",
        &fix,
        "--set",
        &garbage_arg,
        "--gen-length",
        "8",
        "--cache",
        "none,fast-dllm-dual",
    ]);
    let _ = std::fs::remove_file(&garbage);
    assert_ok(&o);
    let err = stderr(&o);
    assert!(err.contains("[none 1/1] x1 (arithmetic): wrong"), "{err}");
    assert!(err.contains("[fast-dllm-dual 1/1] x1"), "{err}");
    let table = stdout(&o);
    assert!(table.contains("| none | 0.000 (0/1) |"), "{table}");
    assert!(
        table.contains("| fast-dllm-dual | 0.000 (0/1) |"),
        "{table}"
    );
}

#[test]
fn eval_errors_name_the_value_the_file_and_the_line() {
    let fix = fixture();
    let f = fix.as_str();
    let set = tiny_set();
    let s = set.as_str();
    assert_fails(
        &["eval", "--model", f, "--set", s, "--cache", "all,none"],
        2,
        "`all`",
    );
    assert_fails(
        &["eval", "--model", f, "--set", s, "--cache", "bicash"],
        2,
        "`bicash`",
    );
    assert_fails(
        &[
            "eval",
            "--model",
            f,
            "--set",
            s,
            "--cache",
            "none,bicache-triple",
        ],
        2,
        "`bicache-triple`",
    );
    assert_fails(
        &["eval", "--model", f, "--set", s, "--cache", "none,none"],
        2,
        "more than once",
    );
    assert_fails(
        &["generate", "--prompt-ids", "1", "--cache", "bicash"],
        2,
        "'bicash'",
    );
    assert_fails(&["chat", "--cache", "dual"], 2, "'dual'");
    assert_fails(&["eval", "--model", f], 2, "--set");
    assert_fails(
        &["eval", "--model", f, "--set", s, "--limit", "0"],
        2,
        "--limit",
    );
    assert_fails(&["eval", "--model", f, "--set", s, "--raw"], 2, "--raw");

    let missing = temp_path("no-such-set.jsonl").display().to_string();
    assert_fails(&["eval", "--model", f, "--set", &missing], 1, &missing);

    let bad = temp_path("bad-set.jsonl");
    let bad_arg = bad.display().to_string();
    let good = r#"{"id": "a", "task": "lookup", "system": "S", "user": "U", "answer": "x", "prompt_group": "g"}"#;
    for (second, why) in [
        ("{\"id\": \"b\", \"task\": ", "not a valid JSON"),
        (
            r#"{"id": "b", "task": "lookup", "system": "S", "answer": "x"}"#,
            "missing field \"user\"",
        ),
        (
            r#"{"id": "b", "task": "lookup", "user": "U", "answer": 7}"#,
            "\"answer\" must be a string",
        ),
        (good, "already used on line 1"),
    ] {
        std::fs::write(&bad, format!("{good}\n{second}\n")).expect("write set");
        assert_fails(
            &["eval", "--model", f, "--set", &bad_arg],
            1,
            &format!("{bad_arg}:2: "),
        );
        assert_fails(&["eval", "--model", f, "--set", &bad_arg], 1, why);
    }
    std::fs::write(&bad, "\n\n").expect("write set");
    assert_fails(
        &["eval", "--model", f, "--set", &bad_arg],
        1,
        "holds no items",
    );
    let _ = std::fs::remove_file(&bad);

    let nowhere = temp_path("no-such-dir/table.md").display().to_string();
    assert_fails(
        &["eval", "--model", f, "--set", s, "--markdown", &nowhere],
        2,
        "does not exist",
    );
}

/// `--infill` on the bundled model: the first fact's value of each held-out answer is hidden
/// between the answer's head and the rest of it, the canvas is as long as the value, and
/// the model fills it back; a set whose answers are not facts is refused at its line.
#[test]
fn eval_infill_hides_the_first_facts_value() {
    let root = super::workspace();
    let model = root.join("models/tiny").display().to_string();
    let set = root
        .join("data/tasks/heldout-small.jsonl")
        .display()
        .to_string();
    let out = temp_path("infill.json");
    let out_arg = out.display().to_string();
    let o = run(&[
        "eval",
        "--model",
        &model,
        "--set",
        &set,
        "--limit",
        "3",
        "--cache",
        "none,bicache-dual",
        "--infill",
        "--out",
        &out_arg,
    ]);
    assert_ok(&o);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    std::fs::remove_file(&out).unwrap();
    assert_eq!(v["infill"], true);
    for mode in v["modes"].as_array().unwrap() {
        let name = mode["cache"].as_str().unwrap();
        let items = mode["items"].as_array().unwrap();
        assert_eq!(items.len(), 3, "{name}");
        for item in items {
            // The value alone: one word, no marker, no other fact.
            let expected = item["answer"].as_str().unwrap();
            assert!(!expected.contains(' ') && !expected.is_empty(), "{item}");
            assert!(item["ids"].as_array().unwrap().len() <= 3, "{item}");
        }
        assert_eq!(
            mode["correct"], 3,
            "{name}: the bundled model fills every value"
        );
    }
    assert_fails(
        &[
            "eval",
            "--model",
            &fixture(),
            "--set",
            &tiny_set(),
            "--infill",
        ],
        2,
        "--infill: item \"g1-lookup\" (line 1): expected an answer of facts",
    );
}
