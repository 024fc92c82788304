//! Grouped bar charts drawn with the PNG canvas's pixel font: a title, a y axis with nice
//! ticks and grid lines, one group of bars per category (one colour per series), each bar's
//! value written above it, category labels below (turned up when they do not fit side by
//! side) and a legend.

use crate::png::{Canvas, GLYPH_H, Rgb, text_width};

pub const WHITE: Rgb = [255, 255, 255];
pub const INK: Rgb = [32, 32, 40];
const GRID: Rgb = [222, 222, 228];
const MUTED: Rgb = [150, 150, 160];

/// Series colours, picked to stay apart from each other, from the ink and from the grid.
pub const PALETTE: [Rgb; 8] = [
    [40, 100, 180],
    [232, 128, 30],
    [50, 158, 80],
    [200, 50, 60],
    [128, 86, 178],
    [30, 170, 190],
    [176, 150, 20],
    [110, 110, 120],
];

pub fn series_colour(i: usize) -> Rgb {
    PALETTE[i % PALETTE.len()]
}

/// Scale of the labels, ticks and legend: 6×10-pixel glyphs, 8 pixels apart.
const TEXT: usize = 2;
/// Scale of the title.
const TITLE: usize = 3;
const MARGIN: usize = 14;
const PLOT_H: usize = 300;
/// Side-by-side category labels may widen the plot up to this; past it they are turned up.
const MAX_FLAT_PLOT_W: usize = 1600;
const GROUP_GAP: usize = 18;
const LEGEND_ROW: usize = GLYPH_H * TEXT + 8;
const SWATCH_W: usize = 16;
/// Legend entries longer than this are cut (with `..`) so the image keeps a sane width.
const MAX_LEGEND_CHARS: usize = 90;

/// A grouped bar chart: `values[group][series]`, `None` where a series has no value for a
/// group (drawn as a turned-up `N/A`).
#[derive(Clone, Debug, Default)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    /// Each group's label as lines: stacked when the labels fit side by side, else joined
    /// with spaces and turned up.
    pub groups: Vec<Vec<String>>,
    pub series: Vec<String>,
    pub values: Vec<Vec<Option<f64>>>,
}

/// Where everything goes, in canvas pixels.
#[derive(Clone, Debug)]
pub struct Layout {
    pub width: usize,
    pub height: usize,
    /// Left edge of the plot area (the y axis is drawn on this column).
    pub plot_left: usize,
    pub plot_top: usize,
    /// Row of the x axis; bars end just above it.
    pub baseline: usize,
    /// Width of one group's slot; its bars are centred in it.
    pub slot: usize,
    /// Horizontal pitch of the bars within a group (each bar is drawn 2 pixels narrower).
    pub bar_pitch: usize,
    /// The value at the top of the axis, which `PLOT_H` pixels stand for.
    pub axis_max: f64,
    pub ticks: Vec<f64>,
    /// Whether the category labels are turned up.
    pub turned: bool,
    labels_top: usize,
    legend_top: usize,
}

impl Layout {
    /// Left edge of the bar of `series` in `group`.
    pub fn bar_x(&self, group: usize, series: usize, n_series: usize) -> usize {
        let inner = n_series.max(1) * self.bar_pitch;
        self.plot_left
            + 1
            + group * self.slot
            + (self.slot - inner) / 2
            + series * self.bar_pitch
            + 1
    }

    pub fn bar_width(&self) -> usize {
        self.bar_pitch - 2
    }

    /// Height in pixels of a bar of value `v` (negative and non-finite values draw none).
    pub fn bar_height(&self, v: f64) -> usize {
        if !(v.is_finite() && v > 0.0) {
            return 0;
        }
        ((v / self.axis_max * PLOT_H as f64).round() as usize).min(PLOT_H)
    }

    fn tick_y(&self, t: f64) -> usize {
        self.baseline - self.bar_height(t)
    }
}

impl BarChart {
    fn n_series(&self) -> usize {
        self.series.len().max(1)
    }

