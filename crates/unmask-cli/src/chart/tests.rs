use super::svg::{filled_rects, size, texts};
use super::*;

fn chart(groups: usize, series: usize, label: &str) -> BarChart {
    BarChart {
        title: "Title".into(),
        y_label: "tokens/s".into(),
        groups: (0..groups)
            .map(|g| vec![format!("{label}{g}"), "quota".into()])
            .collect(),
        series: (0..series).map(|s| format!("S{s}")).collect(),
        values: (0..groups)
            .map(|g| {
                (0..series)
                    .map(|s| Some((g * series + s + 1) as f64))
                    .collect()
            })
            .collect(),
    }
}

#[test]
fn axes_ticks_are_round() {
    assert_eq!(nice_axis(9.3), (10.0, vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]));
    assert_eq!(nice_axis(1.0).0, 1.0);
    let (top, ticks) = nice_axis(1234.0);
    assert_eq!((top, ticks.len()), (1250.0, 6));
    assert_eq!(tick_label(0.75, 0.25), "0.75");
    assert_eq!(nice_axis(0.0).0, 1.0);
    assert_eq!(nice_axis(f64::NAN).0, 1.0);
    assert_eq!(tick_label(0.30000000000000004, 0.1), "0.3");
    assert_eq!(tick_label(15000.0, 5000.0), "15K");
    assert_eq!(tick_label(0.0, 5000.0), "0");
    assert_eq!(tick_label(400.0, 200.0), "400");
    assert_eq!(compact(12345.0), "12K");
    assert_eq!(compact(987.4), "987");
    assert_eq!(compact(2.468), "2.47");
    assert!(compact(1_234_567.0).len() <= 5);
}

#[test]
fn taller_bars_for_larger_values_in_series_colours() {
    let c3 = chart(3, 2, "g");
    let l = c3.layout();
    assert!(!l.turned);
    let svg = c3.to_svg().unwrap();
    assert_eq!(size(&svg), (l.width as f64, l.height as f64));
    // Per series: one bar per group and the legend swatch, left to right.
    let mut heights = vec![0.0; 6];
    for s in 0..2 {
        let rects = filled_rects(&svg, series_colour(s));
        assert_eq!(rects.len(), 4, "three bars and a swatch of series {s}");
        for (g, r) in rects[..3].iter().enumerate() {
            // Each bar stands on the axis, at its place in the group.
            assert_eq!(r[1] + r[3], l.baseline as f64, "bar {g}/{s}");
            assert_eq!(r[0], (l.plot_left + l.bar_x(g, s, 2)) as f64, "bar {g}/{s}");
            assert_eq!(r[2], l.bar_width() as f64);
            heights[g * 2 + s] = r[3];
        }
    }
    assert!(heights.windows(2).all(|w| w[1] > w[0]), "{heights:?}");
    // Value 6 on an axis to 6: the whole plot height; value 1 a sixth of it.
    assert!((heights[5] - PLOT_H as f64).abs() <= 1.0, "{heights:?}");
    assert!(
        (heights[0] - PLOT_H as f64 / 6.0).abs() <= 1.0,
        "{heights:?}"
    );
    let t = texts(&svg);
    for want in ["Title", "tokens/s", "g0", "quota", "S1", "6.00", "0", "6"] {
        assert!(t.iter().any(|x| x == want), "no {want:?} in {t:?}");
    }
}

#[test]
fn many_long_labels_are_turned_up_and_missing_values_draw_no_bar() {
    let mut many = chart(30, 3, "a long category label ");
    many.values[0][1] = None;
    let l = many.layout();
    assert!(l.turned);
    let svg = many.to_svg().unwrap();
    // Series 1 lacks group 0's bar; it has 29 bars and its swatch.
    assert_eq!(filled_rects(&svg, series_colour(1)).len(), 30);
    assert_eq!(filled_rects(&svg, series_colour(2)).len(), 31);
    let t = texts(&svg);
    assert!(t.iter().any(|x| x == "N/A"));
    assert!(t.iter().any(|x| x == "a long category label 0 quota"));
    assert!(svg.contains("rotate(270"));
}

#[test]
fn an_empty_chart_still_draws() {
    let empty = BarChart {
        title: "Nothing".into(),
        ..BarChart::default()
    };
    let svg = empty.to_svg().unwrap();
    let (w, h) = size(&svg);
    assert!(w > 0.0 && h > 0.0);
}

#[test]
fn text_is_escaped() {
    let mut c = chart(1, 1, "<a&b>");
    c.series[0] = "S1 \"x\" & <y>".into();
    let svg = c.to_svg().unwrap();
    assert!(!svg.contains("<a&b>"));
    let t = texts(&svg);
    assert!(t.iter().any(|x| x == "<a&b>0"), "{t:?}");
    assert!(t.iter().any(|x| x == "S1 \"x\" & <y>"), "{t:?}");
}
