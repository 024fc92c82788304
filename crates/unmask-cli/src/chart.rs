//! Grouped bar charts as SVG, drawn with plotters: a title, a y axis with round ticks and
//! grid lines, one group of bars per category (one colour per series), each bar's value
//! turned up above it, the category labels below the axis (stacked lines, or turned up when
//! they do not fit side by side) and a legend.
//!
//! SVG keeps text as `<text>` elements, so no font file is needed to draw and any viewer
//! renders it sharp. Plotters has no grouped-bar series: the sizes here place the groups
//! and bars, plotters draws them, the axes and the text.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub const INK: RGBColor = RGBColor(32, 32, 40);
const GRID: RGBColor = RGBColor(222, 222, 228);
const MUTED: RGBColor = RGBColor(150, 150, 160);

/// Series colours, picked to stay apart from each other, from the ink and from the grid.
pub const PALETTE: [RGBColor; 8] = [
    RGBColor(40, 100, 180),
    RGBColor(232, 128, 30),
    RGBColor(50, 158, 80),
    RGBColor(200, 50, 60),
    RGBColor(128, 86, 178),
    RGBColor(30, 170, 190),
    RGBColor(176, 150, 20),
    RGBColor(110, 110, 120),
];

pub fn series_colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// What drawing a chart into a string can fail with (plotters' layout errors).
pub type DrawError = DrawingAreaErrorKind<std::io::Error>;

pub const FONT: &str = "sans-serif";
/// Font sizes in plotters' units: the SVG's font-size is 1/1.24 of them (13 and 17 pixels).
pub const TEXT: f64 = 16.0;
const TITLE: f64 = 21.0;
/// Rough advance of one character at `TEXT` and at `TITLE`, in pixels. Only the layout
/// uses them (room for labels); the viewer places the glyphs.
pub const CHAR_W: u32 = 8;
const TITLE_CHAR_W: u32 = 10;
/// Height of a line of `TEXT`.
pub const LINE_H: u32 = 18;
const TITLE_H: u32 = 22;
pub const MARGIN: u32 = 16;
const PLOT_H: u32 = 320;
/// Side-by-side category labels may widen the plot up to this; past it they are turned up.
const MAX_FLAT_PLOT_W: u32 = 1600;
const GROUP_GAP: u32 = 18;
/// Height of the bottom label area, which holds only the x axis line.
const AXIS_AREA: u32 = 4;
const LEGEND_ROW: u32 = 22;
const SWATCH_W: u32 = 18;
const SWATCH_H: u32 = 12;
/// Legend entries longer than this are cut (with `..`) so the image keeps a sane width.
const MAX_LEGEND_CHARS: usize = 90;

/// A text style of `size` in `colour`.
pub fn text_style(size: f64, colour: &RGBColor) -> TextStyle<'static> {
    TextStyle {
        color: colour.to_backend_color(),
        ..TextStyle::from((FONT, size).into_font())
    }
}

/// Text reading upwards from the given point, centred across it.
fn turned_up(colour: &RGBColor) -> TextStyle<'static> {
    text_style(TEXT, colour)
        .transform(FontTransform::Rotate270)
        .pos(Pos::new(HPos::Left, VPos::Center))
}

/// A linear axis over `range` with ticks exactly at `ticks`. (Plotters' `with_key_points`
/// does this too, but its f64 version cannot take a label formatter.)
#[derive(Clone)]
pub struct Ticked {
    inner: plotters::coord::types::RangedCoordf64,
    ticks: Vec<f64>,
}

impl Ticked {
    pub fn new(range: std::ops::Range<f64>, ticks: Vec<f64>) -> Self {
        Self {
            inner: range.into(),
            ticks,
        }
    }
}

impl Ranged for Ticked {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(value, limit)
    }

    fn key_points<H: plotters::coord::ranged1d::KeyPointHint>(&self, hint: H) -> Vec<f64> {
        // Bold points (ticks, labels, grid lines) only; no light grid lines between them.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.inner.range()
    }
}

/// Rough width in pixels of `text` at `TEXT`.
pub fn text_width(text: &str) -> u32 {
    text.chars().count() as u32 * CHAR_W
}

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

/// Where everything goes, in pixels of the picture.
#[derive(Clone, Debug)]
pub struct Layout {
    pub width: u32,
    pub height: u32,
    /// Left edge of the plot area (the y axis).
    pub plot_left: u32,
    pub plot_top: u32,
    /// Width of the plot area: one slot per group.
    pub plot_w: u32,
    /// Row of the x axis; bars end on it.
    pub baseline: u32,
    /// Width of one group's slot; its bars are centred in it.
    pub slot: u32,
    /// Horizontal pitch of the bars within a group (each bar is drawn 2 pixels narrower).
    pub bar_pitch: u32,
    /// The value at the top of the axis, which `PLOT_H` pixels stand for.
    pub axis_max: f64,
    pub ticks: Vec<f64>,
    /// Whether the category labels are turned up.
    pub turned: bool,
    labels_top: u32,
    legend_top: u32,
}

