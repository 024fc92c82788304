//! `unmask profile`: BiCache's offline profiling over a task set — per prefix ratio and layer,
//! how similar the shared prefix's K/V stay when a prompt follows it — written as the depth
//! table the engine reads (`bicache_depth.json`), the similarity matrix (JSON) and a heat map
//! (SVG, drawn with plotters). `--row-statistic` picks how a layer's per-row similarities
//! become its score, `--depth-rule` how the scores give the depth (`unmask::profile`).

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::json;
use unmask::DEPTH_TABLE_FILE;
use unmask::profile::{
    DepthRule, ItemOutcome, Profile, ProfileItem, ProfileOptions, RowStatistic, profile_with,
};
use unmask_core::depth_policy::DepthTable;

use crate::chart::{DrawError, INK, LINE_H, MARGIN, TEXT, Ticked, text_style, text_width};
use crate::error::CliError;
use crate::eval::{Item, command_line, load_set};
use crate::options::{self, EngineArgs, ModelArgs};
use crate::{output, values};

pub const SIMILARITY_JSON: &str = "similarity.json";
pub const SIMILARITY_SVG: &str = "similarity.svg";

#[derive(Args, Debug)]
#[command(
    about = "Profile BiCache's safe depth per prefix ratio and write the depth table.",
    override_usage = "unmask profile [--model <DIR>] --set <FILE> --out <DIR> [--tau <T>] [--gen-length <G>] \
                      [--limit <N>] [--user-repeat <K1,K2,...>] [--row-statistic <mean|min|p1|low3|p1-low3>] \
                      [--depth-rule <leading|boundary>]",
    after_help = "For every item the shared prefix is run alone and with the rest of the prompt,\n\
                  and each layer scores the cosine similarity of the prefix's K and V between\n\
                  the two, row by row: the mean over rows, K and V (--row-statistic mean, the\n\
                  official profiler), or the smallest of any row's K and V cosines (min: sees\n\
                  the few rows a question reads, which the mean hides), or its 1st percentile\n\
                  over rows (p1: those rows too, but not one odd row alone), or the third-lowest\n\
                  row (low3: like p1, but two odd rows ignored at any prefix length), or p1 up to\n\
                  300 prefix rows and low3 beyond (p1-low3). Items are bucketed by\n\
                  r = round(100*P/(P+U+G)) and a bucket scores the mean of its items' scores.\n\
                  With n the number of leading layers whose score exceeds tau, the depth at r\n\
                  is n (--depth-rule leading, the official rule) or, by default, n - 1 when a\n\
                  layer fails (boundary): BiCache at depth b also starts layer b from the\n\
                  stored output of layer b - 1, and layer b's K/V similarity measures that\n\
                  state's drift, so layers 0..=b must all pass. Depths are kept where they\n\
                  grow with r; the table's source names the statistic and the rule. Copy\n\
                  DIR/bicache_depth.json into the model folder for `--cache bicache` to use it."
)]
pub struct ProfileArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// the items: JSON lines {id, task, system, user, answer, prompt_group}; the system turn
    /// is the shared prefix
    #[arg(long, value_name = "FILE")]
    set: PathBuf,
    /// folder for bicache_depth.json, similarity.json and similarity.svg (created)
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// similarity a layer must exceed to be reused, in (0, 1] (default 0.97)
    #[arg(
        long,
        value_name = "T",
        value_parser = values::fraction::<f64>,
        allow_negative_numbers = true,
        default_value_t = 0.97,
        hide_default_value = true
    )]
    tau: f64,
    /// masked canvas tokens after the prompt in the profiling pass (default 0, as the
    /// official profiler; the engine's ratio counts them)
    #[arg(
        long,
        value_name = "G",
        value_parser = values::whole,
        allow_negative_numbers = true,
        default_value_t = 0,
        hide_default_value = true
    )]
    gen_length: usize,
    /// profile only the first N items of the set
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true)]
    limit: Option<usize>,
    /// also profile every item with its user text repeated K times (longer prompts, smaller
    /// ratios), e.g. 2,4,8
    // The path spelled out: one value holding the list, not a value per occurrence.
    #[arg(long, value_name = "K1,K2,...", value_parser = values::positive_list)]
    user_repeat: Option<::std::vec::Vec<usize>>,
    /// a layer's score per item from its per-row K/V cosines: mean (default, the official
    /// profiler), min (the least similar row of K and V), p1 (the 1st percentile of those rows)
    /// low3 (the third-lowest of those rows) or p1-low3 (p1 up to 300 rows, low3 beyond)
    #[arg(
        long,
        value_name = "S",
        default_value = "mean",
        hide_default_value = true
    )]
    row_statistic: RowStatisticArg,
    /// the depth from the scores, with n the leading layers above tau: boundary (default;
    /// n - 1 when a layer fails, as the state feeding it is reused too) or leading (n, the
    /// official rule)
    #[arg(
        long,
        value_name = "R",
        default_value = "boundary",
        hide_default_value = true
    )]
    depth_rule: DepthRuleArg,
    #[command(flatten)]
    engine: EngineArgs,
}

