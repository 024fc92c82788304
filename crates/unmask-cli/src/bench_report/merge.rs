//! Merging repeated measurements (the median of each figure), the best kernel variant per
//! row, and the order of the tables' rows.

use std::collections::BTreeMap;

use super::collect::{Collected, Figures, KernelRow, RequestRow, Source};

/// The cache name of `tools/torch_bench.py`'s rows: the PyTorch reference `generate`.
pub(super) const REFERENCE_CACHE: &str = "pytorch-reference";

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
pub(super) struct Merged {
    pub(super) sources: Vec<Source>,
    /// Best variant per (source, row): its name and figures.
    pub(super) kernels: BTreeMap<(usize, KernelRow), (String, Figures)>,
    pub(super) requests: BTreeMap<(usize, RequestRow), Figures>,
}

impl Merged {
    pub(super) fn new(c: Collected) -> Self {
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
    pub(super) fn with<T>(&self, map: &BTreeMap<(usize, T), impl Sized>) -> Vec<usize> {
        (0..self.sources.len())
            .filter(|s| map.keys().any(|(source, _)| source == s))
            .collect()
    }

    pub(super) fn kernel_rows(&self) -> Vec<&KernelRow> {
        let mut rows: Vec<&KernelRow> = self.kernels.keys().map(|(_, r)| r).collect();
        rows.sort_by(|a, b| kernel_order(a).cmp(&kernel_order(b)));
        rows.dedup();
        rows
    }

    pub(super) fn request_rows(&self) -> Vec<&RequestRow> {
        let mut rows: Vec<&RequestRow> = self.requests.keys().map(|(_, r)| r).collect();
        rows.sort_by(|a, b| request_order(a).cmp(&request_order(b)));
        rows.dedup();
        rows
    }

    /// Canvas throughput of `row` over that of `none` with the same decoding and shape.
    pub(super) fn speed_up(&self, source: usize, row: &RequestRow) -> Option<f64> {
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

    /// Per source with a `pytorch-reference` row (tools/torch_bench.py): the runtime's
    /// fastest row of the same decoding and shape, and its canvas throughput over the
    /// reference's: (source, reference row, fastest row, ratio).
    pub(super) fn over_reference(&self) -> Vec<(usize, RequestRow, RequestRow, f64)> {
        let mut out = Vec::new();
        for ((source, row), figures) in &self.requests {
            if row.cache != REFERENCE_CACHE {
                continue;
            }
            let Some(&base) = figures.get("throughput_canvas").filter(|&&b| b > 0.0) else {
                continue;
            };
            let same_shape = |r: &RequestRow| {
                r.cache != REFERENCE_CACHE
                    && (
                        &r.decoding,
                        &r.threshold,
                        r.gen_length,
                        r.steps,
                        r.block_length,
                    ) == (
                        &row.decoding,
                        &row.threshold,
                        row.gen_length,
                        row.steps,
                        row.block_length,
                    )
            };
            let best = self
                .requests
                .iter()
                .filter(|((s, r), _)| s == source && same_shape(r))
                .filter_map(|((_, r), f)| Some((r, *f.get("throughput_canvas")?)))
                .max_by(|a, b| a.1.total_cmp(&b.1));
            if let Some((r, t)) = best {
                out.push((*source, row.clone(), r.clone(), t / base));
            }
        }
        out
    }

    pub(super) fn id(&self, source: usize) -> String {
        format!("S{}", source + 1)
    }

    /// The legend's name for a source: its id, adapter, backend and weights, and the model
    /// when the sources do not all share one.
    pub(super) fn label(&self, source: usize) -> String {
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

#[cfg(test)]
mod tests {
    use super::super::build;
    use super::super::fixtures::{row_of, two_sources};

    #[test]
    fn the_fastest_mode_is_set_against_the_pytorch_reference() {
        use super::super::fixtures::{input, request};
        use super::REFERENCE_CACHE;
        let lines = [
            request("GPU A", "none", 100.0),
            request("GPU A", "bicache-dual", 450.0),
            request("GPU A", "fast-dllm-dual", 300.0),
            request("GPU A", REFERENCE_CACHE, 150.0),
        ];
        let r = build(&[input("a.jsonl", &lines)], "unmask bench-report").unwrap();
        assert!(
            r.markdown.contains(
                "S1: the fastest mode, bicache-dual (quota, 64/32/32), runs 3.00× the canvas \
                 throughput of the PyTorch reference `generate` (64/32/32)."
            ),
            "{}",
            r.markdown
        );
        // Without a reference row there is no such line.
        let r = build(&[input("a.jsonl", &lines[..3])], "unmask bench-report").unwrap();
        assert!(!r.markdown.contains("PyTorch reference"));
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
}
