//! Records and inputs shared by the report's tests.

use serde_json::{Value, json};

use super::Input;

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

pub(super) fn kernel(adapter: &str, variant: &str, gflops: f64) -> String {
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

pub(super) fn request(adapter: &str, cache: &str, canvas: f64) -> String {
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

pub(super) fn input(name: &str, lines: &[String]) -> Input {
    Input {
        name: name.into(),
        text: lines.join("\n"),
    }
}

pub(super) fn two_sources() -> Vec<Input> {
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

pub(super) fn row_of<'a>(md: &'a str, start: &str) -> &'a str {
    md.lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no row starting {start:?} in\n{md}"))
}
