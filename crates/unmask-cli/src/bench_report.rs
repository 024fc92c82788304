//! `unmask bench-report`: the JSON lines of `unmask bench` from several machines and
//! backends, merged into one markdown report (sources, kernels, requests) and two bar charts.
//!
//! A source is one (adapter, backend, model, weights); its records may come from several
//! files, and repeated measurements of one configuration in a source are merged by taking
//! the median of each figure, so re-running a benchmark and passing every run steadies the
//! numbers instead of adding rows.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::path::Path;

use serde_json::{Map, Value};

use crate::args::{CommandSpec, Flag, Matches};
use crate::chart::BarChart;
use crate::error::CliError;
use crate::eval::command_line;
use crate::png::Canvas;

pub const REPORT_MD: &str = "report.md";
pub const REQUESTS_PNG: &str = "requests.png";
pub const KERNELS_PNG: &str = "kernels.png";

pub fn spec() -> CommandSpec {
    CommandSpec {
        name: "bench-report",
        summary: "Merge `unmask bench` JSON lines from several machines into a markdown report with plots.",
        usage: "unmask bench-report FILE... --out DIR",
        flags: vec![
            Flag::words(
                "files",
                "FILE...",
                "JSON-lines files written by `unmask bench` (one or more)",
            ),
            Flag::value(
                "out",
                "DIR",
                "folder for report.md, requests.png and kernels.png (created if needed)",
            ),
        ],
        notes: "A source is one (adapter, backend, model, weights); each gets a column. Within a\n\
                source, repeated measurements of one kernel case/shape/format/variant or one\n\
                cache/decoding/shape are merged by the median of each figure. Lines that do not\n\
                start with `{` are skipped, so captured logs can be passed as they are.",
    }
}

pub fn run(m: &Matches) -> Result<(), CliError> {
    let files = m.words();
    if files.is_empty() {
        return Err(CliError::usage(
            "`unmask bench-report` needs at least one FILE of benchmark JSON lines; \
             see `unmask bench-report --help`",
        ));
    }
    let out = Path::new(m.required("out", "DIR")?);
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
    /// Absent when the inputs hold no records of that kind.
    pub kernels: Option<(BarChart, Canvas)>,
    pub requests: Option<(BarChart, Canvas)>,
    pub sources: usize,
    pub kernel_rows: usize,
    pub request_rows: usize,
}

impl Report {
    /// Writes `report.md` and the charts into `dir` (created if needed); returns the paths.
    pub fn write(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>, CliError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| CliError::context(format!("cannot create {}", dir.display()), e))?;
        let mut files: Vec<(&str, Vec<u8>)> = vec![(REPORT_MD, self.markdown.clone().into())];
        if let Some((_, c)) = &self.kernels {
            files.push((KERNELS_PNG, c.to_png()));
        }
        if let Some((_, c)) = &self.requests {
            files.push((REQUESTS_PNG, c.to_png()));
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

/// What identifies a source.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct SourceKey {
    adapter: String,
    backend: String,
    model: String,
    weights: String,
}

#[derive(Debug)]
struct Source {
    key: SourceKey,
    /// Envelope fields shown in the sources table, by name; a source may see several
    /// values (such as two commits), all of which are listed.
    details: BTreeMap<&'static str, Vec<String>>,
    files: Vec<String>,
}

impl Source {
    fn note(&mut self, detail: &'static str, value: Option<String>) {
        let Some(value) = value.filter(|v| !v.is_empty()) else {
            return;
        };
        let seen = self.details.entry(detail).or_default();
        if !seen.contains(&value) {
            seen.push(value);
        }
    }

    fn detail(&self, detail: &str) -> String {
        match self.details.get(detail) {
            Some(values) if !values.is_empty() => values.join("; "),
            _ => "—".into(),
        }
    }
}

/// A kernel table row: the kernel, the layer it stands for, its shape and weight format.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct KernelRow {
    kernel: String,
    case: String,
    shape: Vec<(&'static str, u64)>,
    format: String,
}

/// A request table row: the cache mode, the decoding and the generation shape.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct RequestRow {
    cache: String,
    decoding: String,
    /// As written in the file, so equal thresholds compare equal without float keys.
    threshold: Option<String>,
    gen_length: u64,
    steps: u64,
    block_length: u64,
    /// Requests per batched call (1 in records that predate batching).
    batch: u64,
}

type Figures = BTreeMap<&'static str, f64>;