    fn max_value(&self) -> f64 {
        self.values
            .iter()
            .flatten()
            .flatten()
            .copied()
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max)
    }

    fn legend_text(&self, i: usize) -> String {
        let name = &self.series[i];
        if name.chars().count() > MAX_LEGEND_CHARS {
            let cut: String = name.chars().take(MAX_LEGEND_CHARS - 2).collect();
            format!("{cut}..")
        } else {
            name.clone()
        }
    }

    pub fn layout(&self) -> Layout {
        let n_groups = self.groups.len().max(1);
        let n_series = self.n_series();
        let bar_pitch = match n_series {
            1 | 2 => 28,
            3 | 4 => 20,
            _ => 14,
        };
        let inner = n_series * bar_pitch;
        let widest_line = self
            .groups
            .iter()
            .flatten()
            .map(|l| text_width(l, TEXT))
            .max()
            .unwrap_or(0);
        let flat_slot = (inner + GROUP_GAP).max(widest_line + 12);
        let turned = n_groups * flat_slot > MAX_FLAT_PLOT_W;
        let slot = if turned { inner + GROUP_GAP } else { flat_slot };
        let label_h = if turned {
            self.groups
                .iter()
                .map(|g| text_width(&g.join(" "), TEXT))
                .max()
                .unwrap_or(0)
        } else {
            let lines = self.groups.iter().map(Vec::len).max().unwrap_or(0);
            lines * (GLYPH_H * TEXT + 4)
        };

        let (axis_max, ticks) = nice_axis(self.max_value());
        let tick_w = ticks
            .iter()
            .map(|&t| text_width(&tick_label(t, ticks[1] - ticks[0]), TEXT))
            .max()
            .unwrap_or(0);
        // Value labels are turned up above their bars, so the tallest bar's label needs
        // room between the title and the plot.
        let label_room = self
            .values
            .iter()
            .flatten()
            .flatten()
            .map(|&v| text_width(&compact(v), TEXT))
            .max()
            .unwrap_or(0)
            .max(text_width("N/A", TEXT))
            + 8;
        let plot_left = MARGIN + GLYPH_H * TEXT + 10 + tick_w + 8;
        let plot_top = MARGIN + GLYPH_H * TITLE + 10 + label_room;
        let baseline = plot_top + PLOT_H;
        let labels_top = baseline + 8;
        let legend_top = labels_top + label_h + 16;
        let legend_w = (0..self.series.len())
            .map(|i| SWATCH_W + 8 + text_width(&self.legend_text(i), TEXT))
            .max()
            .unwrap_or(0);
        let width = (plot_left + 1 + n_groups * slot + MARGIN)
            .max(MARGIN + text_width(&self.title, TITLE) + MARGIN)
            .max(MARGIN + legend_w + MARGIN);
        let height = legend_top + self.series.len() * LEGEND_ROW + MARGIN;
        Layout {
            width,
            height,
            plot_left,
            plot_top,
            baseline,
            slot,
            bar_pitch,
            axis_max,
            ticks,
            turned,
            labels_top,
            legend_top,
        }
    }

    pub fn draw(&self) -> Canvas {
        let l = self.layout();
        let n_series = self.n_series();
        let mut c = Canvas::new(l.width, l.height, WHITE);
        c.text(MARGIN, MARGIN, &self.title, TITLE, INK);

        // The y axis: its label turned up beside the ticks, centred on the plot.
        let y_label_w = text_width(&self.y_label, TEXT);
        let y_label_bottom = (l.plot_top + PLOT_H / 2 + y_label_w / 2).min(l.baseline);
        c.text_up(MARGIN, y_label_bottom, &self.y_label, TEXT, INK);
        let step = l.ticks[1] - l.ticks[0];
        let plot_right = l.plot_left + 1 + self.groups.len().max(1) * l.slot;
        for &t in &l.ticks {
            let y = l.tick_y(t);
            c.hline(l.plot_left + 1, y, plot_right - l.plot_left - 1, GRID);
            c.hline(l.plot_left - 4, y, 4, INK);
            let label = tick_label(t, step);
            let x = l.plot_left - 6 - text_width(&label, TEXT);
            c.text(x, y.saturating_sub(GLYPH_H * TEXT / 2), &label, TEXT, INK);
        }
        c.vline(l.plot_left, l.plot_top, PLOT_H + 1, INK);
        c.hline(l.plot_left, l.baseline, plot_right - l.plot_left, INK);

        for (g, row) in self.values.iter().enumerate() {
            for s in 0..n_series {
                let x = l.bar_x(g, s, n_series);
                let value = row.get(s).copied().flatten();
                let label_x = x + l.bar_width() / 2 - (GLYPH_H * TEXT) / 2;
                match value {
                    Some(v) => {
                        let h = l.bar_height(v);
                        c.fill(x, l.baseline - h, l.bar_width(), h, series_colour(s));
                        let bottom = l.baseline - h - 4;
                        c.text_up(label_x, bottom, &compact(v), TEXT, INK);
                    }
                    None => c.text_up(label_x, l.baseline - 4, "N/A", TEXT, MUTED),
                }
            }
        }

        for (g, lines) in self.groups.iter().enumerate() {
            let left = l.plot_left + 1 + g * l.slot;
            if l.turned {
                let text = lines.join(" ");
                let x = left + l.slot / 2 - GLYPH_H * TEXT / 2;
                let bottom = l.labels_top + text_width(&text, TEXT);
                c.text_up(x, bottom, &text, TEXT, INK);
            } else {
                for (i, line) in lines.iter().enumerate() {
                    let x = left + (l.slot - text_width(line, TEXT)) / 2;
                    let y = l.labels_top + i * (GLYPH_H * TEXT + 4);
                    c.text(x, y, line, TEXT, INK);
                }
            }
        }

        for s in 0..self.series.len() {
            let y = l.legend_top + s * LEGEND_ROW;
            c.fill(MARGIN, y, SWATCH_W, GLYPH_H * TEXT, series_colour(s));
            c.outline(MARGIN, y, SWATCH_W, GLYPH_H * TEXT, INK);
            c.text(MARGIN + SWATCH_W + 8, y, &self.legend_text(s), TEXT, INK);
        }
        c
    }
}

