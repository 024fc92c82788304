use super::*;

#[test]
fn depth_counts_leading_layers_strictly_above_tau() {
    assert_eq!(safe_depth(&[0.99, 0.98, 0.97, 0.99], 0.97), 2);
    assert_eq!(safe_depth(&[0.5, 0.99], 0.97), 0);
    assert_eq!(safe_depth(&[1.0, 1.0], 0.97), 2);
}

#[test]
fn entries_are_a_monotone_step_function_from_zero() {
    let b = |r: u32, s: &[f64]| (r, 1, s.to_vec());
    let sim = vec![
        b(20, &[0.99, 0.5, 0.5]),
        b(40, &[0.99, 0.99, 0.5]),
        b(50, &[0.99, 0.5, 0.5]),
        b(90, &[0.99, 0.99, 0.99]),
    ];
    let leading = DepthRule::Leading;
    assert_eq!(
        depth_entries(&sim, 0.97, leading),
        vec![(0, 1), (40, 2), (90, 3)]
    );
    // One layer less wherever a layer fails; all three where none does.
    assert_eq!(
        depth_entries(&sim, 0.97, DepthRule::Boundary),
        vec![(0, 0), (40, 1), (90, 3)]
    );
    // The floor at r = 0 is the smallest depth seen anywhere.
    let sim = vec![b(0, &[0.99, 0.99, 0.5]), b(30, &[0.5, 0.5, 0.5])];
    assert_eq!(depth_entries(&sim, 0.97, leading), vec![(0, 0)]);
    assert_eq!(depth_entries(&[], 0.97, leading), vec![(0, 0)]);
    assert_eq!(depth_entries(&[], 0.97, DepthRule::Boundary), vec![(0, 0)]);
}

#[test]
fn boundary_rule_keeps_the_state_feeding_a_failed_layer_out() {
    let s = [1.0, 1.0, 1.0, 0.3];
    assert_eq!(DepthRule::Leading.depth(&s, 0.97), 3);
    assert_eq!(DepthRule::Boundary.depth(&s, 0.97), 2);
    assert_eq!(boundary_depth(&s, 0.97), 2);
    // Every layer passes: every layer is reused under both rules.
    let s = [1.0, 0.99, 0.98, 0.975];
    assert_eq!(DepthRule::Leading.depth(&s, 0.97), 4);
    assert_eq!(DepthRule::Boundary.depth(&s, 0.97), 4);
    // The first layer fails: nothing is reused (no underflow).
    let s = [0.5, 1.0, 1.0, 1.0];
    assert_eq!(DepthRule::Leading.depth(&s, 0.97), 0);
    assert_eq!(DepthRule::Boundary.depth(&s, 0.97), 0);
    // A later layer passing again does not count; no layers, no depth.
    assert_eq!(boundary_depth(&[0.99, 0.5, 0.99], 0.97), 0);
    assert_eq!(boundary_depth(&[], 0.97), 0);
    assert_eq!(DepthRule::default(), DepthRule::Boundary);
    assert_eq!(ProfileOptions::default().rule, DepthRule::Boundary);
}