impl Layout {
    /// Left edge of the bar of `series` in `group`, from the plot's left edge.
    pub fn bar_x(&self, group: usize, series: usize, n_series: usize) -> u32 {
        let inner = n_series.max(1) as u32 * self.bar_pitch;
        group as u32 * self.slot + (self.slot - inner) / 2 + series as u32 * self.bar_pitch + 1
    }

    pub fn bar_width(&self) -> u32 {
        self.bar_pitch - 2
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
        let n_groups = self.groups.len().max(1) as u32;
        let n_series = self.n_series() as u32;
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
            .map(|l| text_width(l))
            .max()
            .unwrap_or(0);
        let flat_slot = (inner + GROUP_GAP).max(widest_line + 12);
        let turned = n_groups * flat_slot > MAX_FLAT_PLOT_W;
        let slot = if turned { inner + GROUP_GAP } else { flat_slot };
        let label_h = if turned {
            self.groups
                .iter()
                .map(|g| text_width(&g.join(" ")))
                .max()
                .unwrap_or(0)
        } else {
            self.groups.iter().map(Vec::len).max().unwrap_or(0) as u32 * LINE_H
        };

        let (axis_max, ticks) = nice_axis(self.max_value());
        let tick_w = ticks
            .iter()
            .map(|&t| text_width(&tick_label(t, ticks[1] - ticks[0])))
            .max()
            .unwrap_or(0);
        // Value labels are turned up above their bars, so the tallest bar's label needs
        // room between the title and the plot.
        let label_room = self
            .values
            .iter()
            .flatten()
            .flatten()
            .map(|&v| text_width(&compact(v)))
            .max()
            .unwrap_or(0)
            .max(text_width("N/A"))
            + 8;
        // The y axis label (turned up), a gap, the tick labels and the tick marks.
        let plot_left = MARGIN + LINE_H + 8 + tick_w + 12;
        let plot_top = MARGIN + TITLE_H + 8 + label_room;
        let plot_w = n_groups * slot;
        let baseline = plot_top + PLOT_H;
        let labels_top = baseline + 1 + AXIS_AREA + 6;
        let legend_top = labels_top + label_h + 16;
        let legend_w = (0..self.series.len())
            .map(|i| SWATCH_W + 8 + text_width(&self.legend_text(i)))
            .max()
            .unwrap_or(0);
        let title_w = self.title.chars().count() as u32 * TITLE_CHAR_W;
        let width = (plot_left + plot_w + 1 + MARGIN)
            .max(MARGIN + title_w + MARGIN)
            .max(MARGIN + legend_w + MARGIN);
        let height = legend_top + self.series.len() as u32 * LEGEND_ROW + MARGIN;
        Layout {
            width,
            height,
            plot_left,
            plot_top,
            plot_w,
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

    /// The chart as an SVG document.
    pub fn to_svg(&self) -> Result<String, DrawError> {
        let l = self.layout();
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (l.width, l.height)).into_drawing_area();
            self.draw(&root, &l)?;
            root.present()?;
        }
        Ok(svg)
    }

