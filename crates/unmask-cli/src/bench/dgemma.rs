//! `unmask bench` on DiffusionGemma: its config from a folder, a config.json or the
//! `diffusiongemma-26b-a4b` preset, and the kernels of one decoder step.

use std::path::Path;

use unmask_bench as bench;
use unmask_core::config::{DIFFUSION_GEMMA_26B_A4B_CONFIG_JSON, DiffusionGemmaConfig};
use unmask_gpu::{ContextOptions, GpuContext, WeightFormat};

use super::sink::Sink;
use super::{BenchArgs, Only, model_name};
use crate::error::CliError;

/// DiffusionGemma's shapes when the model folder, `--config FILE` or the preset
/// `diffusiongemma-26b-a4b` is one; `None` for the other families.
pub(super) fn shapes(
    config: Option<&str>,
    model: Option<&Path>,
) -> Result<Option<(String, DiffusionGemmaConfig)>, CliError> {
    let (name, text) = match (config, model) {
        (Some("diffusiongemma-26b-a4b"), _) => (
            "diffusiongemma-26b-a4b".to_string(),
            DIFFUSION_GEMMA_26B_A4B_CONFIG_JSON.to_string(),
        ),
        (Some(file), _) if Path::new(file).is_file() => (
            model_name(Path::new(file)),
            std::fs::read_to_string(file).unwrap_or_default(),
        ),
        (None, Some(dir)) => (
            model_name(dir),
            std::fs::read_to_string(dir.join("config.json")).unwrap_or_default(),
        ),
        _ => return Ok(None),
    };
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str(&text) else {
        return Ok(None);
    };
    if !DiffusionGemmaConfig::is_diffusion_gemma(&map) {
        return Ok(None);
    }
    let cfg = DiffusionGemmaConfig::from_map(&map)
        .map_err(|e| CliError::context(format!("cannot read {name}'s config"), e))?;
    Ok(Some((name, cfg)))
}

/// `unmask bench` on DiffusionGemma's shapes: the kernels of one decoder step (kernels only:
/// the family has no request bench yet).
pub(super) fn run(
    args: &BenchArgs,
    name: &str,
    cfg: &DiffusionGemmaConfig,
) -> Result<(), CliError> {
    if matches!(args.only, Some(Only::Requests) | Some(Only::Work)) {
        return Err(CliError::usage(
            "--only requests / work: DiffusionGemma has kernel benchmarks only",
        ));
    }
    let engine_options = args.engine.options()?;
    let backends = engine_options
        .backend
        .as_deref()
        .map(unmask_gpu::parse_backend)
        .transpose()
        .map_err(|e| CliError::context("invalid --backend", e))?;
    let ctx = GpuContext::new(&ContextOptions {
        backends,
        runtime_checks: !args.unchecked_shaders,
        ..ContextOptions::default()
    })
    .map_err(|e| CliError::context("cannot open a GPU adapter", e))?;
    eprintln!("[gpu] {}", ctx.describe());
    let options = bench::DgemmaBenchOptions {
        rows: args
            .rows
            .as_ref()
            .and_then(|r| r.first().copied())
            .unwrap_or(cfg.canvas_length),
        prompt: args
            .kv_lens
            .as_ref()
            .and_then(|k| k.first().copied())
            .unwrap_or(1024),
        formats: args.formats.clone().unwrap_or(vec![
            WeightFormat::F16Native,
            WeightFormat::Q8,
            WeightFormat::Q4,
        ]),
        repeats: bench::Repeats::default(),
        kernels: unmask_gpu::ops::Kernels::new(&ctx, &engine_options.kernel_options()),
    };
    eprintln!(
        "DiffusionGemma kernels at {name}'s shapes: a decoder step of {} canvas rows after {} \
         cached positions, formats {:?}",
        options.rows, options.prompt, options.formats
    );
    let mut sink = Sink::open(args.out.as_deref())?;
    let envelope = bench::dgemma_envelope(&ctx, name, cfg);
    let mut failed = None;
    bench::run_dgemma_kernels(&ctx, cfg, &envelope, &options, &mut |r| {
        if r["record"] == "step" {
            eprintln!(
                "  decoder step, {} layers, {}: {:.3} ms (experts {:.3}, attention {:.3}, LM \
                 head {:.3}): {:.1} canvas rows/s",
                r["layers"],
                r["format"].as_str().unwrap_or("?"),
                r["ms"].as_f64().unwrap_or(f64::NAN),
                r["experts_ms"].as_f64().unwrap_or(f64::NAN),
                r["attention_ms"].as_f64().unwrap_or(f64::NAN),
                r["lm_head_ms"].as_f64().unwrap_or(f64::NAN),
                r["canvas_rows_per_s"].as_f64().unwrap_or(f64::NAN)
            );
        } else {
            eprintln!(
                "  {:<22} {:<10} {:>10.3} ms {:>9.2} GFLOP/s",
                r["case"].as_str().unwrap_or("?"),
                r["format"].as_str().unwrap_or("f32 K/V"),
                r["ms"].as_f64().unwrap_or(f64::NAN),
                r["gflops"].as_f64().unwrap_or(f64::NAN)
            );
        }
        if let Err(e) = sink.write(r) {
            failed.get_or_insert(e);
        }
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(())
}
