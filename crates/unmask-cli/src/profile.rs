//! `unmask profile`: BiCache's offline profiling over a task set — per prefix ratio and layer,
//! how similar the shared prefix's K/V stay when a prompt follows it — written as the depth
//! table the engine reads (`bicache_depth.json`), the similarity matrix (JSON) and a heat map
//! (PNG).

use std::path::{Path, PathBuf};

use clap::Args;
use serde_json::json;
use unmask::DEPTH_TABLE_FILE;
use unmask::profile::{ItemOutcome, Profile, ProfileItem, ProfileOptions, profile_with};
use unmask_core::depth_policy::DepthTable;

use crate::error::CliError;
use crate::eval::{Item, command_line, load_set};
use crate::options::{self, EngineArgs, ModelArgs};
use crate::png::{Canvas, Rgb, text_width};
use crate::{output, values};

pub const SIMILARITY_JSON: &str = "similarity.json";
pub const SIMILARITY_PNG: &str = "similarity.png";

#[derive(Args, Debug)]
#[command(
    about = "Profile BiCache's safe depth per prefix ratio and write the depth table.",
    override_usage = "unmask profile [--model <DIR>] --set <FILE> --out <DIR> [--tau <T>] [--gen-length <G>] \
                      [--limit <N>] [--user-repeat <K1,K2,...>]",
    after_help = "For every item the shared prefix is run alone and with the rest of the prompt,\n\
                  and each layer scores the cosine similarity of the prefix's K and V between\n\
                  the two (mean over tokens, K and V). Items are bucketed by\n\
                  r = round(100*P/(P+U+G)); the depth at r is the number of leading layers whose\n\
                  mean similarity exceeds tau, kept where it grows with r. Copy\n\
                  DIR/bicache_depth.json into the model folder for `--cache bicache` to use it."
)]
pub struct ProfileArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// the items: JSON lines {id, task, system, user, answer, prompt_group}; the system turn
    /// is the shared prefix
    #[arg(long, value_name = "FILE")]
    set: PathBuf,
    /// folder for bicache_depth.json, similarity.json and similarity.png (created)
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
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(args: &ProfileArgs) -> Result<(), CliError> {
    let set_path = &args.set;
    let out_dir = &args.out;
    let tau = args.tau;
    let gen_length = args.gen_length;
    let limit = args.limit;
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
        "profiling {} requests from {} of {set_items} items of {} (tau {tau}, gen-length {gen_length})",
        items.len(),
        set.len(),
        set_path.display()
    );

    let opts = ProfileOptions {
        tau,
        gen_length,
        model_id: Some(model_id(&dir)),
        source: command_line(),
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
                    unmask::profile::safe_depth(&p.similarity, tau)
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
    write(
        &out_dir.join(SIMILARITY_PNG),
        &heat_map(&profile.similarity, tau).to_png(),
    )?;
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
        "{} (tau {}, {} layers): mean K/V similarity per prefix ratio r and layer\n",
        t.model_id, t.tau, t.n_layers
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
const CELL: usize = 12;
const WHITE: Rgb = [255, 255, 255];
const INK: Rgb = [32, 32, 32];

/// Viridis-like stops from low to high.
const STOPS: [Rgb; 5] = [
    [68, 1, 84],
    [59, 82, 139],
    [33, 145, 140],
    [94, 201, 98],
    [253, 231, 37],
];

/// The colour of `t` in [0, 1].
fn colour(t: f64) -> Rgb {
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let x = t * (STOPS.len() - 1) as f64;
    let i = (x.floor() as usize).min(STOPS.len() - 2);
    let f = x - i as f64;
    let mix = |a: u8, b: u8| (a as f64 + (b as f64 - a as f64) * f).round() as u8;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    [mix(a[0], b[0]), mix(a[1], b[1]), mix(a[2], b[2])]
}

/// A marker colour that stands out on `c`.
fn marker_on(c: Rgb) -> Rgb {
    let luma = 0.299 * c[0] as f64 + 0.587 * c[1] as f64 + 0.114 * c[2] as f64;
    if luma > 128.0 { [0, 0, 0] } else { WHITE }
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

/// Rows = ratio buckets ascending (labelled with r), columns = layers (labelled above),
/// colour = similarity from the scale's low end to 1.0 (bar on the right, τ ticked), and a
/// square marker on every cell above τ.
pub fn heat_map(similarity: &[(u32, usize, Vec<f64>)], tau: f64) -> Canvas {
    let rows = similarity.len().max(1);
    let cols = similarity
        .iter()
        .map(|b| b.2.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let low = scale_low(similarity, tau);
    let shade = |v: f64| colour((v - low) / (1.0 - low));
    let label_scale = 2;
    let row_label_w = similarity
        .iter()
        .map(|b| text_width(&b.0.to_string(), label_scale))
        .max()
        .unwrap_or(0)
        .max(text_width("100", label_scale));
    let left = 4 + row_label_w + 4;
    let top = 4 + crate::png::GLYPH_H + 3;
    let grid_w = cols * CELL;
    let grid_h = rows * CELL;
    let bar_x = left + grid_w + 10;
    let bar_w = CELL;
    let bar_h = grid_h.max(60);
    let (top_label, low_label) = ("1.00".to_string(), format!("{low:.2}"));
    let bar_label_w = text_width(&top_label, label_scale).max(text_width(&low_label, label_scale));
    let width = bar_x + bar_w + 4 + bar_label_w + 4;
    let height = top + bar_h + 4;
    let mut c = Canvas::new(width, height, WHITE);

    for (row, (r, _, s)) in similarity.iter().enumerate() {
        let y = top + row * CELL;
        let label = r.to_string();
        let lx = left - 4 - text_width(&label, label_scale);
        c.text(lx, y + 1, &label, label_scale, INK);
        for (col, &v) in s.iter().enumerate() {
            let x = left + col * CELL;
            let fill = shade(v);
            c.fill(x, y, CELL - 1, CELL - 1, fill);
            if v > tau {
                c.fill(x + 4, y + 4, 3, 3, marker_on(fill));
            }
        }
    }
    for col in 0..cols {
        // Every layer when labels fit the cell, else every fourth.
        let label = col.to_string();
        if text_width(&label, 1) > CELL - 2 && col % 4 != 0 {
            continue;
        }
        let x = left + col * CELL + (CELL - 1).saturating_sub(text_width(&label, 1)) / 2;
        c.text(x, 4, &label, 1, INK);
    }
    for dy in 0..bar_h {
        let v = 1.0 - (1.0 - low) * dy as f64 / (bar_h - 1) as f64;
        c.fill(bar_x, top + dy, bar_w, 1, shade(v));
    }
    if tau > low && tau <= 1.0 {
        let dy = ((1.0 - tau) / (1.0 - low) * (bar_h - 1) as f64).round() as usize;
        c.fill(bar_x - 3, top + dy, bar_w + 3, 1, INK);
    }
    let label_x = bar_x + bar_w + 4;
    c.text(label_x, top, &top_label, label_scale, INK);
    c.text(
        label_x,
        top + bar_h - crate::png::GLYPH_H * label_scale,
        &low_label,
        label_scale,
        INK,
    );
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heat_map_cells_scale_and_markers() {
        let sim = vec![(20, 3, vec![1.0, 0.5]), (80, 1, vec![1.0, 0.99])];
        let c = heat_map(&sim, 0.97);
        let left = 4 + text_width("100", 2) + 4;
        let top = 4 + 5 + 3;
        // Top-left corner of each cell: the colour of its similarity on a 0.50..1.00 scale.
        let cell = |row: usize, col: usize| c.get(left + col * CELL, top + row * CELL);
        assert_eq!(cell(0, 0), STOPS[4]);
        assert_eq!(cell(0, 1), STOPS[0]);
        assert_eq!(cell(1, 0), STOPS[4]);
        // Markers on the cells above tau only.
        let centre = |row: usize, col: usize| c.get(left + col * CELL + 5, top + row * CELL + 5);
        assert_eq!(centre(0, 0), [0, 0, 0]);
        assert_eq!(centre(1, 1), [0, 0, 0]);
        assert_eq!(centre(0, 1), STOPS[0]);
        assert_eq!(c.height, top + 60 + 4);
        assert!(c.to_png().starts_with(&crate::png::PNG_SIGNATURE));
    }

    #[test]
    fn colours_run_from_low_to_high() {
        assert_eq!(colour(0.0), STOPS[0]);
        assert_eq!(colour(1.0), STOPS[4]);
        assert_eq!(colour(f64::NAN), STOPS[0]);
        assert_eq!(scale_low(&[(0, 1, vec![1.0, 1.0])], 0.97), 0.97);
        assert_eq!(scale_low(&[(0, 1, vec![1.0, 1.0])], 1.0), 0.99);
        assert_eq!(scale_low(&[(0, 1, vec![0.456])], 0.97), 0.45);
    }
}
