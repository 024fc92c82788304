//! `unmask info`: the GPU adapter, its features and limits, and optionally a model summary.

use std::sync::Arc;

use unmask::Engine;
use unmask_gpu::{ContextOptions, GpuContext};

use crate::args::{CommandSpec, Matches};
use crate::error::CliError;
use crate::options::{self, BACKEND, DTYPE, MODEL};
use crate::output;

pub fn spec() -> CommandSpec {
    CommandSpec {
        name: "info",
        summary: "Show the GPU adapter, its features and limits, and (with --model) the model.",
        usage: "unmask info [--model DIR] [--backend B] [--dtype D]",
        flags: vec![MODEL, BACKEND, DTYPE],
        notes: "Without --model only the device is described.",
    }
}

/// A GPU context for the `--backend` flag (already checked by `engine_options`).
pub fn context(backend: Option<&str>) -> Result<Arc<GpuContext>, CliError> {
    let backends = backend.map(unmask_gpu::parse_backend).transpose()?;
    Ok(GpuContext::new(&ContextOptions {
        backends,
        ..ContextOptions::default()
    })?)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

pub fn run(m: &Matches) -> Result<(), CliError> {
    let engine_options = options::engine_options(m)?;
    let model = match m.value("model") {
        Some(_) => Some(options::model_dir(m)?),
        None => None,
    };
    let ctx = context(engine_options.backend.as_deref())?;
    let f = &ctx.features;
    let l = &ctx.limits;
    let subgroups = if f.subgroups {
        format!(
            "yes (sizes {}..{})",
            f.subgroup_min_size, f.subgroup_max_size
        )
    } else {
        "no".to_string()
    };
    let mut lines = vec![
        format!("adapter: {}", ctx.describe()),
        format!(
            "kernel features: shader-f16 {}, subgroups {subgroups}",
            if f.shader_f16 { "yes" } else { "no" }
        ),
        format!("device features: {:?}", ctx.device.features()),
        format!(
            "limits: storage binding {} (kernels use {}), buffer {}, workgroup storage {} KiB, \
             {} invocations per workgroup, {} workgroups per dimension, {} storage buffers per stage",
            mib(l.max_storage_buffer_binding_size),
            mib(f.max_binding_bytes),
            mib(l.max_buffer_size),
            l.max_compute_workgroup_storage_size / 1024,
            l.max_compute_invocations_per_workgroup,
            l.max_compute_workgroups_per_dimension,
            l.max_storage_buffers_per_shader_stage
        ),
    ];
    if let Some(dir) = model {
        let engine = Engine::load_on(ctx.clone(), &dir, &engine_options, &mut |_| {})?;
        lines.extend(model_lines(&engine));
    }
    output::line(&lines.join("\n"))
}

fn model_lines(engine: &Engine) -> Vec<String> {
    let c = engine.config();
    let params: usize = c
        .tensor_specs()
        .iter()
        .map(|(_, shape)| shape.iter().product::<usize>())
        .sum();
    let s = &engine.special;
    let eot = s.eot.map(|id| id.to_string()).unwrap_or_else(|| "-".into());
    vec![
        format!("model: {}", engine.dir.display()),
        format!(
            "  config: d_model {}, {} layers, {} heads ({} key/value heads, head_dim {}), \
             mlp hidden {}, vocab {} (embedding {}), max sequence {}, rope theta {}, tied embeddings {}",
            c.d_model,
            c.n_layers,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim(),
            c.mlp_hidden_size,
            c.vocab_size,
            c.embedding_size,
            c.max_sequence_length,
            c.rope_theta,
            c.weight_tying
        ),
        format!(
            "  parameters: {} ({})",
            group_digits(params),
            short_count(params)
        ),
        format!(
            "  weights on the GPU: {} ({})",
            mib(engine.model.weights.size_bytes()),
            engine.model.weights.embedding.format.name()
        ),
        match &engine.tokenizer {
            Some(t) => format!("  tokenizer: {} tokens", t.vocab_size()),
            None => "  tokenizer: none (token ids only)".to_string(),
        },
        format!(
            "  special tokens: mask {}, eos {}, bos {}, eot {eot}",
            s.mask, s.eos, s.bos
        ),
    ]
}

/// 8015179776 -> "8,015,179,776".
fn group_digits(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// 8015179776 -> "8.02 B".
fn short_count(n: usize) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2} B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2} M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1} K", n / 1e3)
    } else {
        format!("{n}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts() {
        assert_eq!(group_digits(8015179776), "8,015,179,776");
        assert_eq!(group_digits(999), "999");
        assert_eq!(group_digits(1000), "1,000");
        assert_eq!(short_count(8015179776), "8.02 B");
        assert_eq!(short_count(51200), "51.2 K");
    }
}
