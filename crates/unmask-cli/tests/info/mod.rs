//! `unmask help` and `--help`, shell completions, `unmask info` on both fixture families,
//! `unmask selfcheck`, and the demo page's label of the bundled model against what
//! `unmask info` counts.

use super::{assert_fails, assert_ok, fixture, run, stdout, workspace};

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
