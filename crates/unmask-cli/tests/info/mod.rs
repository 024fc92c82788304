//! `unmask help` and `--help`, shell completions, `unmask info` on both fixture families,
//! `unmask selfcheck`, the demo page's label of the bundled model against what `unmask info`
//! counts, and `unmask tokenize` against what `generate` runs.

use super::{assert_fails, assert_ok, fixture, json, run, stdout, u64s, workspace};

#[test]
fn help_info_and_selfcheck() {
    let o = run(&["help"]);
    assert_ok(&o);
    for command in ["generate", "chat", "eval", "logits", "info", "selfcheck"] {
        assert!(stdout(&o).contains(command), "{}", stdout(&o));
    }
    for args in [["generate", "--help"], ["help", "generate"]] {
        let o = run(&args);
        assert_ok(&o);
        assert!(stdout(&o).contains("--gen-length <N>"), "{}", stdout(&o));
    }
    let o = run(&["completions", "bash"]);
    assert_ok(&o);
    assert!(stdout(&o).contains("--gen-length"), "{}", stdout(&o));
    assert_fails(&["completions", "tcsh"], 2, "tcsh");

    let o = run(&["info", "--model", &fixture()]);
    assert_ok(&o);
    let text = stdout(&o);
    for needle in [
        "adapter:",
        "limits:",
        "parameters:",
        "weights on the GPU:",
        "tokenizer: 306",
    ] {
        assert!(text.contains(needle), "`{needle}` not in\n{text}");
    }

    // DiffusionGemma: the family, its shape and the memory of its weights per format.
    let dgemma = workspace().join("tests/fixtures/tiny-dgemma");
    let o = run(&["info", "--model", &dgemma.display().to_string()]);
    assert_ok(&o);
    let text = stdout(&o);
    for needle in [
        "family: DiffusionGemma",
        "4 layers (2 sliding-window 8, 2 full)",
        "8 experts top 2",
        "canvas 16",
        "unmask generate, logits, eval and serve run it",
        "GPU memory of the weights (router f32): f16 ",
    ] {
        assert!(text.contains(needle), "`{needle}` not in\n{text}");
    }

    let o = run(&["selfcheck"]);
    assert_ok(&o);
    assert!(stdout(&o).contains("selfcheck passed"), "{}", stdout(&o));
}

/// The demo page names the bundled model's size before loading it; after loading it shows
/// the loader's count. The two must agree (the label said 1.1 M when the model had 0.54 M).
#[test]
fn the_demo_page_labels_the_bundled_model_with_the_loaders_parameter_count() {
    let o = run(&[
        "info",
        "--model",
        workspace().join("models/tiny").to_str().unwrap(),
    ]);
    assert_ok(&o);
    let out = stdout(&o);
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("parameters:"))
        .unwrap_or_else(|| panic!("no parameters line in\n{out}"));
    let count: f64 = line
        .split_whitespace()
        .nth(1)
        .unwrap()
        .replace(',', "")
        .parse()
        .unwrap();
    let page = std::fs::read_to_string(workspace().join("web/index.html")).unwrap();
    let at = page.find("<code>models/tiny</code>, ").expect("the label") + 26;
    let label: f64 = page[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        page[at..].starts_with(&format!("{label} M parameters")),
        "{}",
        &page[at..at + 30]
    );
    assert_eq!(
        format!("{label:.1}"),
        format!("{:.1}", count / 1e6),
        "the page says {label} M, the loader {count}"
    );
}

/// `tokenize` gives the ids `generate` runs (chat template included) and their text, and
/// the ids it gives for a word are the ones `--logit-bias` bans.
#[test]
fn tokenize_gives_the_ids_generate_runs_and_logit_bias_bans() {
    let model = workspace().join("models/tiny").display().to_string();
    let system = std::fs::read_to_string(workspace().join("data/tasks/demo-system.txt")).unwrap();
    let ask = [
        "--system",
        system.trim_end(),
        "--prompt",
        "What is the city of Bella?",
    ];
    let canvas = [
        "--gen-length",
        "32",
        "--steps",
        "16",
        "--block-length",
        "4",
        "--json",
    ];
    let generate = |extra: &[&str]| {
        let o = run(&[&["generate", "--model", &model][..], &ask, &canvas, extra].concat());
        assert_ok(&o);
        json(&o)
    };
    let plain = generate(&[]);
    let o = run(&[&["tokenize", "--model", &model, "--json"][..], &ask].concat());
    assert_ok(&o);
    let t = json(&o);
    assert_eq!(u64s(&t["tokens"]), u64s(&plain["prompt_ids"]));
    assert_eq!(t["count"], plain["prompt_ids"].as_array().unwrap().len());
    let o = run(&["tokenize", "--model", &model, "--text", " Lima", "--json"]);
    assert_ok(&o);
    let word = json(&o);
    let texts = word["texts"].as_array().unwrap();
    assert_eq!(
        texts.iter().filter_map(|v| v.as_str()).collect::<String>(),
        " Lima"
    );
    let ids: Vec<String> = u64s(&word["tokens"]).iter().map(u64::to_string).collect();
    let o = run(&["tokenize", "--model", &model, "--decode", &ids.join(",")]);
    assert_ok(&o);
    assert_eq!(stdout(&o).trim_end_matches('\n'), " Lima");
    let text = plain["text"].as_str().unwrap();
    assert!(text.contains("Lima"), "{text}");
    let bans: Vec<String> = ids
        .iter()
        .map(|id| format!("--logit-bias={id}=-100"))
        .collect();
    let bans: Vec<&str> = bans.iter().map(String::as_str).collect();
    let banned = generate(&bans);
    let banned = banned["text"].as_str().unwrap();
    assert!(!banned.contains("Lima"), "{banned}");
    assert_fails(
        &["tokenize", "--model", &model],
        2,
        "--text TEXT, --prompt TEXT or --decode",
    );
    assert_fails(
        &["tokenize", "--model", &model, "--decode", "99999"],
        2,
        "--decode",
    );
}
