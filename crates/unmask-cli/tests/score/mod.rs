//! `unmask score`: answers ranked by their estimated log-likelihood, the estimate the
//! library gives for the same seed, multiple choice over a set, and bad flags named.

use serde_json::Value;

use super::{
    assert_fails, assert_ok, f64_of, fixture, json, run, stdout, temp_path, tiny_set, u64s,
};

#[test]
fn score_ranks_answers_and_a_set_reports_its_accuracy() {
    let fix = fixture();
    let o = run(&[
        "score",
        "--model",
        &fix,
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
        "--pass-samples",
        "3",
        "--json",
    ]);
    assert_ok(&o);
    let v = json(&o);
    let answers = v["answers"].as_array().unwrap();
    assert_eq!(answers.len(), 2);
    let estimates: Vec<f64> = answers
        .iter()
        .map(|a| a["log_likelihood"].as_f64().unwrap())
        .collect();
    assert!(estimates[0] >= estimates[1], "best first: {estimates:?}");
    for a in answers {
        let losses = a["sample_losses"].as_array().unwrap();
        assert_eq!(losses.len(), 8);
        assert_eq!(a["sequences"], 8);
        // 8 samples, 3 side by side per pass: 3 passes.
        assert_eq!(
            (&a["pass_samples"], &a["forward_passes"]),
            (&3.into(), &3.into())
        );
        // The estimate is minus the mean sample loss.
        let mean = losses.iter().map(|l| l.as_f64().unwrap()).sum::<f64>() / 8.0;
        assert!((a["log_likelihood"].as_f64().unwrap() + mean).abs() < 1e-9);
        assert!(!u64s(&a["ids"]).is_empty());
    }
    // The same seed draws the same masks: the same estimate again, in other passes (all
    // 8 samples in one), within f32 rounding.
    let again = run(&[
        "score",
        "--model",
        &fix,
        "--prompt-ids",
        "300,5,6,7",
        "--answer-ids",
        "40,41",
        "--mc-num",
        "8",
        "--mc-batch",
        "4",
        "--json",
    ]);
    let again = json(&again)["answers"][0].clone();
    assert_eq!(again["forward_passes"], 1);
    let again = again["log_likelihood"].as_f64().unwrap();
    assert!(
        answers.iter().any(|a| a["answer"] == "40,41"
            && (a["log_likelihood"].as_f64().unwrap() - again).abs() <= 1e-4 * again.abs()),
        "{again}"
    );

    // Multiple choice over a set: one item whose choices include its answer.
    let set = temp_path("choices.jsonl");
    std::fs::write(
        &set,
        r#"{"id": "q1", "task": "lookup", "system": "Alice: Oslo.", "user": "Which city?", "answer": "Oslo", "choices": ["Rome", "Oslo"]}
"#,
    )
    .unwrap();
    let set_arg = set.display().to_string();
    let o = run(&[
        "score",
        "--model",
        &fix,
        "--set",
        &set_arg,
        "--mc-num",
        "4",
        "--mc-batch",
        "4",
        "--json",
    ]);
    assert_ok(&o);
    let v: Value = json(&o);
    assert_eq!(v["items"], 1);
    let r = &v["results"][0];
    assert_eq!(r["choices"].as_array().unwrap().len(), 2);
    assert_eq!(r["correct"], r["picked"] == "Oslo");
    let o = run(&[
        "score",
        "--model",
        &fix,
        "--set",
        &set_arg,
        "--mc-num",
        "4",
        "--mc-batch",
        "4",
    ]);
    assert_ok(&o);
    assert!(stdout(&o).starts_with("accuracy "), "{}", stdout(&o));
    std::fs::remove_file(&set).unwrap();

    assert_fails(
        &[
            "score",
            "--model",
            &fix,
            "--prompt-ids",
            "1,2",
            "--answer-ids",
            "3",
            "--mc-num",
            "6",
            "--mc-batch",
            "4",
        ],
        2,
        "--mc-num: expected a positive multiple of mc_batch 4, found 6",
    );
    assert_fails(
        &[
            "score",
            "--model",
            &fix,
            "--prompt-ids",
            "1,2",
            "--answer-ids",
            "3,305",
        ],
        1,
        "answer: expected token ids below the vocabulary's 320 other than the mask token 305",
    );
    assert_fails(
        &["score", "--model", &fix, "--set", &tiny_set()],
        2,
        "item \"g1-lookup\" (line 1) has no \"choices\"",
    );
    assert_fails(
        &["score", "--model", &fix, "--prompt-ids", "1,2"],
        2,
        "give --answer TEXT",
    );
}