    fn draw(&self, root: &DrawingArea<SVGBackend, Shift>, l: &Layout) -> Result<(), DrawError> {
        let n_series = self.n_series();
        root.fill(&WHITE)?;
        let at = |x: u32, y: u32| (x as i32, y as i32);
        root.draw(&Text::new(
            self.title.clone(),
            at(MARGIN, MARGIN),
            text_style(TITLE, &INK).pos(Pos::new(HPos::Left, VPos::Top)),
        ))?;

        // Plotters maps a range onto the plot area's first to last pixel, so an area one
        // pixel wider and taller than `plot_w` × `PLOT_H` makes x count pixels from the y
        // axis and puts 0 on the baseline.
        let mut chart = ChartBuilder::on(root)
            .margin_top(l.plot_top)
            .margin_left(MARGIN)
            .margin_right(l.width - l.plot_left - l.plot_w - 1)
            .margin_bottom(l.height - l.baseline - 1 - AXIS_AREA)
            .set_label_area_size(LabelAreaPosition::Left, l.plot_left - MARGIN)
            .set_label_area_size(LabelAreaPosition::Bottom, AXIS_AREA)
            .build_cartesian_2d(
                0.0..l.plot_w as f64,
                Ticked::new(0.0..l.axis_max, l.ticks.clone()),
            )?;
        let step = l.ticks[1] - l.ticks[0];
        let y_tick = |v: &f64| tick_label(*v, step);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc(self.y_label.as_str())
            .y_label_formatter(&y_tick)
            .label_style(text_style(TEXT, &INK))
            .axis_desc_style(text_style(TEXT, &INK))
            .bold_line_style(GRID)
            .axis_style(INK)
            .draw()?;

        let mut bars = Vec::new();
        let mut labels = Vec::new();
        for (g, row) in self.values.iter().enumerate() {
            for s in 0..n_series {
                let left = l.bar_x(g, s, n_series) as f64;
                let right = left + l.bar_width() as f64;
                let value = row.get(s).copied().flatten();
                // Negative and non-finite values draw no bar.
                let top = value
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .map_or(0.0, |v| v.min(l.axis_max));
                if top > 0.0 {
                    bars.push(Rectangle::new(
                        [(left, 0.0), (right, top)],
                        series_colour(s).filled(),
                    ));
                }
                let (x, y) = chart.backend_coord(&((left + right) / 2.0, top));
                labels.push(match value {
                    Some(v) => Text::new(compact(v), (x, y - 4), turned_up(&INK)),
                    None => Text::new("N/A".to_string(), (x, y - 4), turned_up(&MUTED)),
                });
            }
        }
        chart.draw_series(bars)?;
        for label in labels {
            root.draw(&label)?;
        }

        for (g, lines) in self.groups.iter().enumerate() {
            let centre = g as f64 * l.slot as f64 + l.slot as f64 / 2.0;
            let x = chart.backend_coord(&(centre, 0.0)).0;
            if l.turned {
                // Reads upwards, ending just below the axis.
                let style = text_style(TEXT, &INK)
                    .transform(FontTransform::Rotate270)
                    .pos(Pos::new(HPos::Right, VPos::Center));
                root.draw(&Text::new(lines.join(" "), (x, l.labels_top as i32), style))?;
            } else {
                for (i, line) in lines.iter().enumerate() {
                    let y = l.labels_top + i as u32 * LINE_H;
                    let style = text_style(TEXT, &INK).pos(Pos::new(HPos::Center, VPos::Top));
                    root.draw(&Text::new(line.clone(), (x, y as i32), style))?;
                }
            }
        }

        for s in 0..self.series.len() {
            let y = l.legend_top + s as u32 * LEGEND_ROW;
            let corners = [at(MARGIN, y), at(MARGIN + SWATCH_W, y + SWATCH_H)];
            root.draw(&Rectangle::new(corners, series_colour(s).filled()))?;
            root.draw(&Rectangle::new(corners, INK))?;
            root.draw(&Text::new(
                self.legend_text(s),
                at(MARGIN + SWATCH_W + 8, y + SWATCH_H / 2),
                text_style(TEXT, &INK).pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
        }
        Ok(())
    }
}

/// The axis top and its ticks (0 first), 1, 2, 2.5 or 5 times a power of ten apart, about
/// five of them, the top at or above `max`. Plotters' own ticks skip 2.5 and leave the top
/// of the axis unlabelled, so these are given to it as key points.
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
/// is a whole number of them. (Plotters' default formatter prints float noise and no `K`.)
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

/// A value in at most five characters, for the label above a bar (a chart-specific rule
/// that no number-formatting crate has).
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

/// Reading back what plotters wrote, for the tests.
#[cfg(test)]
pub mod svg {
    use std::collections::HashMap;

    use plotters::style::RGBColor;

    /// The attributes of every element named `name`, in document order.
    pub fn elements(svg: &str, name: &str) -> Vec<HashMap<String, String>> {
        let doc = roxmltree::Document::parse(svg).expect("well-formed SVG");
        doc.descendants()
            .filter(|n| n.has_tag_name(name))
            .map(|n| {
                n.attributes()
                    .map(|a| (a.name().to_string(), a.value().to_string()))
                    .collect()
            })
            .collect()
    }

    /// The SVG's `#RRGGBB` for a colour.
    pub fn hex(c: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    pub fn number(attrs: &HashMap<String, String>, key: &str) -> f64 {
        attrs[key]
            .parse()
            .unwrap_or_else(|_| panic!("{key} = {}", attrs[key]))
    }

    /// (x, y, width, height) of the filled rectangles in colour `c`, in document order.
    pub fn filled_rects(svg: &str, c: RGBColor) -> Vec<[f64; 4]> {
        elements(svg, "rect")
            .into_iter()
            .filter(|a| a.get("fill") == Some(&hex(c)))
            .map(|a| ["x", "y", "width", "height"].map(|k| number(&a, k)))
            .collect()
    }

    /// The text of every `<text>` element, unescaped.
    pub fn texts(svg: &str) -> Vec<String> {
        let doc = roxmltree::Document::parse(svg).expect("well-formed SVG");
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| n.text().unwrap_or("").trim().to_string())
            .collect()
    }

    /// Width and height of the document.
    pub fn size(svg: &str) -> (f64, f64) {
        let root = &elements(svg, "svg")[0];
        (number(root, "width"), number(root, "height"))
    }
}

#[cfg(test)]
mod tests;