const MATMUL_SHAPE: [&str; 3] = ["m", "n", "k"];
const ATTENTION_SHAPE: [&str; 5] = ["lq", "lkv", "heads", "kv_heads", "head_dim"];
const KERNEL_FIGURES: [&str; 5] = ["ms", "ms_min", "runs", "gflops", "gbs"];
const KERNEL_OPTIONAL: [&str; 2] = ["peak_gflops_share", "peak_gbs_share"];
const REQUEST_FIGURES: [&str; 12] = [
    "requests",
    "prefix_tokens",
    "user_tokens",
    "throughput_canvas",
    "throughput_answer",
    "request_s_median",
    "ttft_s",
    "nfe",
    "token_layer_passes",
    "cache_bytes",
    "gpu_weights_bytes",
    "gpu_peak_bytes",
];
const REQUEST_OPTIONAL: [&str; 2] = ["bicache_hits", "bicache_depth"];

/// Every record read, grouped by source and configuration, before duplicates are merged.
#[derive(Default)]
struct Collected {
    sources: Vec<Source>,
    kernels: BTreeMap<(usize, KernelRow, String), Vec<Figures>>,
    requests: BTreeMap<(usize, RequestRow), Vec<Figures>>,
}

/// One JSON object being read, with where it came from for error messages.
struct Fields<'a> {
    file: &'a str,
    line: usize,
    /// Dotted path of this object inside the record ("" at the top, "model." inside it).
    prefix: &'static str,
    object: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn error(&self, what: impl Display) -> CliError {
        CliError::runtime(format!("{}:{}: {what}", self.file, self.line))
    }

    fn get(&self, name: &str) -> Result<&'a Value, CliError> {
        self.object
            .get(name)
            .ok_or_else(|| self.error(format!("missing field `{}{name}`", self.prefix)))
    }

    fn wrong(&self, name: &str, expected: &str, found: &Value) -> CliError {
        let mut shown = found.to_string();
        if shown.len() > 40 {
            shown = format!("{}...", shown.chars().take(37).collect::<String>());
        }
        self.error(format!(
            "field `{}{name}` should be {expected}, found {shown}",
            self.prefix
        ))
    }

    fn text(&self, name: &str) -> Result<String, CliError> {
        let v = self.get(name)?;
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| self.wrong(name, "a string", v))
    }

    /// A string that may be absent or null.
    fn optional_text(&self, name: &str) -> Result<Option<String>, CliError> {
        match self.object.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.wrong(name, "a string", other)),
        }
    }

    fn optional_flag(&self, name: &str) -> Result<Option<bool>, CliError> {
        match self.object.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.wrong(name, "true or false", other)),
        }
    }

    fn count(&self, name: &str) -> Result<u64, CliError> {
        let v = self.get(name)?;
        // Writers other than serde may spell whole numbers as 32.0.
        let integral = || {
            v.as_f64()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f < u64::MAX as f64)
                .map(|f| f as u64)
        };
        v.as_u64()
            .or_else(integral)
            .ok_or_else(|| self.wrong(name, "a whole number >= 0", v))
    }

    fn number(&self, name: &str) -> Result<f64, CliError> {
        let v = self.get(name)?;
        v.as_f64().ok_or_else(|| self.wrong(name, "a number", v))
    }

    /// A number that may be absent or null.
    fn optional_number(&self, name: &str) -> Result<Option<f64>, CliError> {
        match self.object.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong(name, "a number or null", v)),
        }
    }

    fn object(&self, name: &str, prefix: &'static str) -> Result<Fields<'a>, CliError> {
        let v = self.get(name)?;
        let object = v
            .as_object()
            .ok_or_else(|| self.wrong(name, "an object", v))?;
        Ok(Fields {
            file: self.file,
            line: self.line,
            prefix,
            object,
        })
    }

    /// The required figures in `names` and whichever of `optional` are present and not null.
    fn figures(
        &self,
        names: &[&'static str],
        optional: &[&'static str],
    ) -> Result<Figures, CliError> {
        let mut out = Figures::new();
        for &name in names {
            out.insert(name, self.number(name)?);
        }
        for &name in optional {
            if let Some(v) = self.optional_number(name)? {
                out.insert(name, v);
            }
        }
        Ok(out)
    }
}

impl Collected {
    fn read(&mut self, input: &Input) -> Result<(), CliError> {
        for (i, line) in input.text.lines().enumerate() {
            let line = line.trim();
            // Benchmark logs interleave progress lines; only objects are records.
            if !line.starts_with('{') {
                continue;
            }
            let at = i + 1;
            let value: Value = serde_json::from_str(line).map_err(|e| {
                CliError::runtime(format!("{}:{at}: not valid JSON ({e})", input.name))
            })?;
            let Some(object) = value.as_object() else {
                return Err(CliError::runtime(format!(
                    "{}:{at}: expected a JSON object",
                    input.name
                )));
            };
            let fields = Fields {
                file: &input.name,
                line: at,
                prefix: "",
                object,
            };
            self.record(&fields)?;
        }
        Ok(())
    }

    fn record(&mut self, r: &Fields) -> Result<(), CliError> {
        let kind = r.text("record")?;
        if kind != "kernel" && kind != "request" {
            return Err(r.error(format!(
                "unknown record `{kind}`: expected kernel or request"
            )));
        }
        let source = self.source(r)?;
        if kind == "kernel" {
            let kernel = r.text("kernel")?;
            let dims: &[&'static str] = match kernel.as_str() {
                "matmul" => &MATMUL_SHAPE,
                "attention" => &ATTENTION_SHAPE,
                // A kernel this report does not know yet still gets its row, unshaped.
                _ => &[],
            };
            let shape = dims
                .iter()
                .map(|&d| Ok((d, r.count(d)?)))
                .collect::<Result<Vec<_>, CliError>>()?;
            let row = KernelRow {
                kernel,
                case: r.text("case")?,
                shape,
                format: r.text("format")?,
            };
            let variant = r.text("variant")?;
            let figures = r.figures(&KERNEL_FIGURES, &KERNEL_OPTIONAL)?;
            self.kernels
                .entry((source, row, variant))
                .or_default()
                .push(figures);
        } else {
            let decoding = r.text("decoding")?;
            let threshold = match r.object.get("threshold") {
                None | Some(Value::Null) => None,
                Some(Value::Number(n)) => Some(n.to_string()),
                Some(other) => return Err(r.wrong("threshold", "a number or null", other)),
            };
            let row = RequestRow {
                cache: r.text("cache")?,
                decoding,
                threshold,
                gen_length: r.count("gen_length")?,
                steps: r.count("steps")?,
                block_length: r.count("block_length")?,
                batch: match r.object.get("batch") {
                    None | Some(Value::Null) => 1,
                    Some(_) => r.count("batch")?,
                },
            };
            let figures = r.figures(&REQUEST_FIGURES, &REQUEST_OPTIONAL)?;
            self.requests
                .entry((source, row))
                .or_default()
                .push(figures);
        }
        Ok(())
    }

    /// The index of the record's source, added on first sight, with its envelope noted.
    fn source(&mut self, r: &Fields) -> Result<usize, CliError> {
        let model = r.object("model", "model.")?;
        let key = SourceKey {
            adapter: r.text("adapter")?,
            backend: r.text("backend")?,
            model: model.text("name")?,
            weights: r.text("weights")?,
        };
        let index = match self.sources.iter().position(|s| s.key == key) {
            Some(i) => i,
            None => {
                self.sources.push(Source {
                    key,
                    details: BTreeMap::new(),
                    files: Vec::new(),
                });
                self.sources.len() - 1
            }
        };
        let features = [("shader-f16", "shader_f16"), ("subgroups", "subgroups")]
            .iter()
            .map(|(label, field)| Ok(r.optional_flag(field)?.map(|on| (*label, on))))
            .collect::<Result<Vec<_>, CliError>>()?;
        let features = if features.iter().all(Option::is_none) {
            None
        } else {
            let on: Vec<&str> = features
                .iter()
                .flatten()
                .filter(|f| f.1)
                .map(|f| f.0)
                .collect();
            Some(if on.is_empty() {
                "none".to_string()
            } else {
                on.join(", ")
            })
        };
        let model_text = model_summary(&model)?;
        let details = [
            ("driver", r.optional_text("driver")?),
            ("device_type", r.optional_text("device_type")?),
            ("features", features),
            ("commit", r.optional_text("commit")?),
            ("unmask", r.optional_text("unmask")?),
            ("model", model_text),
        ];
        let source = &mut self.sources[index];
        for (detail, value) in details {
            source.note(detail, value);
        }
        if !source.files.iter().any(|f| f == r.file) {
            source.files.push(r.file.to_string());
        }
        Ok(index)
    }
}

/// The model's size in a few words (parameters, layers, width), from whichever of its
/// dimensions the record gives.
fn model_summary(model: &Fields) -> Result<Option<String>, CliError> {
    let mut parts = Vec::new();
    if let Some(p) = model.optional_number("params")? {
        parts.push(format!("{} params", si(p)));
    }
    if let Some(l) = model.optional_number("n_layers")? {
        parts.push(format!("{l} layers"));
    }
    if let Some(d) = model.optional_number("d_model")? {
        parts.push(format!("d {d}"));
    }
    match (
        model.optional_number("n_heads")?,
        model.optional_number("n_kv_heads")?,
    ) {
        (Some(h), Some(kv)) if h != kv => parts.push(format!("{h}/{kv} heads")),
        (Some(h), _) => parts.push(format!("{h} heads")),
        _ => {}
    }
    Ok((!parts.is_empty()).then(|| parts.join(", ")))
}

/// 8.02 B, 125.0 M, 12.3 K.
fn si(v: f64) -> String {
    match v.abs() {
        a if a >= 1e9 => format!("{:.2} B", v / 1e9),
        a if a >= 1e6 => format!("{:.1} M", v / 1e6),
        a if a >= 1e3 => format!("{:.1} K", v / 1e3),
        _ => format!("{v}"),
    }
}

/// The median of each figure over the measurements that have it (the mean of the middle
/// two for an even count).
fn merge(measurements: &[Figures]) -> Figures {
    let mut all: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for m in measurements {
        for (&name, &v) in m {
            all.entry(name).or_default().push(v);
        }
    }
    all.into_iter()
        .map(|(name, mut values)| {
            values.sort_by(f64::total_cmp);
            let n = values.len();
            let median = if n % 2 == 1 {
                values[n / 2]
            } else {
                (values[n / 2 - 1] + values[n / 2]) / 2.0
            };
            (name, median)
        })
        .collect()
}

/// Position of `value` in a preferred order, unknown values after the known ones.
fn rank(order: &[&str], value: &str) -> usize {
    order
        .iter()
        .position(|o| *o == value)
        .unwrap_or(order.len())
}

const CASE_ORDER: [&str; 6] = [
    "qkv",
    "attn_out",
    "gate_up",
    "ff_out",
    "lm_head",
    "attention",
];
const FORMAT_ORDER: [&str; 6] = ["f32", "f16-packed", "f16-native", "f16", "q8", "q4"];
const CACHE_ORDER: [&str; 6] = [
    "none",
    "fast-dllm-prefix",
    "fast-dllm-dual",
    "prefix-arm",
    "bicache",
    "bicache-dual",
];
const DECODING_ORDER: [&str; 2] = ["quota", "threshold"];

fn kernel_order(r: &KernelRow) -> impl Ord + '_ {
    (
        rank(&CASE_ORDER, &r.case),
        &r.case,
        &r.kernel,
        &r.shape,
        rank(&FORMAT_ORDER, &r.format),
        &r.format,
    )
}

/// Rows of one decoding and shape stay together, `none` first, so each block reads as the
/// cache modes' comparison against it.
fn request_order(r: &RequestRow) -> impl Ord + '_ {
    let threshold = r
        .threshold
        .as_deref()
        .and_then(|t| t.parse::<f64>().ok())
        .map(|t| (t * 1e6).round() as i64);
    (
        (r.gen_length, r.steps, r.block_length),
        rank(&DECODING_ORDER, &r.decoding),
        &r.decoding,
        threshold,
        rank(&CACHE_ORDER, &r.cache),
        &r.cache,
        r.batch,
    )
}

