//! `unmask bench-report`: the JSON lines of `unmask bench` from several machines and
//! backends, merged into one markdown report (sources, kernels, requests) and two SVG bar
//! charts.
//!
//! A source is one (adapter, backend, model, weights); its records may come from several
//! files, and repeated measurements of one configuration in a source are merged by taking
//! the median of each figure, so re-running a benchmark and passing every run steadies the
//! numbers instead of adding rows.

mod charts;
mod collect;
#[cfg(test)]
mod fixtures;
mod markdown;
mod merge;

use std::path::{Path, PathBuf};

use clap::Args;

use crate::chart::BarChart;
use crate::error::CliError;
use crate::eval::command_line;

use charts::{kernels_chart, requests_chart};
use collect::Collected;
use markdown::{kernels_table, requests_table, sources_table};
use merge::Merged;

pub const REPORT_MD: &str = "report.md";
pub const REQUESTS_SVG: &str = "requests.svg";
pub const KERNELS_SVG: &str = "kernels.svg";

#[derive(Args, Debug)]
#[command(
    about = "Merge `unmask bench` JSON lines from several machines into a markdown report with plots.",
    override_usage = "unmask bench-report <FILE>... --out <DIR>",
    after_help = "A source is one (adapter, backend, model, weights); each gets a column. Within a\n\
                  source, repeated measurements of one kernel case/shape/format/variant or one\n\
                  cache/decoding/shape are merged by the median of each figure. Lines that do not\n\
                  start with `{` are skipped, so captured logs can be passed as they are."
)]
pub struct BenchReportArgs {
    /// JSON-lines files written by `unmask bench` (one or more)
    #[arg(value_name = "FILE", required = true)]
    files: Vec<String>,
    /// folder for report.md, requests.svg and kernels.svg (created if needed)
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

pub fn run(args: &BenchReportArgs) -> Result<(), CliError> {
    let files = &args.files;
    let out = &args.out;
    let inputs = files
        .iter()
        .map(|name| {
            std::fs::read_to_string(name)
                .map(|text| Input {
                    name: name.clone(),
                    text,
                })
                .map_err(|e| CliError::context(format!("cannot read {name}"), e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let report = build(&inputs, &command_line())?;
    let written = report.write(out)?;
    let count = |n: usize, what: &str| format!("{n} {what}{}", plural(n));
    eprintln!(
        "{}, {}, {}; wrote {}",
        count(report.sources, "source"),
        count(report.kernel_rows, "kernel row"),
        count(report.request_rows, "request row"),
        written
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// One input file: its name as given (used in messages and the report) and its text.
#[derive(Clone, Debug)]
pub struct Input {
    pub name: String,
    pub text: String,
}

/// The finished report, before anything is written.
pub struct Report {
    pub markdown: String,
    /// Each chart and its SVG; absent when the inputs hold no records of that kind.
    pub kernels: Option<(BarChart, String)>,
    pub requests: Option<(BarChart, String)>,
    pub sources: usize,
    pub kernel_rows: usize,
    pub request_rows: usize,
}

impl Report {
    /// Writes `report.md` and the charts into `dir` (created if needed); returns the paths.
    pub fn write(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>, CliError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| CliError::context(format!("cannot create {}", dir.display()), e))?;
        let mut files: Vec<(&str, &str)> = vec![(REPORT_MD, &self.markdown)];
        if let Some((_, svg)) = &self.kernels {
            files.push((KERNELS_SVG, svg));
        }
        if let Some((_, svg)) = &self.requests {
            files.push((REQUESTS_SVG, svg));
        }
        let mut written = Vec::new();
        for (name, bytes) in files {
            let path = dir.join(name);
            std::fs::write(&path, bytes)
                .map_err(|e| CliError::context(format!("cannot write {}", path.display()), e))?;
            written.push(path);
        }
        Ok(written)
    }
}

/// Reads every input and lays out the report; `command` is the command line quoted in it.
pub fn build(inputs: &[Input], command: &str) -> Result<Report, CliError> {
    let mut collected = Collected::default();
    for input in inputs {
        collected.read(input)?;
    }
    let records: usize = collected.kernels.values().map(Vec::len).sum::<usize>()
        + collected.requests.values().map(Vec::len).sum::<usize>();
    // DiffusionGemma's decoder-step records have cases of their own; `unmask bench` prints
    // them with each format's step estimate.
    let dgemma = match collected.diffusion_gemma {
        0 => String::new(),
        n => format!(
            "DiffusionGemma records: {n} (decoder-step kernels and estimates), not charted \
             here; `unmask bench --config diffusiongemma-26b-a4b` prints them."
        ),
    };
    if records == 0 {
        let names: Vec<&str> = inputs.iter().map(|i| i.name.as_str()).collect();
        return Err(CliError::runtime(format!(
            "no benchmark records (JSON lines with \"record\": \"kernel\" or \"request\") in {}{}",
            names.join(", "),
            if dgemma.is_empty() {
                String::new()
            } else {
                format!("; {dgemma}")
            }
        )));
    }
    let merged = Merged::new(collected);
    let kernel_rows = merged.kernel_rows();
    let request_rows = merged.request_rows();

    let mut md = String::new();
    md.push_str("# Benchmark report\n\n");
    md.push_str(&format!(
        "Made by `{command}` (unmask {}) from {records} records in {} file{}: {} source{}, \
         {} kernel row{}, {} request row{}.\n\n",
        env!("CARGO_PKG_VERSION"),
        inputs.len(),
        plural(inputs.len()),
        merged.sources.len(),
        plural(merged.sources.len()),
        kernel_rows.len(),
        plural(kernel_rows.len()),
        request_rows.len(),
        plural(request_rows.len()),
    ));
    if !dgemma.is_empty() {
        md.push_str(&format!("{dgemma}\n\n"));
    }
    sources_table(&mut md, &merged);
    md.push_str("## Kernels\n\n");
    let kernels = if kernel_rows.is_empty() {
        md.push_str("No kernel records.\n\n");
        None
    } else {
        kernels_table(&mut md, &merged, &kernel_rows);
        let chart = kernels_chart(&merged, &kernel_rows);
        let svg = chart
            .to_svg()
            .map_err(|e| CliError::context("cannot draw the kernels chart", e))?;
        md.push_str(&format!(
            "![Best GFLOP/s per kernel case and format]({KERNELS_SVG})\n\n"
        ));
        Some((chart, svg))
    };
    md.push_str("## Requests\n\n");
    let requests = if request_rows.is_empty() {
        md.push_str("No request records.\n\n");
        None
    } else {
        requests_table(&mut md, &merged, &request_rows);
        let chart = requests_chart(&merged, &request_rows);
        let svg = chart
            .to_svg()
            .map_err(|e| CliError::context("cannot draw the requests chart", e))?;
        md.push_str(&format!(
            "![Canvas throughput per cache mode]({REQUESTS_SVG})\n\n"
        ));
        Some((chart, svg))
    };
    Ok(Report {
        markdown: md,
        kernels,
        requests,
        sources: merged.sources.len(),
        kernel_rows: kernel_rows.len(),
        request_rows: request_rows.len(),
    })
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{row_of, two_sources};
    use super::*;

    #[test]
    fn two_sources_duplicates_are_merged_by_median() {
        let r = build(&two_sources(), "unmask bench-report x --out y").unwrap();
        let md = &r.markdown;
        assert_eq!((r.sources, r.kernel_rows, r.request_rows), (2, 1, 3));
        assert!(md.contains("Made by `unmask bench-report x --out y`"));
        let s1 = row_of(md, "| S1 |");
        assert!(s1.contains("| GPU A | Vulkan | test 1.0 | DiscreteGpu | shader-f16 |"));
        assert!(s1.contains("gpu-a.jsonl, gpu-a-again.jsonl"));
        assert!(s1.contains("tiny (123.5 K params, 2 layers, d 64, 4/2 heads)"));
        assert!(row_of(md, "| S2 |").contains("gpu-b.jsonl"));
        // tiled: 100, 300, 200 -> 200, faster than naive's 50.
        let k = row_of(md, "| matmul | qkv | m=32 n=192 k=64 | f16-native |");
        assert!(
            k.contains("| 200 GFLOP/s · 20.0 GB/s · `tiled` · 25% of peak FLOP/s | 40.0 GFLOP/s"),
            "{k}"
        );
    }
    #[test]
    fn writes_the_report_and_both_charts() {
        let dir = std::env::temp_dir().join(format!("unmask-bench-report-{}", std::process::id()));
        let r = build(&two_sources(), "x").unwrap();
        let written = r.write(&dir.join("nested")).unwrap();
        assert_eq!(written.len(), 3);
        let md = std::fs::read_to_string(dir.join("nested").join(REPORT_MD)).unwrap();
        assert!(md.contains("![Canvas throughput per cache mode](requests.svg)"));
        assert!(md.contains("![Best GFLOP/s per kernel case and format](kernels.svg)"));
        for name in [KERNELS_SVG, REQUESTS_SVG] {
            let svg = std::fs::read_to_string(dir.join("nested").join(name)).unwrap();
            let (w, h) = crate::chart::svg::size(&svg);
            assert!(w > 0.0 && h > 0.0, "{name}");
            assert!(svg.trim_end().ends_with("</svg>"), "{name}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