/// `--row-statistic`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RowStatisticArg {
    Mean,
    Min,
    P1,
    Low3,
    /// p1 up to 300 prefix rows, low3 beyond.
    #[value(name = "p1-low3")]
    P1Low3,
}

impl From<RowStatisticArg> for RowStatistic {
    fn from(a: RowStatisticArg) -> Self {
        match a {
            RowStatisticArg::Mean => RowStatistic::Mean,
            RowStatisticArg::Min => RowStatistic::Min,
            RowStatisticArg::P1 => RowStatistic::P1,
            RowStatisticArg::Low3 => RowStatistic::Low3,
            RowStatisticArg::P1Low3 => RowStatistic::P1Low3,
        }
    }
}

/// `--depth-rule`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DepthRuleArg {
    Leading,
    Boundary,
}

impl From<DepthRuleArg> for DepthRule {
    fn from(a: DepthRuleArg) -> Self {
        match a {
            DepthRuleArg::Leading => DepthRule::Leading,
            DepthRuleArg::Boundary => DepthRule::Boundary,
        }
    }
}

pub fn run(args: &ProfileArgs) -> Result<(), CliError> {
    let set_path = &args.set;
    let out_dir = &args.out;
    let tau = args.tau;
    let gen_length = args.gen_length;
    let limit = args.limit;
    let statistic = RowStatistic::from(args.row_statistic);
    let rule = DepthRule::from(args.depth_rule);
    let repeats = user_repeats(args.user_repeat.as_deref().unwrap_or_default());
    let engine_options = args.engine.options()?;
    if out_dir.exists() && !out_dir.is_dir() {
        return Err(CliError::usage(format!(
            "--out {} is a file: expected a folder",
            out_dir.display()
        )));
    }

    let mut set = load_set(set_path)?;
    let set_items = set.len();
    if let Some(n) = limit {
        set.truncate(n);
    }
    let (items, labels) = profile_items(&set, &repeats);
    let dir = args.model.dir()?;
    let engine = options::load_engine(&dir, &engine_options)?;
    if engine.tokenizer().is_none() {
        return Err(CliError::runtime(format!(
            "{} has no tokenizer.json: profile renders text prompts and needs one",
            dir.display()
        )));
    }
    std::fs::create_dir_all(out_dir)
        .map_err(|e| CliError::context(format!("cannot create --out {}", out_dir.display()), e))?;
    eprintln!(
        "profiling {} requests from {} of {set_items} items of {} (tau {tau}, gen-length {gen_length}, \
         row statistic {}, depth rule {})",
        items.len(),
        set.len(),
        set_path.display(),
        statistic.name(),
        rule.name()
    );

    let opts = ProfileOptions {
        tau,
        gen_length,
        model_id: Some(model_id(&dir)),
        source: command_line(),
        statistic,
        rule,
    };
    let total = items.len();
    let mut done = 0;
    let profile = profile_with(&engine, &items, &opts, &mut |outcome| {
        done += 1;
        match outcome {
            ItemOutcome::Profiled(p) => {
                let min = p.similarity.iter().copied().fold(f64::INFINITY, f64::min);
                eprintln!(
                    "[profile {done}/{total}] {}: P = {}, U = {}, r = {}, depth {}, min similarity {min:.4}",
                    labels[p.index],
                    p.prefix_len,
                    p.rest_len,
                    p.ratio,
                    rule.depth(&p.similarity, tau)
                );
            }
            ItemOutcome::Skipped { index, reason } => {
                eprintln!(
                    "[profile {done}/{total}] {}: skipped ({reason})",
                    labels[*index]
                );
            }
        }
    })?;
    // What the engine will read must load back.
    let table_text = serde_json::to_string_pretty(&profile.table)
        .map_err(|e| CliError::context("cannot encode the depth table", e))?;
    DepthTable::from_json(&table_text, DEPTH_TABLE_FILE)
        .map_err(|e| CliError::runtime(format!("the profiled table is invalid: {e}")))?;
    write(
        &out_dir.join(DEPTH_TABLE_FILE),
        (table_text + "\n").as_bytes(),
    )?;
    let matrix = similarity_json(&profile, gen_length, &labels);
    let matrix_text = serde_json::to_string_pretty(&matrix)
        .map_err(|e| CliError::context("cannot encode the similarity matrix", e))?;
    write(
        &out_dir.join(SIMILARITY_JSON),
        (matrix_text + "\n").as_bytes(),
    )?;
    let map = heat_map(&profile.similarity, tau)
        .map_err(|e| CliError::context("cannot draw the heat map", e))?;
    write(&out_dir.join(SIMILARITY_SVG), map.as_bytes())?;
    output::partial(&summary_text(&profile))?;
    eprintln!(
        "to use the table: copy {} into {}",
        out_dir.join(DEPTH_TABLE_FILE).display(),
        dir.display()
    );
    Ok(())
}