/// The axis top and its ticks (0 first), 1, 2, 2.5 or 5 times a power of ten apart, about
/// five of them, the top at or above `max`.
pub fn nice_axis(max: f64) -> (f64, Vec<f64>) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let rough = max / 5.0;
    let power = 10f64.powf(rough.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|s| *s >= rough * (1.0 - 1e-9))
        .unwrap_or(10.0 * power);
    let n = (max / step - 1e-9).ceil().max(1.0) as usize;
    let ticks = (0..=n).map(|i| i as f64 * step).collect();
    (n as f64 * step, ticks)
}

/// A tick's label with as many decimals as the step needs; thousands as `K` once the step
/// is a whole number of them.
fn tick_label(v: f64, step: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if step >= 1000.0 {
        return format!("{}K", trim_decimals(v / 1000.0, 1));
    }
    // The fewest decimals that write the step exactly (0.25 needs two).
    let decimals = (0..6)
        .find(|&d| {
            let scaled = step * 10f64.powi(d);
            (scaled - scaled.round()).abs() < 1e-6 * scaled.max(1.0)
        })
        .unwrap_or(6) as usize;
    trim_decimals(v, decimals)
}

fn trim_decimals(v: f64, decimals: usize) -> String {
    let text = format!("{v:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// A value in at most five characters, for the label above a bar.
pub fn compact(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}K", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
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

    /// Height of the bar whose left edge is at `x`, read back from the pixels.
    fn drawn_height(c: &Canvas, l: &Layout, x: usize, colour: Rgb) -> usize {
        (0..l.baseline)
            .rev()
            .take_while(|&y| c.get(x + 1, y) == colour)
            .count()
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
        let canvas = c3.draw();
        assert_eq!((canvas.width, canvas.height), (l.width, l.height));
        let mut last = 0;
        for g in 0..3 {
            for s in 0..2 {
                let h = drawn_height(&canvas, &l, l.bar_x(g, s, 2), series_colour(s));
                let v = (g * 2 + s + 1) as f64;
                assert_eq!(h, l.bar_height(v), "bar {g}/{s}");
                assert!(h > last, "bar {g}/{s} is taller than the one before");
                last = h;
            }
        }
        // The largest value reaches most of the plot height.
        assert!(last * 10 >= PLOT_H * 8);
    }

    #[test]
    fn many_long_labels_are_turned_up_and_missing_values_draw_no_bar() {
        let mut many = chart(30, 3, "a long category label ");
        many.values[0][1] = None;
        let l = many.layout();
        assert!(l.turned);
        let canvas = many.draw();
        assert_eq!(
            drawn_height(&canvas, &l, l.bar_x(0, 1, 3), series_colour(1)),
            0
        );
        assert!(drawn_height(&canvas, &l, l.bar_x(0, 2, 3), series_colour(2)) > 0);
        // Something is written below the axis under the first group.
        let x0 = l.plot_left + 1;
        let inked = (x0..x0 + l.slot)
            .flat_map(|x| (l.baseline + 2..l.height).map(move |y| (x, y)))
            .any(|(x, y)| canvas.get(x, y) == INK);
        assert!(inked);
    }

    #[test]
    fn an_empty_chart_still_draws() {
        let empty = BarChart {
            title: "Nothing".into(),
            ..BarChart::default()
        };
        let c = empty.draw();
        assert!(c.width > 0 && c.height > 0);
    }
}