/// Merged data, ready to lay out.
struct Merged {
    sources: Vec<Source>,
    /// Best variant per (source, row): its name and figures.
    kernels: BTreeMap<(usize, KernelRow), (String, Figures)>,
    requests: BTreeMap<(usize, RequestRow), Figures>,
}

impl Merged {
    fn new(c: Collected) -> Self {
        let mut kernels: BTreeMap<(usize, KernelRow), (String, Figures)> = BTreeMap::new();
        for ((source, row, variant), measurements) in c.kernels {
            let figures = merge(&measurements);
            let gflops = figures.get("gflops").copied().unwrap_or(f64::NEG_INFINITY);
            let best = kernels
                .entry((source, row))
                .or_insert((variant.clone(), figures.clone()));
            let best_gflops = best.1.get("gflops").copied().unwrap_or(f64::NEG_INFINITY);
            if gflops > best_gflops {
                *best = (variant, figures);
            }
        }
        let requests = c
            .requests
            .into_iter()
            .map(|(key, measurements)| (key, merge(&measurements)))
            .collect();
        Self {
            sources: c.sources,
            kernels,
            requests,
        }
    }

    /// Sources that have records of one kind, in order of first appearance.
    fn with<T>(&self, map: &BTreeMap<(usize, T), impl Sized>) -> Vec<usize> {
        (0..self.sources.len())
            .filter(|s| map.keys().any(|(source, _)| source == s))
            .collect()
    }

