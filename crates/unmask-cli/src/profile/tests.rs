use super::*;

fn parse(extra: &[&str]) -> Result<ProfileArgs, String> {
    use clap::Parser;
    #[derive(Parser, Debug)]
    struct Flags {
        #[command(flatten)]
        profile: ProfileArgs,
    }
    let base = ["unmask", "--set", "s.jsonl", "--out", "o"];
    Flags::try_parse_from(base.iter().chain(extra))
        .map(|f| f.profile)
        .map_err(|e| e.to_string())
}

#[test]
fn statistic_and_rule_flags_default_to_mean_and_boundary() {
    let a = parse(&[]).unwrap();
    assert_eq!(RowStatistic::from(a.row_statistic), RowStatistic::Mean);
    assert_eq!(DepthRule::from(a.depth_rule), DepthRule::Boundary);
    let a = parse(&["--row-statistic", "min", "--depth-rule=leading"]).unwrap();
    assert_eq!(RowStatistic::from(a.row_statistic), RowStatistic::Min);
    assert_eq!(DepthRule::from(a.depth_rule), DepthRule::Leading);
    let a = parse(&["--row-statistic=mean", "--depth-rule", "boundary"]).unwrap();
    assert_eq!(RowStatistic::from(a.row_statistic), RowStatistic::Mean);
    assert_eq!(DepthRule::from(a.depth_rule), DepthRule::Boundary);
    let a = parse(&["--row-statistic", "low3"]).unwrap();
    assert_eq!(RowStatistic::from(a.row_statistic), RowStatistic::Low3);
    let a = parse(&["--row-statistic", "p1-low3"]).unwrap();
    assert_eq!(RowStatistic::from(a.row_statistic), RowStatistic::P1Low3);
    let err = parse(&["--row-statistic", "median"]).unwrap_err();
    assert!(
        err.contains("--row-statistic") && err.contains("min"),
        "{err}"
    );
    let err = parse(&["--depth-rule", "trailing"]).unwrap_err();
    assert!(
        err.contains("--depth-rule") && err.contains("boundary"),
        "{err}"
    );
}

#[test]
fn the_matrix_and_summary_name_the_statistic_and_the_rule() {
    let similarity = vec![(20, 2, vec![1.0, 1.0, 0.5]), (90, 1, vec![1.0, 1.0, 1.0])];
    let table = DepthTable {
        model_id: "m".into(),
        tau: 0.97,
        ratio_definition: "r".into(),
        samples_per_ratio: 1,
        source: unmask::profile::table_source("cmd", RowStatistic::Min, DepthRule::Boundary),
        n_layers: 3,
        entries: unmask::profile::depth_entries(&similarity, 0.97, DepthRule::Boundary),
    };
    let p = Profile {
        table,
        similarity,
        skipped: Vec::new(),
        statistic: RowStatistic::Min,
        rule: DepthRule::Boundary,
    };
    let m = similarity_json(&p, 0, &[]);
    assert_eq!(m["row_statistic"], "min");
    assert_eq!(m["depth_rule"], "boundary");
    assert_eq!(m["depths"], json!([1, 3]));
    assert_eq!(m["entries"], json!([[0, 1], [90, 3]]));
    let source = m["source"].as_str().unwrap();
    assert!(source.contains("row statistic: min"), "{source}");
    let text = summary_text(&p);
    assert!(text.contains("row statistic min") && text.contains("depth rule boundary"));
    assert!(
        text.contains("table: r >= 0: b = 1, r >= 90: b = 3"),
        "{text}"
    );
}

#[test]
fn heat_map_cells_scale_and_markers() {
    use crate::chart::svg::{elements, hex, number, texts};
    let sim = vec![(20, 3, vec![1.0, 0.5]), (80, 1, vec![1.0, 0.99])];
    let svg = heat_map(&sim, 0.97).unwrap();
    // After the background, the cells row by row: the colour of each similarity on a
    // 0.50..1.00 scale, the first bucket on top.
    let rects = elements(&svg, "rect");
    let cells = &rects[1..5];
    let fills: Vec<&str> = cells.iter().map(|c| c["fill"].as_str()).collect();
    let top = hex(colour(1.0));
    assert_eq!(
        fills,
        [&top, &hex(colour(0.0)), &top, &hex(colour(0.98))].map(String::as_str)
    );
    let y = |c: &std::collections::HashMap<String, String>| number(c, "y");
    assert!(y(&cells[0]) < y(&cells[2]), "bucket 20 above bucket 80");
    assert_eq!(y(&cells[0]), y(&cells[1]));
    assert!(number(&cells[0], "x") < number(&cells[1], "x"));
    for c in cells {
        assert_eq!(number(c, "width"), (CELL - 1) as f64);
        assert_eq!(number(c, "height"), (CELL - 1) as f64);
    }
    // Dots on the three cells above tau, black on the bright ones.
    let dots = elements(&svg, "circle");
    assert_eq!(dots.len(), 3);
    assert!(dots.iter().all(|d| d["fill"] == "#000000"));
    let t = texts(&svg);
    for want in ["20", "80", "0", "1", "layer", "r", "1.00", "0.50", "τ"] {
        assert!(t.iter().any(|x| x == want), "no {want:?} in {t:?}");
    }
}

#[test]
fn colours_run_from_low_to_high() {
    assert_eq!(colour(0.0), RGBColor(68, 1, 84));
    assert_eq!(colour(1.0), RGBColor(254, 232, 37));
    assert_eq!(colour(f64::NAN), colour(0.0));
    assert_eq!(colour(7.0), colour(1.0));
    assert_eq!(marker_on(colour(1.0)), BLACK);
    assert_eq!(marker_on(colour(0.0)), WHITE);
    assert_eq!(scale_low(&[(0, 1, vec![1.0, 1.0])], 0.97), 0.97);
    assert_eq!(scale_low(&[(0, 1, vec![1.0, 1.0])], 1.0), 0.99);
    assert_eq!(scale_low(&[(0, 1, vec![0.456])], 0.97), 0.45);
}