#[test]
fn min_statistic_sees_one_changed_row_the_mean_hides() {
    // 100 prefix rows of width 4; the request changes row 37's K completely (orthogonal)
    // and nothing else.
    let width = 4;
    let rows = 100;
    let alone: Vec<f32> = (0..rows * width)
        .map(|i| 1.0 + (i % 7) as f32 * 0.25)
        .collect();
    let mut joint_k = alone.clone();
    let row = &mut joint_k[37 * width..38 * width];
    let old: Vec<f32> = row.to_vec();
    // (a, b, c, d) -> (-b, a, -d, c) is orthogonal to (a, b, c, d).
    row.copy_from_slice(&[-old[1], old[0], -old[3], old[2]]);
    let k = row_cosines(&alone, &joint_k, width);
    let v = row_cosines(&alone, &alone, width);
    assert_eq!(k.len(), rows);
    assert!(k[37].abs() < 1e-9, "{}", k[37]);

    let mean = RowStatistic::Mean.score(&k, &v);
    let min = RowStatistic::Min.score(&k, &v);
    // Mean: (0.99 + 1.0) / 2, well above tau; min: the changed row.
    assert!((mean - 0.995).abs() < 1e-9, "{mean}");
    assert!(min.abs() < 1e-9, "{min}");
    assert!(
        (mean - (super::mean(&row_cosines(&alone, &joint_k, width)) + 1.0) / 2.0).abs() < 1e-12
    );
    // The changed row makes the layer fail only under the minimum.
    let layers = |s: f64| [1.0, s, 0.99];
    assert_eq!(DepthRule::Leading.depth(&layers(mean), 0.97), 3);
    assert_eq!(DepthRule::Leading.depth(&layers(min), 0.97), 1);
    // The minimum takes V's rows too, whichever of K and V is smaller.
    assert!(RowStatistic::Min.score(&v, &k).abs() < 1e-9);
    assert!((RowStatistic::Min.score(&v, &v) - 1.0).abs() < 1e-12);
    // No rows count as identical; a NaN row fails.
    assert_eq!(RowStatistic::Min.score(&[], &[]), 1.0);
    assert_eq!(RowStatistic::Mean.score(&[], &[]), 1.0);
    assert!(
        RowStatistic::Min
            .score(&[1.0, f64::NAN, 0.5], &[1.0])
            .is_nan()
    );
    assert!(RowStatistic::Min.score(&[f64::NAN, 1.0], &[0.5]).is_nan());
    assert_eq!(RowStatistic::default(), RowStatistic::Mean);
    // The 1st percentile: one changed row of 100 is at rank 0, so it still decides; two
    // changed rows of 201 (rank 2) do not, three do.
    assert!(RowStatistic::P1.score(&k, &v).abs() < 1e-9);
    let mut k201 = vec![1.0; 201];
    k201[5] = 0.1;
    k201[9] = 0.2;
    assert_eq!(RowStatistic::P1.score(&k201, &vec![1.0; 201]), 1.0);
    k201[11] = 0.3;
    assert_eq!(RowStatistic::P1.score(&k201, &vec![1.0; 201]), 0.3);
    assert_eq!(RowStatistic::P1.score(&[], &[]), 1.0);
    assert!(
        RowStatistic::P1
            .score(&[f64::NAN, 1.0], &[1.0, 1.0])
            .is_nan()
    );
}

#[test]
fn low3_ignores_two_rows_at_any_length() {
    // 900 rows: 4 changed rows decide under low3, not under p1 (rank 8).
    let mut k = vec![1.0; 900];
    for (i, r) in [10, 20, 30, 40].into_iter().enumerate() {
        k[r] = 0.5 + 0.1 * i as f64;
    }
    let v = vec![1.0; 900];
    assert_eq!(RowStatistic::P1.score(&k, &v), 1.0);
    assert!((RowStatistic::Low3.score(&k, &v) - 0.7).abs() < 1e-12);
    // two odd rows alone are ignored; fewer than three rows take the last
    let mut k2 = vec![1.0; 900];
    k2[3] = 0.1;
    k2[4] = 0.2;
    assert_eq!(RowStatistic::Low3.score(&k2, &v), 1.0);
    assert_eq!(RowStatistic::Low3.score(&[0.3, 0.9], &[1.0, 1.0]), 0.9);
    assert_eq!(RowStatistic::Low3.score(&[], &[]), 1.0);
    assert!(RowStatistic::Low3.score(&[f64::NAN], &[1.0]).is_nan());
    // p1-low3: p1's rank up to 300 rows (here the lowest of 100), the third-lowest beyond.
    assert!((RowStatistic::P1Low3.score(&k, &v) - 0.7).abs() < 1e-12);
    let mut k3 = vec![1.0; 100];
    k3[7] = 0.25;
    assert_eq!(RowStatistic::P1Low3.score(&k3, &[1.0; 100]), 0.25);
    assert_eq!(RowStatistic::Low3.score(&k3, &[1.0; 100]), 1.0);
}

#[test]
fn the_table_source_names_the_statistic_and_the_rule() {
    let s = table_source("unmask profile --x", RowStatistic::Min, DepthRule::Boundary);
    assert!(s.starts_with("unmask profile --x; "), "{s}");
    assert!(
        s.contains("row statistic: min") && s.contains("depth rule: boundary"),
        "{s}"
    );
    let s = table_source("", RowStatistic::Mean, DepthRule::Leading);
    assert!(s.starts_with("row statistic: mean"), "{s}");
    assert!(s.contains("depth rule: leading"), "{s}");
}

#[test]
fn cosine_of_rows() {
    let a = [1.0, 0.0, 0.0, 2.0];
    let b = [2.0, 0.0, 0.0, -1.0];
    assert!((mean(&row_cosines(&a, &b, 2)) - 0.0).abs() < 1e-12);
    assert!((mean(&row_cosines(&a, &a, 2)) - 1.0).abs() < 1e-12);
    assert_eq!(cosine(&[0.0, 0.0], &[0.0, 0.0]), 1.0);
    assert_eq!(cosine(&[0.0, 0.0], &[1.0, 0.0]), 0.0);
}
