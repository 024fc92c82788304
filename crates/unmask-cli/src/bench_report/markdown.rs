//! The report's markdown tables: sources, kernels and requests.

use super::collect::{KernelRow, RequestRow};
use super::merge::Merged;

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

pub(super) fn sources_table(md: &mut String, m: &Merged) {
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
    for (s, reference, best, ratio) in m.over_reference() {
        let (cache, decoding, shape) = request_label(&best);
        let (_, _, ref_shape) = request_label(&reference);
        md.push_str(&format!(
            "{}: the fastest mode, {cache} ({decoding}, {shape}), runs {ratio:.2}× the canvas \
             throughput of the PyTorch reference `generate` ({ref_shape}).\n\n",
            m.id(s)
        ));
    }
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

pub(super) fn kernels_table(md: &mut String, m: &Merged, rows: &[&KernelRow]) {
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
                    // The tensor-core kernels are measured against the f16 tensor-core
                    // peak, the others against the FP32 one.
                    let tensor = if on_tensor_cores(variant) {
                        " (tensor)"
                    } else {
                        ""
                    };
                    match (pct("peak_gflops_share"), pct("peak_gbs_share")) {
                        (Some(c), Some(b)) => {
                            text.push_str(&format!(" · {c}{tensor} / {b} of peak"))
                        }
                        (Some(c), None) => text.push_str(&format!(" · {c} of peak FLOP/s{tensor}")),
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

pub(super) fn request_label(row: &RequestRow) -> (String, String, String) {
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

pub(super) fn requests_table(md: &mut String, m: &Merged, rows: &[&RequestRow]) {
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

/// Whether a kernel record's variant (`coop`, `auto:coop-split`, `coop/2seg`, ...) ran on
/// tensor cores.
fn on_tensor_cores(variant: &str) -> bool {
    let kernel = variant.split('/').next().unwrap_or(variant);
    let kernel = kernel.rsplit(':').next().unwrap_or(kernel);
    matches!(kernel, "coop" | "coop-split")
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::super::build;
    use super::super::fixtures::{input, request, row_of};
    use super::on_tensor_cores;

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
    fn tensor_core_variants_are_told_apart() {
        for v in [
            "coop",
            "auto:coop",
            "coop-split",
            "auto:coop-split",
            "coop/1seg",
            "auto:coop/2seg",
        ] {
            assert!(on_tensor_cores(v), "{v}");
        }
        for v in [
            "gemm",
            "auto:tiled",
            "wide/1seg",
            "auto:wide-split/2seg",
            "narrow-dot",
        ] {
            assert!(!on_tensor_cores(v), "{v}");
        }
    }
}
