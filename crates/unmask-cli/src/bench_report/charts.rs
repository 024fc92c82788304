//! The report's bar charts: best GFLOP/s per kernel case and format, canvas throughput per
//! cache mode.

use super::collect::{KernelRow, RequestRow};
use super::markdown::request_label;
use super::merge::Merged;
use crate::chart::BarChart;

pub(super) fn kernels_chart(m: &Merged, rows: &[&KernelRow]) -> BarChart {
    let sources = m.with(&m.kernels);
    // One group per case and format: the best over its shapes and variants.
    let mut groups: Vec<(&str, &str, &str)> = Vec::new();
    for r in rows {
        let g = (r.kernel.as_str(), r.case.as_str(), r.format.as_str());
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let values = groups
        .iter()
        .map(|&(kernel, case, format)| {
            sources
                .iter()
                .map(|&s| {
                    m.kernels
                        .iter()
                        .filter(|((src, r), _)| {
                            *src == s && r.kernel == kernel && r.case == case && r.format == format
                        })
                        .filter_map(|(_, (_, f))| f.get("gflops").copied())
                        .reduce(f64::max)
                })
                .collect()
        })
        .collect();
    BarChart {
        title: "Best GFLOP/s per kernel case and format (fastest variant and shape)".into(),
        y_label: "GFLOP/s".into(),
        groups: groups
            .iter()
            .map(|(_, case, format)| vec![case.to_string(), format.to_string()])
            .collect(),
        series: sources.iter().map(|&s| m.label(s)).collect(),
        values,
    }
}

pub(super) fn requests_chart(m: &Merged, rows: &[&RequestRow]) -> BarChart {
    let sources = m.with(&m.requests);
    let shapes: Vec<String> = rows.iter().map(|r| request_label(r).2).collect();
    let one_shape = shapes.iter().all(|s| *s == shapes[0]);
    let groups = rows
        .iter()
        .map(|r| {
            let (cache, decoding, shape) = request_label(r);
            let mut lines = vec![cache, decoding];
            if !one_shape {
                lines.push(shape);
            }
            lines
        })
        .collect();
    let values = rows
        .iter()
        .map(|r| {
            sources
                .iter()
                .map(|&s| {
                    m.requests
                        .get(&(s, (*r).clone()))
                        .and_then(|f| f.get("throughput_canvas").copied())
                })
                .collect()
        })
        .collect();
    let title = if one_shape {
        format!(
            "Canvas throughput per cache mode (tokens/s, gen/steps/block {})",
            shapes[0]
        )
    } else {
        "Canvas throughput per cache mode (tokens/s)".to_string()
    };
    BarChart {
        title,
        y_label: "tokens/s".into(),
        groups,
        series: sources.iter().map(|&s| m.label(s)).collect(),
        values,
    }
}

#[cfg(test)]
mod tests {
    use super::super::build;
    use super::super::fixtures::two_sources;
    use crate::chart::series_colour;
    use crate::chart::svg::{filled_rects, size};

    #[test]
    fn charts_are_svgs_with_taller_bars_for_larger_values() {
        let r = build(&two_sources(), "x").unwrap();
        for (chart, svg) in [r.kernels.as_ref().unwrap(), r.requests.as_ref().unwrap()] {
            let l = chart.layout();
            assert_eq!(size(svg), (l.width as f64, l.height as f64));
            assert_eq!(chart.series.len(), 2);
        }
        let (chart, svg) = r.requests.as_ref().unwrap();
        assert_eq!(chart.series[0], "S1 GPU A / Vulkan / f16-native");
        assert_eq!(chart.groups[0], ["none", "quota"]);
        let l = chart.layout();
        // Bar heights by (group, series), found by their left edges; the swatch is left of
        // the plot.
        let height = |group: usize, series: usize| {
            let x = (l.plot_left + l.bar_x(group, series, 2)) as f64;
            filled_rects(svg, series_colour(series))
                .iter()
                .find(|r| r[0] == x)
                .map_or(0.0, |r| r[3])
        };
        // none: S1 100 tok/s, S2 400 tok/s.
        assert!(height(0, 1) > height(0, 0));
        assert!(height(0, 0) > 0.0);
        // S1 has no prefix-arm record: no bar.
        assert_eq!(height(1, 0), 0.0);
        // prefix-arm at 600 tok/s is the tallest bar of all.
        let all: Vec<f64> = (0..3)
            .flat_map(|g| (0..2).map(move |s| (g, s)))
            .map(|(g, s)| height(g, s))
            .collect();
        assert_eq!(all.iter().copied().fold(0.0, f64::max), height(1, 1));
    }
}
