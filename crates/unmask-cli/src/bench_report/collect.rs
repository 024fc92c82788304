//! Reading `unmask bench` records: every JSON line checked field by field (errors name the
//! file, the line and the field), grouped by source and table row before duplicates merge.

use std::collections::BTreeMap;
use std::fmt::Display;

use serde_json::{Map, Value};

use super::Input;
use crate::error::CliError;

/// What identifies a source.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct SourceKey {
    pub(super) adapter: String,
    pub(super) backend: String,
    pub(super) model: String,
    pub(super) weights: String,
}

#[derive(Debug)]
pub(super) struct Source {
    pub(super) key: SourceKey,
    /// Envelope fields shown in the sources table, by name; a source may see several
    /// values (such as two commits), all of which are listed.
    pub(super) details: BTreeMap<&'static str, Vec<String>>,
    pub(super) files: Vec<String>,
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

    pub(super) fn detail(&self, detail: &str) -> String {
        match self.details.get(detail) {
            Some(values) if !values.is_empty() => values.join("; "),
            _ => "—".into(),
        }
    }
}

/// A kernel table row: the kernel, the layer it stands for, its shape and weight format.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct KernelRow {
    pub(super) kernel: String,
    pub(super) case: String,
    pub(super) shape: Vec<(&'static str, u64)>,
    pub(super) format: String,
}

/// A request table row: the cache mode, the decoding and the generation shape.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct RequestRow {
    pub(super) cache: String,
    pub(super) decoding: String,
    /// As written in the file, so equal thresholds compare equal without float keys.
    pub(super) threshold: Option<String>,
    pub(super) gen_length: u64,
    pub(super) steps: u64,
    pub(super) block_length: u64,
    /// Requests per batched call (1 in records that predate batching).
    pub(super) batch: u64,
}

pub(super) type Figures = BTreeMap<&'static str, f64>;

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
pub(super) struct Collected {
    pub(super) sources: Vec<Source>,
    pub(super) kernels: BTreeMap<(usize, KernelRow, String), Vec<Figures>>,
    pub(super) requests: BTreeMap<(usize, RequestRow), Vec<Figures>>,
    /// DiffusionGemma's decoder-step records (its own cases, no `weights` or `variant`):
    /// counted, not charted.
    pub(super) diffusion_gemma: usize,
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
    pub(super) fn read(&mut self, input: &Input) -> Result<(), CliError> {
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
            let family = object.get("model").and_then(|m| m.get("family"));
            if family.and_then(Value::as_str) == Some("diffusion_gemma") {
                self.diffusion_gemma += 1;
                continue;
            }
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
        if kind == "scoring" {
            // Pass-size timings of one estimate: read as they are, no table of their own.
            eprintln!(
                "{}:{}: a scoring record (unmask bench --only scoring), not tabulated",
                r.file, r.line
            );
            return Ok(());
        }
        if kind != "kernel" && kind != "request" {
            return Err(r.error(format!(
                "unknown record `{kind}`: expected kernel, request or scoring"
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

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::super::build;
    use super::super::fixtures::{input, kernel, request};

    #[test]
    fn diffusion_gemma_records_are_counted_not_charted() {
        let dgemma = serde_json::json!({
            "record": "kernel", "kernel": "matmul", "case": "sliding.q", "m": 256, "ms": 1.0,
            "model": {"name": "diffusiongemma-26b-a4b", "family": "diffusion_gemma"},
        });
        let r = build(
            &[input(
                "k.jsonl",
                &[kernel("GPU A", "tiled", 1.0), dgemma.to_string()],
            )],
            "x",
        )
        .unwrap();
        assert!(
            r.markdown.contains("DiffusionGemma records: 1 "),
            "{}",
            r.markdown
        );
        let e = build(&[input("d.jsonl", &[dgemma.to_string()])], "x")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("DiffusionGemma records: 1 "), "{e}");
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
}