#[test]
fn a_text_file_is_scored_in_rolling_windows_with_its_perplexities() {
    let fix = fixture();
    // About 360 tokens on a model of 256 positions: windows of 128.
    let text = "The answer is five, as two and three make five. ".repeat(30);
    let file = temp_path("text.txt");
    std::fs::write(&file, &text).unwrap();
    let path = file.display().to_string();
    let args = [
        "score",
        "--model",
        &fix,
        "--text-file",
        &path,
        "--mc-num",
        "4",
        "--mc-batch",
        "4",
    ];
    let o = run(&[&args[..], &["--json"]].concat());
    assert_ok(&o);
    let v = json(&o);
    let t = &v["texts"][0];
    let (ll, tokens) = (f64_of(&t["log_likelihood"]), f64_of(&t["tokens"]));
    assert!(ll < 0.0 && tokens > 256.0, "{t}");
    assert_eq!(
        t["windows"].as_u64(),
        Some((tokens as u64).div_ceil(128)),
        "{t}"
    );
    assert_eq!(t["bytes"].as_u64(), Some(text.len() as u64));
    assert_eq!(t["words"].as_u64(), Some(300));
    let bits = -ll / (text.len() as f64 * std::f64::consts::LN_2);
    assert!((f64_of(&t["bits_per_byte"]) - bits).abs() < 1e-9, "{t}");
    assert!(
        (f64_of(&t["word_perplexity"]) - (-ll / 300.0).exp()).abs() < 1e-6 * (-ll / 300.0).exp()
    );
    assert!(v["prompt_ids"].as_array().unwrap().is_empty());
    // The plain output is one line per file, with the same estimate.
    let o = run(&args);
    assert_ok(&o);
    let line = stdout(&o);
    assert!(line.contains("bits/byte") && line.contains(&path), "{line}");
    assert!(
        line.trim_start().starts_with(&format!("{ll:.2} nats")),
        "{line}"
    );
    assert_fails(
        &[&args[..], &["--system", "S"]].concat(),
        2,
        "--system needs --prompt TEXT",
    );
    std::fs::write(&file, "  \n").unwrap();
    assert_fails(&args, 2, "found an empty file");
    std::fs::remove_file(&file).unwrap();
    assert_fails(&args, 1, "cannot read --text-file");
}

#[test]
fn bench_scoring_times_pass_sizes_with_the_same_estimate() {
    let fix = fixture();
    let out = temp_path("scoring-bench.jsonl");
    let o = run(&[
        "bench",
        "--model",
        &fix,
        "--only",
        "scoring",
        "--prefix-tokens",
        "8",
        "--user-tokens",
        "4",
        "--answer-tokens",
        "3",
        "--mc-num",
        "8",
        "--pass-samples",
        "1,auto",
        "--out",
        &out.display().to_string(),
    ]);
    assert_ok(&o);
    let text = std::fs::read_to_string(&out).expect("records");
    let _ = std::fs::remove_file(&out);
    let records: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON record per line"))
        .collect();
    assert_eq!(records.len(), 2, "{text}");
    for r in &records {
        assert_eq!(r["record"], "scoring");
        assert_eq!(
            (&r["prompt_tokens"], &r["answer_tokens"]),
            (&12.into(), &3.into())
        );
        assert!(r["estimate_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["adapter"].is_string() && r["commit"].is_string(), "{r}");
    }
    // One sample per pass: 8 passes; the engine's choice: all 8 in one.
    let passes: Vec<(u64, u64)> = records
        .iter()
        .map(|r| {
            let n = |k: &str| r[k].as_u64().unwrap();
            (n("pass_samples"), n("forward_passes"))
        })
        .collect();
    assert_eq!(passes, [(1, 8), (8, 1)]);
    assert_eq!(records[1]["pass_samples_asked"], "auto");
    assert_eq!(records[0]["speedup_over_one_per_pass"], 1.0);
    let ll: Vec<f64> = records
        .iter()
        .map(|r| r["log_likelihood"].as_f64().unwrap())
        .collect();
    assert!((ll[0] - ll[1]).abs() <= 1e-4 * ll[0].abs(), "{ll:?}");
    assert_fails(
        &[
            "bench",
            "--model",
            &fix,
            "--only",
            "scoring",
            "--prefix-tokens",
            "250",
            "--user-tokens",
            "4",
        ],
        2,
        "--prefix-tokens 250 + --user-tokens 4 + --answer-tokens 8 = 262 exceed the model's \
         maximum sequence length 256",
    );
    assert_fails(
        &[
            "bench",
            "--model",
            &fix,
            "--only",
            "scoring",
            "--pass-samples",
            "0",
        ],
        2,
        "a list of positive counts or auto",
    );
}
