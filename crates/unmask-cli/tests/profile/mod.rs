//! `unmask profile`: the depth table, the matrix and the heat map it writes for a task set.

use std::path::Path;

use serde_json::Value;

use super::{
    assert_fails, assert_ok, f64_of, fixture, joined, run, stderr, stdout, temp_path, u64s,
};

/// The three-item set of the profiling test: two items share a system prompt.
fn profile_set() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/profile-set.jsonl")
        .display()
        .to_string()
}

#[test]
fn profile_writes_the_depth_table_the_matrix_and_the_heat_map() {
    let out = temp_path("profile");
    let out_arg = out.display().to_string();
    let o = run(&[
        "profile",
        "--model",
        &fixture(),
        "--set",
        &profile_set(),
        "--out",
        &out_arg,
        "--user-repeat",
        "2",
    ]);
    assert_ok(&o);
    let err = stderr(&o);
    assert!(err.contains("[profile 6/6]"), "{err}");
    assert!(stdout(&o).contains("table: r >= 0: b = "), "{}", stdout(&o));

    let text = std::fs::read_to_string(out.join("bicache_depth.json")).expect("table");
    let table = unmask_core::depth_policy::DepthTable::from_json(&text, "bicache_depth.json")
        .expect("a valid depth table");
    assert_eq!(table.model_id, "tiny");
    assert_eq!(table.n_layers, 2);
    assert_eq!(table.tau, 0.97);
    assert_eq!(table.entries[0].0, 0);
    assert!(table.samples_per_ratio >= 1);
    assert!(table.ratio_definition.contains("P/(P+U)"));
    assert!(table.source.contains("unmask profile"), "{}", table.source);

    let matrix: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("similarity.json")).expect("matrix"),
    )
    .expect("JSON");
    let ratios = u64s(&matrix["ratios"]);
    assert!(
        !ratios.is_empty() && ratios.windows(2).all(|w| w[0] < w[1]),
        "{ratios:?}"
    );
    let samples = u64s(&matrix["samples"]);
    assert_eq!(samples.len(), ratios.len());
    assert_eq!(
        samples.iter().sum::<u64>(),
        6,
        "three items, each also repeated twice"
    );
    let rows = matrix["similarity"].as_array().expect("similarity");
    assert_eq!(rows.len(), ratios.len());
    for row in rows {
        let row = row.as_array().expect("row");
        assert_eq!(row.len(), 2);
        // Layer 0's K/V do not see the rest of the prompt; layer 1's do.
        assert!((f64_of(&row[0]) - 1.0).abs() < 1e-6, "{row:?}");
        assert!(f64_of(&row[1]) < 1.0, "{row:?}");
    }

    let svg = std::fs::read_to_string(out.join("similarity.svg")).expect("heat map");
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let named = |tag: &'static str| doc.descendants().filter(move |n| n.has_tag_name(tag));
    // A cell per bucket and layer (besides the background and the colour bar), and the
    // ratios as row labels.
    assert!(named("rect").count() > 2 * ratios.len());
    let texts: Vec<&str> = named("text")
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for r in &ratios {
        assert!(texts.contains(&r.to_string().as_str()), "{r} in {texts:?}");
    }
    let _ = std::fs::remove_dir_all(&out);

    // With a canvas the ratio counts it.
    let o = run(&[
        "profile",
        "--model",
        &fixture(),
        "--set",
        &profile_set(),
        "--out",
        &out_arg,
        "--limit",
        "1",
        "--gen-length",
        "32",
        "--tau",
        "0.5",
    ]);
    assert_ok(&o);
    let text = std::fs::read_to_string(out.join("bicache_depth.json")).expect("table");
    let table = unmask_core::depth_policy::DepthTable::from_json(&text, "t").expect("valid");
    assert!(
        table.ratio_definition.contains("G = 32"),
        "{}",
        table.ratio_definition
    );
    assert_eq!(table.tau, 0.5);
    let _ = std::fs::remove_dir_all(&out);

    let fix = fixture();
    let set = profile_set();
    let base = ["profile", "--model", fix.as_str(), "--set", set.as_str()];
    assert_fails(&base, 2, "--out");
    assert_fails(
        &joined(&base, &["--out", &out_arg, "--tau", "0"]),
        2,
        "--tau",
    );
    assert_fails(
        &joined(&base, &["--out", &out_arg, "--tau", "1.5"]),
        2,
        "--tau",
    );
    assert_fails(
        &joined(&base, &["--out", &out_arg, "--user-repeat", "2,0"]),
        2,
        "--user-repeat",
    );
    assert_fails(
        &joined(&base, &["--out", &out_arg, "--gen-length", "-1"]),
        2,
        "--gen-length",
    );
}
