//! The environment every record carries: adapter, backend, driver, commit, model, and the
//! adapter's datasheet peaks for the "share of peak" figures.

use serde_json::{Map, Value, json};
use unmask_core::config::ModelConfig;
use unmask_gpu::GpuContext;

/// Peak arithmetic and memory throughput of an adapter, for the "share of peak" figures.
#[derive(Clone, Debug, PartialEq)]
pub struct Peak {
    /// FP32 vector rate.
    pub gflops: Option<f64>,
    /// Dense f16 tensor-core rate with f32 accumulation (the `coop` matmul's).
    pub tensor_gflops: Option<f64>,
    pub gbs: Option<f64>,
    /// Where the figures come from (a datasheet, or the command line).
    pub source: String,
}

/// Datasheet peaks of adapters the benchmarks were run on: the FP32 vector rate (every
/// kernel but `coop`), the dense FP16 tensor-core rate with FP32 accumulation (`coop`;
/// the datasheets print twice that, with sparsity) and the HBM bandwidth. Figures from
/// NVIDIA's H100/H200 datasheets (SXM parts).
pub fn known_peak(adapter: &str) -> Option<Peak> {
    let name = adapter.to_ascii_uppercase();
    let (gflops, gbs, part) = if name.contains("H200") {
        (
            67_000.0,
            4_800.0,
            "NVIDIA H200 SXM datasheet: 67 TFLOP/s FP32, 989 TFLOP/s dense FP16 tensor, 4.8 TB/s",
        )
    } else if name.contains("H100") {
        (
            67_000.0,
            3_350.0,
            "NVIDIA H100 SXM datasheet: 67 TFLOP/s FP32, 989 TFLOP/s dense FP16 tensor, 3.35 TB/s",
        )
    } else {
        return None;
    };
    Some(Peak {
        gflops: Some(gflops),
        tensor_gflops: Some(989_400.0),
        gbs: Some(gbs),
        source: part.to_string(),
    })
}

/// The commit the binary was built from: `UNMASK_COMMIT` at build or run time, else
/// `git rev-parse` in the source tree, else "unknown".
pub fn commit() -> String {
    if let Ok(c) = std::env::var("UNMASK_COMMIT") {
        if !c.is_empty() {
            return c;
        }
    }
    if let Some(c) = option_env!("UNMASK_COMMIT") {
        return c.to_string();
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

/// The environment every record carries.
pub fn envelope(ctx: &GpuContext, model_name: &str, cfg: &ModelConfig, weights: &str) -> Value {
    json!({
        "unmask": env!("CARGO_PKG_VERSION"),
        "commit": commit(),
        "adapter": ctx.info.name,
        "backend": format!("{:?}", ctx.info.backend),
        "device_type": format!("{:?}", ctx.info.device_type),
        "driver": format!("{} {}", ctx.info.driver, ctx.info.driver_info).trim().to_string(),
        "shader_f16": ctx.features.shader_f16,
        "subgroups": ctx.features.subgroups,
        "cooperative_matrix": ctx.features.cooperative_matrix,
        // false under `--unchecked-shaders`: kernels without wgpu's bounds checks
        "shader_checks": ctx.runtime_checks,
        "model": {
            "name": model_name,
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "mlp_hidden_size": cfg.mlp_hidden_size,
            "vocab_size": cfg.vocab_size,
            "params": cfg.parameter_count(),
        },
        "weights": weights,
    })
}

/// `envelope` with the record's own fields added (theirs win on a name clash).
pub fn with_envelope(envelope: &Value, fields: Value) -> Value {
    let mut out: Map<String, Value> = envelope.as_object().cloned().unwrap_or_default();
    if let Value::Object(f) = fields {
        out.extend(f);
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_peaks_match_adapter_names() {
        assert!(known_peak("NVIDIA H200").is_some());
        assert!(known_peak("llvmpipe (LLVM 15.0.6, 256 bits)").is_none());
    }
}