    fn kernel_rows(&self) -> Vec<&KernelRow> {
        let mut rows: Vec<&KernelRow> = self.kernels.keys().map(|(_, r)| r).collect();
        rows.sort_by(|a, b| kernel_order(a).cmp(&kernel_order(b)));
        rows.dedup();
        rows
    }

    fn request_rows(&self) -> Vec<&RequestRow> {
        let mut rows: Vec<&RequestRow> = self.requests.keys().map(|(_, r)| r).collect();
        rows.sort_by(|a, b| request_order(a).cmp(&request_order(b)));
        rows.dedup();
        rows
    }

    /// Canvas throughput of `row` over that of `none` with the same decoding and shape.
    fn speed_up(&self, source: usize, row: &RequestRow) -> Option<f64> {
        let base = RequestRow {
            cache: "none".into(),
            batch: 1,
            ..row.clone()
        };
        let get = |r: &RequestRow| {
            self.requests
                .get(&(source, r.clone()))
                .and_then(|f| f.get("throughput_canvas").copied())
        };
        let (this, base) = (get(row)?, get(&base)?);
        (base > 0.0).then(|| this / base)
    }

    fn id(&self, source: usize) -> String {
        format!("S{}", source + 1)
    }

    /// The legend's name for a source: its id, adapter, backend and weights, and the model
    /// when the sources do not all share one.
    fn label(&self, source: usize) -> String {
        let k = &self.sources[source].key;
        let one_model = self.sources.iter().all(|s| s.key.model == k.model);
        let mut parts = vec![k.adapter.as_str(), k.backend.as_str()];
        if !one_model {
            parts.push(k.model.as_str());
        }
        parts.push(k.weights.as_str());
        format!("{} {}", self.id(source), parts.join(" / "))
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
    if records == 0 {
        let names: Vec<&str> = inputs.iter().map(|i| i.name.as_str()).collect();
        return Err(CliError::runtime(format!(
            "no benchmark records (JSON lines with \"record\": \"kernel\" or \"request\") in {}",
            names.join(", ")
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
    sources_table(&mut md, &merged);
    md.push_str("## Kernels\n\n");
    let kernels = if kernel_rows.is_empty() {
        md.push_str("No kernel records.\n\n");
        None
    } else {
        kernels_table(&mut md, &merged, &kernel_rows);
        let chart = kernels_chart(&merged, &kernel_rows);
        let canvas = chart.draw();
        md.push_str(&format!(
            "![Best GFLOP/s per kernel case and format]({KERNELS_PNG})\n\n"
        ));
        Some((chart, canvas))
    };
    md.push_str("## Requests\n\n");
    let requests = if request_rows.is_empty() {
        md.push_str("No request records.\n\n");
        None
    } else {
        requests_table(&mut md, &merged, &request_rows);
        let chart = requests_chart(&merged, &request_rows);
        let canvas = chart.draw();
        md.push_str(&format!(
            "![Canvas throughput per cache mode]({REQUESTS_PNG})\n\n"
        ));
        Some((chart, canvas))
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

/// Text made safe for a markdown table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

fn table_row(cells: &[String]) -> String {
    format!("| {} |\n", cells.join(" | "))
}

fn table_head(md: &mut String, headers: &[String], numeric_from: usize) {
    md.push_str(&table_row(headers));
    let rule: Vec<String> = (0..headers.len())
        .map(|i| if i >= numeric_from { "---:" } else { "---" }.to_string())
        .collect();
    md.push_str(&table_row(&rule));
}

fn sources_table(md: &mut String, m: &Merged) {
    md.push_str("## Sources\n\n");
    let headers = [
        "Source",
        "Adapter",
        "Backend",
        "Driver",
        "Device type",
        "Features",
        "Commit",
        "unmask",
        "Model",
        "Weights",
        "Files",
    ];
    table_head(md, &headers.map(String::from), headers.len());
    for (i, s) in m.sources.iter().enumerate() {
        let model = match s.details.get("model") {
            Some(_) => format!("{} ({})", s.key.model, s.detail("model")),
            None => s.key.model.clone(),
        };
        let cells = [
            m.id(i),
            s.key.adapter.clone(),
            s.key.backend.clone(),
            s.detail("driver"),
            s.detail("device_type"),
            s.detail("features"),
            s.detail("commit"),
            s.detail("unmask"),
            model,
            s.key.weights.clone(),
            s.files.join(", "),
        ]
        .map(|c| cell(&c));
        md.push_str(&table_row(&cells));
    }
    md.push('\n');
}

/// 1234, 56.7, 8.90: three significant figures or the whole number.
fn num(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 || v == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn shape_text(shape: &[(&str, u64)]) -> String {
    if shape.is_empty() {
        return "—".into();
    }
    shape
        .iter()
        .map(|(d, v)| format!("{d}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn kernels_table(md: &mut String, m: &Merged, rows: &[&KernelRow]) {
    md.push_str(
        "The fastest variant of each kernel case, shape and format in each source: GFLOP/s, \
         GB/s, the variant and, where the benchmark knew the adapter's peak, the share of \
         peak compute / bandwidth it reached.\n\n",
    );
    let sources = m.with(&m.kernels);
    let mut headers: Vec<String> = ["Kernel", "Case", "Shape", "Format"]
        .map(String::from)
        .to_vec();
    headers.extend(sources.iter().map(|&s| m.id(s)));
    table_head(md, &headers, 4);
    for row in rows {
        let mut cells = vec![
            cell(&row.kernel),
            cell(&row.case),
            shape_text(&row.shape),
            cell(&row.format),
        ];
        for &s in &sources {
            let text = match m.kernels.get(&(s, (*row).clone())) {
                None => "—".to_string(),
                Some((variant, f)) => {
                    let get = |k: &str| f.get(k).copied().unwrap_or(f64::NAN);
                    let mut text = format!(
                        "{} GFLOP/s · {} GB/s · `{}`",
                        num(get("gflops")),
                        num(get("gbs")),
                        cell(variant)
                    );
                    let pct = |k: &str| f.get(k).map(|v| format!("{:.0}%", v * 100.0));
                    match (pct("peak_gflops_share"), pct("peak_gbs_share")) {
                        (Some(c), Some(b)) => text.push_str(&format!(" · {c} / {b} of peak")),
                        (Some(c), None) => text.push_str(&format!(" · {c} of peak FLOP/s")),
                        (None, Some(b)) => text.push_str(&format!(" · {b} of peak GB/s")),
                        (None, None) => {}
                    }
                    text
                }
            };
            cells.push(text);
        }
        md.push_str(&table_row(&cells));
    }
    md.push('\n');
}

fn request_label(row: &RequestRow) -> (String, String, String) {
    let decoding = match (&row.threshold, row.decoding.as_str()) {
        // Quota decoding ignores the threshold, so it is not shown there.
        (Some(t), d) if d != "quota" => format!("{d} {}", short_threshold(t)),
        (_, d) => d.to_string(),
    };
    let shape = format!("{}/{}/{}", row.gen_length, row.steps, row.block_length);
    let cache = if row.batch > 1 {
        format!("{} (batch {})", row.cache, row.batch)
    } else {
        row.cache.clone()
    };
    (cache, decoding, shape)
}

/// A threshold as written (0.8999999761581421 from an f32) rounded for reading.
fn short_threshold(t: &str) -> String {
    match t.parse::<f64>() {
        Ok(v) => {
            let text = format!("{v:.3}");
            text.trim_end_matches('0').trim_end_matches('.').to_string()
        }
        Err(_) => t.to_string(),
    }
}

fn requests_table(md: &mut String, m: &Merged, rows: &[&RequestRow]) {
    md.push_str(
        "Throughput in tokens per second of the whole canvas and of the answer; speed-up: \
         canvas throughput over `none` with the same decoding and shape in the same source; \
         TTFT: time to the first denoising step; token-layer passes per request; GPU peak: \
         the most GPU memory held at once.\n\n",
    );
    let sources = m.with(&m.requests);
    let mut headers: Vec<String> = ["Cache", "Decoding", "Gen / steps / block"]
        .map(String::from)
        .to_vec();
    for &s in &sources {
        let id = m.id(s);
        for what in [
            "canvas tok/s",
            "answer tok/s",
            "speed-up",
            "TTFT s",
            "token-layer passes",
            "GPU peak MiB",
        ] {
            headers.push(format!("{id} {what}"));
        }
    }
    table_head(md, &headers, 3);
    for row in rows {
        let (cache, decoding, shape) = request_label(row);
        let mut cells = vec![cell(&cache), cell(&decoding), shape];
        for &s in &sources {
            match m.requests.get(&(s, (*row).clone())) {
                None => cells.extend((0..6).map(|_| "—".to_string())),
                Some(f) => {
                    let show = |k: &str, format: &dyn Fn(f64) -> String| {
                        f.get(k).map_or("—".to_string(), |v| format(*v))
                    };
                    cells.push(show("throughput_canvas", &num));
                    cells.push(show("throughput_answer", &num));
                    cells.push(
                        m.speed_up(s, row)
                            .map_or("—".to_string(), |x| format!("{x:.2}×")),
                    );
                    cells.push(show("ttft_s", &|v| format!("{v:.3}")));
                    cells.push(show("token_layer_passes", &|v| format!("{v:.0}")));
                    cells.push(show("gpu_peak_bytes", &|v| num(v / (1024.0 * 1024.0))));
                }
            }
        }
        md.push_str(&table_row(&cells));
    }
    md.push('\n');
}

fn kernels_chart(m: &Merged, rows: &[&KernelRow]) -> BarChart {
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

fn requests_chart(m: &Merged, rows: &[&RequestRow]) -> BarChart {
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
    use super::*;
    use serde_json::json;

    fn envelope(adapter: &str, backend: &str) -> Value {
        json!({
            "unmask": "0.1.0", "commit": "abc1234", "adapter": adapter, "backend": backend,
            "device_type": "DiscreteGpu", "driver": "test 1.0", "shader_f16": true,
            "subgroups": false,
            "model": {"name": "tiny", "d_model": 64, "n_layers": 2, "n_heads": 4,
                      "n_kv_heads": 2, "mlp_hidden_size": 128, "vocab_size": 320,
                      "params": 123456},
            "weights": "f16-native",
        })
    }

    fn with(base: Value, fields: Value) -> String {
        let mut out = base.as_object().unwrap().clone();
        out.extend(fields.as_object().unwrap().clone());
        Value::Object(out).to_string()
    }

    fn kernel(adapter: &str, variant: &str, gflops: f64) -> String {
        with(
            envelope(adapter, "Vulkan"),
            json!({
                "record": "kernel", "kernel": "matmul", "case": "qkv", "variant": variant,
                "format": "f16-native", "m": 32, "n": 192, "k": 64, "ms": 0.5,
                "ms_min": 0.4, "runs": 10, "gflops": gflops, "gbs": gflops / 10.0,
                "peak_gflops_share": 0.25,
            }),
        )
    }

    fn request(adapter: &str, cache: &str, canvas: f64) -> String {
        with(
            envelope(adapter, "Vulkan"),
            json!({
                "record": "request", "cache": cache, "decoding": "quota", "threshold": null,
                "gen_length": 64, "steps": 32, "block_length": 32, "requests": 8,
                "prefix_tokens": 256, "user_tokens": 32, "throughput_canvas": canvas,
                "throughput_answer": canvas / 4.0, "request_s_median": 1.5,
                "ttft_s": 0.125, "nfe": 32, "token_layer_passes": 4096,
                "bicache_hits": null, "bicache_depth": null, "cache_bytes": 1048576,
                "gpu_weights_bytes": 2097152, "gpu_peak_bytes": 10485760,
            }),
        )
    }

    fn input(name: &str, lines: &[String]) -> Input {
        Input {
            name: name.into(),
            text: lines.join("\n"),
        }
    }

    fn two_sources() -> Vec<Input> {
        vec![
            input(
                "gpu-a.jsonl",
                &[
                    "[gpu] a log line".into(),
                    kernel("GPU A", "naive", 50.0),
                    kernel("GPU A", "tiled", 100.0),
                    kernel("GPU A", "tiled", 300.0),
                    String::new(),
                    request("GPU A", "none", 100.0),
                    request("GPU A", "bicache", 250.0),
                ],
            ),
            input(
                "gpu-a-again.jsonl",
                &[
                    kernel("GPU A", "tiled", 200.0),
                    request("GPU A", "bicache", 350.0),
                ],
            ),
            input(
                "gpu-b.jsonl",
                &[
                    kernel("GPU B", "tiled", 40.0),
                    request("GPU B", "none", 400.0),
                    request("GPU B", "prefix-arm", 600.0),
                ],
            ),
        ]
    }

    fn row_of<'a>(md: &'a str, start: &str) -> &'a str {
        md.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no row starting {start:?} in\n{md}"))
    }

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
    fn speed_up_is_over_none_in_the_same_source() {
        let r = build(&two_sources(), "unmask bench-report").unwrap();
        let md = &r.markdown;
        assert!(md.contains("| Cache | Decoding | Gen / steps / block | S1 canvas tok/s |"));
        let none = row_of(md, "| none | quota | 64/32/32 |");
        assert!(
            none.contains("| 100 | 25.0 | 1.00× | 0.125 | 4096 | 10.0 |"),
            "{none}"
        );
        assert!(none.contains("| 400 | 100 | 1.00× |"), "{none}");
        // bicache in S1: 250 and 350 -> 300, 3x none; S2 has no bicache row.
        let bicache = row_of(md, "| bicache | quota | 64/32/32 |");
        assert!(bicache.contains("| 300 | 75.0 | 3.00× |"), "{bicache}");
        assert!(bicache.ends_with("| — | — | — | — | — | — |"), "{bicache}");
        let arm = row_of(md, "| prefix-arm | quota | 64/32/32 |");
        assert!(arm.contains("| 600 | 150 | 1.50× |"), "{arm}");
        // Rows run none first, then the other modes in their usual order.
        let at = |s: &str| md.find(s).unwrap();
        assert!(at("| none | quota") < at("| prefix-arm | quota"));
        assert!(at("| prefix-arm | quota") < at("| bicache | quota"));
    }

    #[test]
    fn batch_sizes_are_rows_of_their_own() {
        let batched = |canvas: f64, batch: u64| {
            let mut v: Value =
                serde_json::from_str(&request("GPU A", "bicache-dual", canvas)).unwrap();
            v["batch"] = json!(batch);
            v.to_string()
        };
        let lines = [
            request("GPU A", "none", 100.0),
            batched(200.0, 1),
            batched(300.0, 4),
        ];
        let r = build(&[input("a.jsonl", &lines)], "unmask bench-report").unwrap();
        let md = &r.markdown;
        let alone = row_of(md, "| bicache-dual | quota | 64/32/32 |");
        assert!(alone.contains("| 200 | 50.0 | 2.00× |"), "{alone}");
        let four = row_of(md, "| bicache-dual (batch 4) | quota | 64/32/32 |");
        assert!(four.contains("| 300 | 75.0 | 3.00× |"), "{four}");
        assert!(md.find("| bicache-dual |").unwrap() < md.find("(batch 4)").unwrap());
    }

    #[test]
    fn malformed_line_names_file_and_line() {
        let bad = input(
            "runs.jsonl",
            &[
                kernel("GPU A", "tiled", 1.0),
                String::new(),
                "{\"record\": ".into(),
            ],
        );
        let e = build(&[bad], "x").err().unwrap();
        assert!(
            e.to_string().starts_with("runs.jsonl:3: not valid JSON"),
            "{e}"
        );
    }

    #[test]
    fn missing_and_mistyped_fields_are_named() {
        let mut v: Value = serde_json::from_str(&kernel("GPU A", "tiled", 1.0)).unwrap();
        v.as_object_mut().unwrap().remove("gflops");
        let e = build(&[input("k.jsonl", &[String::new(), v.to_string()])], "x")
            .err()
            .unwrap();
        assert_eq!(e.to_string(), "k.jsonl:2: missing field `gflops`");

        let mut v: Value = serde_json::from_str(&request("GPU A", "none", 1.0)).unwrap();
        v["model"].as_object_mut().unwrap().remove("name");
        let e = build(&[input("r.jsonl", &[v.to_string()])], "x")
            .err()
            .unwrap();
        assert_eq!(e.to_string(), "r.jsonl:1: missing field `model.name`");

        let mut v: Value = serde_json::from_str(&kernel("GPU A", "tiled", 1.0)).unwrap();
        v["m"] = json!("32");
        let e = build(&[input("k.jsonl", &[v.to_string()])], "x")
            .err()
            .unwrap();
        assert!(
            e.to_string()
                .contains("k.jsonl:1: field `m` should be a whole number")
        );

        let e = build(&[input("empty.jsonl", &["# nothing".into()])], "x")
            .err()
            .unwrap();
        assert!(e.to_string().contains("no benchmark records"), "{e}");
    }

    /// Width and height from a PNG's IHDR chunk, after checking the signature.
    fn png_size(png: &[u8]) -> (u32, u32) {
        assert_eq!(&png[..8], &crate::png::PNG_SIGNATURE);
        assert_eq!(&png[12..16], b"IHDR");
        let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
        (be(16), be(20))
    }

    #[test]
    fn charts_are_pngs_with_taller_bars_for_larger_values() {
        let r = build(&two_sources(), "x").unwrap();
        for (chart, canvas) in [r.kernels.as_ref().unwrap(), r.requests.as_ref().unwrap()] {
            let (w, h) = png_size(&canvas.to_png());
            assert_eq!((w as usize, h as usize), (canvas.width, canvas.height));
            assert_eq!(chart.series.len(), 2);
        }
        let (chart, canvas) = r.requests.as_ref().unwrap();
        assert_eq!(chart.series[0], "S1 GPU A / Vulkan / f16-native");
        assert_eq!(chart.groups[0], ["none", "quota"]);
        let l = chart.layout();
        let height = |group: usize, series: usize| {
            let x = l.bar_x(group, series, 2) + 1;
            let colour = crate::chart::series_colour(series);
            (0..l.baseline)
                .rev()
                .take_while(|&y| canvas.get(x, y) == colour)
                .count()
        };
        // none: S1 100 tok/s, S2 400 tok/s.
        assert!(height(0, 1) > height(0, 0));
        assert!(height(0, 0) > 0);
        // prefix-arm at 600 tok/s is the tallest bar of all.
        let all: Vec<usize> = (0..3)
            .flat_map(|g| (0..2).map(move |s| (g, s)))
            .map(|(g, s)| height(g, s))
            .collect();
        assert_eq!(all.iter().max(), Some(&height(1, 1)));
    }

    #[test]
    fn writes_the_report_and_both_charts() {
        let dir = std::env::temp_dir().join(format!("unmask-bench-report-{}", std::process::id()));
        let r = build(&two_sources(), "x").unwrap();
        let written = r.write(&dir.join("nested")).unwrap();
        assert_eq!(written.len(), 3);
        let md = std::fs::read_to_string(dir.join("nested").join(REPORT_MD)).unwrap();
        assert!(md.contains("![Canvas throughput per cache mode](requests.png)"));
        for name in [KERNELS_PNG, REQUESTS_PNG] {
            let png = std::fs::read(dir.join("nested").join(name)).unwrap();
            png_size(&png);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