/// The repeat counts of `--user-repeat`, in the order given without duplicates, after 1 (the
/// item as it is), which is always included.
fn user_repeats(given: &[usize]) -> Vec<usize> {
    let mut out = vec![1];
    for &k in given {
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// Every set item once per repeat count, with a label for progress lines.
fn profile_items(set: &[Item], repeats: &[usize]) -> (Vec<ProfileItem>, Vec<String>) {
    let mut items = Vec::new();
    let mut labels = Vec::new();
    for item in set {
        for &k in repeats {
            let user = vec![item.user.trim(); k].join(" ");
            items.push(ProfileItem::chat(item.system.as_deref(), &user));
            labels.push(if k == 1 {
                item.id.clone()
            } else {
                format!("{} (user x{k})", item.id)
            });
        }
    }
    (items, labels)
}

/// The model folder's name (of its absolute path when given as `.` or similar).
fn model_id(dir: &Path) -> String {
    let named = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
    named(dir)
        .or_else(|| dir.canonicalize().ok().as_deref().and_then(named))
        .unwrap_or_else(|| dir.display().to_string())
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), CliError> {
    std::fs::write(path, bytes)
        .map_err(|e| CliError::context(format!("cannot write {}", path.display()), e))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Ratios × layers, with sample counts, depths and the table.
fn similarity_json(p: &Profile, gen_length: usize, labels: &[String]) -> serde_json::Value {
    let t = &p.table;
    json!({
        "model_id": t.model_id,
        "tau": t.tau,
        "gen_length": gen_length,
        "ratio_definition": t.ratio_definition,
        "source": t.source,
        "row_statistic": p.statistic.name(),
        "depth_rule": p.rule.name(),
        "n_layers": t.n_layers,
        "ratios": p.similarity.iter().map(|b| b.0).collect::<Vec<_>>(),
        "samples": p.similarity.iter().map(|b| b.1).collect::<Vec<_>>(),
        "depths": p.depths(),
        "similarity": p.similarity.iter().map(|b| b.2.clone()).collect::<Vec<_>>(),
        "entries": t.entries,
        "skipped": p.skipped.iter().map(|(i, why)| json!({
            "item": labels.get(*i).cloned().unwrap_or_else(|| i.to_string()),
            "reason": why,
        })).collect::<Vec<_>>(),
    })
}

/// The bucket matrix and the table as text for stdout.
fn summary_text(p: &Profile) -> String {
    let t = &p.table;
    let mut out = format!(
        "{} (tau {}, {} layers): K/V similarity per prefix ratio r and layer (row statistic {}, \
         mean over items; depth rule {})\n",
        t.model_id,
        t.tau,
        t.n_layers,
        p.statistic.name(),
        p.rule.name()
    );
    out.push_str(&format!("{:>5} {:>7} {:>5} ", "r", "samples", "depth"));
    for l in 0..t.n_layers {
        out.push_str(&format!(" {:>6}", format!("L{l}")));
    }
    out.push('\n');
    for ((r, n, s), depth) in p.similarity.iter().zip(p.depths()) {
        out.push_str(&format!("{r:>5} {n:>7} {depth:>5} "));
        for v in s {
            out.push_str(&format!(" {v:>6.4}"));
        }
        out.push('\n');
    }
    let entries: Vec<String> = t
        .entries
        .iter()
        .map(|(r, b)| format!("r >= {r}: b = {b}"))
        .collect();
    out.push_str(&format!("table: {}\n", entries.join(", ")));
    if !p.skipped.is_empty() {
        out.push_str(&format!("skipped: {} request(s)\n", p.skipped.len()));
    }
    out
}

/// Pixels per heat-map cell (the colour fills all but its last row and column).
const CELL: u32 = 16;
/// Width of the colour bar, and the least height it is drawn at.
const BAR_W: u32 = 16;
const BAR_MIN_H: u32 = 120;
/// Most stripes the colour bar is drawn with.
const BAR_STRIPES: u32 = 100;

/// The colour of `t` in [0, 1] on plotters' viridis map (NaN as the low end).
fn colour(t: f64) -> RGBColor {
    ViridisRGB.get_color(if t.is_nan() { 0.0 } else { t })
}

/// A marker colour that stands out on `c`.
fn marker_on(c: RGBColor) -> RGBColor {
    let luma = 0.299 * c.0 as f64 + 0.587 * c.1 as f64 + 0.114 * c.2 as f64;
    if luma > 128.0 { BLACK } else { WHITE }
}

/// The bottom of the colour scale: the lowest similarity (and τ), rounded down to 0.01.
fn scale_low(similarity: &[(u32, usize, Vec<f64>)], tau: f64) -> f64 {
    let min = similarity
        .iter()
        .flat_map(|b| b.2.iter().copied())
        .filter(|v| v.is_finite())
        .fold(tau, f64::min);
    // The epsilon keeps 0.97 from becoming 0.96 through its binary representation.
    let low = (min * 100.0 + 1e-9).floor() / 100.0;
    if low >= 1.0 { 0.99 } else { low.max(-1.0) }
}

/// The heat map as SVG: rows = ratio buckets ascending from the top (labelled with r),
/// columns = layers (labelled above), colour = similarity from the scale's low end to 1.0
/// (bar on the right, τ marked), and a dot on every cell above τ.
pub fn heat_map(similarity: &[(u32, usize, Vec<f64>)], tau: f64) -> Result<String, DrawError> {
    let rows = similarity.len().max(1) as u32;
    let cols = similarity
        .iter()
        .map(|b| b.2.len())
        .max()
        .unwrap_or(0)
        .max(1) as u32;
    let low = scale_low(similarity, tau);
    let shade = |v: f64| colour((v - low) / (1.0 - low));
    let row_label_w = similarity
        .iter()
        .map(|b| text_width(&b.0.to_string()))
        .max()
        .unwrap_or(0)
        .max(text_width("100"));
    // The axis name ("r", turned up), the row labels and the tick marks.
    let left_area = LINE_H + 6 + row_label_w + 10;
    // The axis name ("layer") above the column labels.
    let top_area = 2 * LINE_H + 8;
    let (grid_w, grid_h) = (cols * CELL, rows * CELL);
    let bar_h = grid_h.max(BAR_MIN_H);
    let bar_label_w = text_width("0.97") + 10;
    // Plotters maps a range onto a plot area's first to last pixel: each area is one pixel
    // wider and taller than what it shows, so cells are exactly CELL pixels.
    let map_w = MARGIN + left_area + grid_w + 1;
    let width = map_w + 16 + BAR_W + 1 + bar_label_w + MARGIN;
    let height = MARGIN + top_area + bar_h + 1 + MARGIN;

    // Bucket i fills y in [rows - 1 - i, rows - i], so the first bucket is the top row.
    let cells: Vec<(usize, usize, f64)> = similarity
        .iter()
        .enumerate()
        .flat_map(|(i, b)| b.2.iter().enumerate().map(move |(c, &v)| (i, c, v)))
        .collect();
    let y_of = |i: usize| (rows as usize - 1 - i) as f64;
    // Every layer labelled when its number fits a cell, else every fourth.
    let every = if text_width(&(cols - 1).to_string()) + 2 > CELL {
        4
    } else {
        1
    };
    let x_keys = (0..cols).step_by(every).map(|c| c as f64 + 0.5).collect();
    let y_keys = (0..rows).map(|r| r as f64 + 0.5).collect();
    let layer = |x: &f64| format!("{}", x.floor() as usize);
    let ratio = |y: &f64| {
        let i = (rows as usize).checked_sub(1 + y.floor() as usize);
        i.and_then(|i| similarity.get(i))
            .map_or(String::new(), |b| b.0.to_string())
    };
    // τ's value is labelled on the colour bar when its label clears the two ends'.
    let per_unit = bar_h as f64 / (1.0 - low);
    let tau_shown = tau > low && tau <= 1.0;
    let tau_labelled = tau_shown
        && (tau - low) * per_unit >= LINE_H as f64
        && (1.0 - tau) * per_unit >= LINE_H as f64;
    let mut bar_keys = vec![low, 1.0];
    if tau_labelled {
        bar_keys.push(tau);
    }
    let bar_label = |v: &f64| format!("{v:.2}");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (map_area, bar_area) = root.split_horizontally(map_w);

        let mut map = ChartBuilder::on(&map_area)
            .margin_left(MARGIN)
            .margin_top(MARGIN)
            .margin_bottom(height - MARGIN - top_area - grid_h - 1)
            .set_label_area_size(LabelAreaPosition::Left, left_area)
            .set_label_area_size(LabelAreaPosition::Top, top_area)
            .build_cartesian_2d(
                Ticked::new(0.0..cols as f64, x_keys),
                Ticked::new(0.0..rows as f64, y_keys),
            )?;
        map.draw_series(cells.iter().map(|&(i, c, v)| {
            let (x, y) = (c as f64, y_of(i));
            let mut cell = Rectangle::new([(x, y + 1.0), (x + 1.0, y)], shade(v).filled());
            cell.set_margin(0, 1, 0, 1);
            cell
        }))?;
        map.draw_series(cells.iter().filter(|c| c.2 > tau).map(|&(i, c, v)| {
            let centre = (c as f64 + 0.5, y_of(i) + 0.5);
            Circle::new(centre, 2, marker_on(shade(v)).filled())
        }))?;
        map.configure_mesh()
            .disable_mesh()
            .x_desc("layer")
            .y_desc("r")
            .x_label_formatter(&layer)
            .y_label_formatter(&ratio)
            .label_style(text_style(TEXT, &INK))
            .axis_desc_style(text_style(TEXT, &INK))
            .axis_style(INK)
            .draw()?;

        let mut bar = ChartBuilder::on(&bar_area)
            .margin_left(16)
            .margin_top(MARGIN + top_area)
            .margin_bottom(height - MARGIN - top_area - bar_h - 1)
            .margin_right(MARGIN)
            .set_label_area_size(LabelAreaPosition::Right, bar_label_w)
            .build_cartesian_2d(0.0..1.0, Ticked::new(low..1.0, bar_keys))?;
        let stripes = bar_h.min(BAR_STRIPES);
        let at = |k: u32| low + (1.0 - low) * k as f64 / stripes as f64;
        bar.draw_series((0..stripes).map(|k| {
            let fill = shade((at(k) + at(k + 1)) / 2.0);
            Rectangle::new([(0.0, at(k)), (1.0, at(k + 1))], fill.filled())
        }))?;
        if tau_shown {
            let line = PathElement::new(vec![(0.0, tau), (1.0, tau)], INK.stroke_width(2));
            bar.draw_series(std::iter::once(line))?;
            let (x, y) = bar.backend_coord(&(0.0, tau));
            let style = text_style(TEXT, &INK).pos(Pos::new(HPos::Right, VPos::Center));
            root.draw(&Text::new("τ", (x - 3, y), style))?;
        }
        bar.configure_mesh()
            .disable_mesh()
            .x_labels(0)
            .y_label_formatter(&bar_label)
            .label_style(text_style(TEXT, &INK))
            .axis_style(INK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests;
