//! `unmask info`: the GPU adapter, its features and limits, and optionally a model summary.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use clap::Args;
use unmask::{Engine, EngineError};
use unmask_core::config::{DiffusionGemmaConfig, ModelConfig};
use unmask_core::tokenizer::{SpecialTokens, Tokenizer};
use unmask_gpu::WeightFormat;
use unmask_gpu::dgemma::{PASS_ROWS, kv_cache_bytes, weight_bytes};
use unmask_gpu::model::{Checkpoint, ModelError, WeightFormats};
use unmask_gpu::ops::Kernels;
use unmask_gpu::ops::attention::AttentionKernel;
use unmask_gpu::ops::matmul::MatmulKernel;
use unmask_gpu::{ContextOptions, DType, GpuContext};

use crate::error::CliError;
use crate::options::{EngineArgs, ModelArgs};
use crate::output;

#[derive(Args, Debug)]
#[command(
    about = "Show the GPU adapter, its features and limits, and (with --model) the model.",
    override_usage = "unmask info [--model <DIR>] [--load] [--backend <B>] [--dtype <D>]",
    after_help = "Without --model only the device is described. With --model the model is described\n\
                  from its files (config.json, the safetensors headers, tokenizer.json when\n\
                  present), so even a 16 GB checkpoint takes a moment; --load uploads it too."
)]
pub struct InfoArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// also upload the weights to the GPU: checks they fit and reports their size and the
    /// load time
    #[arg(long, requires = "model")]
    load: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// A GPU context for the `--backend` flag (already checked by its parser).
pub fn context(backend: Option<&str>) -> Result<Arc<GpuContext>, CliError> {
    let backends = backend.map(unmask_gpu::parse_backend).transpose()?;
    Ok(GpuContext::new(&ContextOptions {
        backends,
        ..ContextOptions::default()
    })?)
}

/// How `auto` kernels are chosen on this device, and the matmul kernels by name.
fn kernel_choice(kernels: &Kernels) -> String {
    let t = &kernels.tuner;
    let how = if !t.enabled() {
        "fixed per shape (a CPU adapter or --tune off; --tune always measures)".to_string()
    } else {
        let entries = t.entries();
        let file = t
            .path()
            .map_or("this process only".to_string(), |p| p.display().to_string());
        format!(
            "measured on first use per shape class; {} classes measured so far ({file})",
            entries.len()
        )
    };
    let names: Vec<&str> = MatmulKernel::CONCRETE.iter().map(|k| k.name()).collect();
    let attention: Vec<&str> = AttentionKernel::CONCRETE.iter().map(|k| k.name()).collect();
    format!(
        "kernel choice: {how}\nmatmul kernels: {} (this run: {})\nattention kernels: {} (this \
         run: {})",
        names.join(", "),
        kernels.matmul.name(),
        attention.join(", "),
        kernels.attention.name()
    )
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

pub fn run(args: &InfoArgs) -> Result<(), CliError> {
    let engine_options = args.engine.options()?;
    let model = match args.model.model {
        Some(_) => Some(args.model.dir()?),
        None => None,
    };
    let ctx = GpuContext::new(&engine_options.context_options()?)?;
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
    let coop_configs: Vec<String> = f
        .cooperative_configs
        .iter()
        .map(|c| {
            format!(
                "{}x{}x{} {:?}->{:?}",
                c.m_size, c.n_size, c.k_size, c.ab_type, c.cr_type
            )
        })
        .collect();
    let coop = match (f.cooperative_matrix, coop_configs.is_empty()) {
        (true, _) => format!(
            "yes, {0}x{0} fragments (adapter has {1})",
            f.cooperative_fragment,
            coop_configs.join(", ")
        ),
        (false, true) => "no".to_string(),
        (false, false) => format!(
            "not used (needs 16x16x16 or 8x8x8 F16->F32, shader-f16 and a fixed subgroup size; adapter has {})",
            coop_configs.join(", ")
        ),
    };
    let mut lines = vec![
        format!("adapter: {}", ctx.describe()),
        format!(
            "kernel features: shader-f16 {}, subgroups {subgroups}, cooperative matrices {coop}",
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
        kernel_choice(&Kernels::new(&ctx, &engine_options.kernel_options())),
    ];
    if let Some(dir) = model {
        if let Some(summary) = diffusion_gemma_summary(&dir)? {
            lines.extend(summary);
            return output::line(&lines.join("\n"));
        }
        let files = ModelFiles::read(&dir)?;
        let gpu = if args.load {
            let engine = Engine::load_on(ctx.clone(), &dir, &engine_options, &mut |_| {})?;
            format!(
                "{} ({}), loaded in {:.2} s",
                mib(engine.model().weights.size_bytes()),
                engine.model().weights.embedding.format.name(),
                engine.load_s()
            )
        } else {
            let layers = engine_options.weight_format.resolve(&ctx);
            let embed = engine_options.embed_format.unwrap_or(layers).resolve(&ctx);
            let bytes = unmask_gpu::model::weight_bytes(
                &files.config,
                WeightFormats { layers, embed },
                ctx.features.max_binding_bytes,
            )?;
            format!(
                "not loaded (--load uploads them); {} as {} (embedding and LM head {})",
                mib(bytes),
                layers.name(),
                embed.name()
            )
        };
        lines.extend(files.lines(&gpu));
        lines.push(format!(
            "  {}",
            crate::quantize::gpu_weight_sizes(&files.config, ctx.features.max_binding_bytes)?
        ));
    }
    output::line(&lines.join("\n"))
}

/// `info` for a DiffusionGemma folder (`model_type` "diffusion_gemma"): the family, its
/// shape, parameters and the GPU memory of its weights per format. `None` for other models.
fn diffusion_gemma_summary(dir: &Path) -> Result<Option<Vec<String>>, CliError> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        // A missing or unreadable config.json is `ModelFiles::read`'s error to report.
        return Ok(None);
    };
    // Anything but a DiffusionGemma object (invalid JSON included) is for `ModelFiles::read`.
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str(&text) else {
        return Ok(None);
    };
    if !DiffusionGemmaConfig::is_diffusion_gemma(&map) {
        return Ok(None);
    }
    let c = DiffusionGemmaConfig::from_map(&map)
        .map_err(|e| CliError::context(format!("cannot read {}", path.display()), e))?;
    let sliding = c.layers.iter().filter(|l| l.sliding).count();
    let (total, active) = c.parameter_counts();
    Ok(Some(vec![
        format!("model: {}", dir.display()),
        "  family: DiffusionGemma (model.decoder.* tensors; the vision tower is skipped): \
         unmask generate, logits, eval and serve run it, unmask bench times its kernels, the \
         browser build loads it (docs/models/diffusion-gemma.md)"
            .to_string(),
        format!(
            "  config: hidden {}, {} layers ({sliding} sliding-window {}, {} full), {} heads, \
             {} experts top {} (width {}) beside a dense MLP of {}, vocab {}, canvas {}, \
             logit soft-cap {}",
            c.hidden_size,
            c.layers.len(),
            c.sliding_window,
            c.layers.len() - sliding,
            c.heads,
            c.num_experts,
            c.top_k_experts,
            c.moe_intermediate_size,
            c.intermediate_size,
            c.vocab_size,
            c.canvas_length,
            c.final_logit_softcapping
        ),
        format!(
            "  parameters: {} ({}), {} per token ({})",
            group_digits(total as usize),
            short_count(total as usize),
            group_digits(active as usize),
            short_count(active as usize)
        ),
        format!(
            "  GPU memory of the weights (router f32): f16 {}, q8 {}, q4 {}",
            bytes_text(weight_bytes(&c, WeightFormat::F16Packed)),
            bytes_text(weight_bytes(&c, WeightFormat::Q8)),
            bytes_text(weight_bytes(&c, WeightFormat::Q4)),
        ),
        format!(
            "  K/V cache (sliding layers keep W - 1 + {PASS_ROWS} rows): f32 {} at 8192 \
             positions, {} at 32768; --kv f16 {} and {}",
            bytes_text(kv_cache_bytes(&c, 8192, PASS_ROWS, DType::F32)),
            bytes_text(kv_cache_bytes(&c, 32768, PASS_ROWS, DType::F32)),
            bytes_text(kv_cache_bytes(&c, 8192, PASS_ROWS, DType::F16)),
            bytes_text(kv_cache_bytes(&c, 32768, PASS_ROWS, DType::F16)),
        ),
    ]))
}

/// A model folder as its files describe it, without uploading anything.
struct ModelFiles<'a> {
    dir: &'a Path,
    config: ModelConfig,
    params: u64,
    /// Safetensors files holding the model's tensors.
    files: usize,
    /// Bytes of the model's tensors as stored.
    stored_bytes: u64,
    /// Stored element types, e.g. {"BF16"}.
    dtypes: BTreeSet<String>,
    /// Tensors in the files that the model does not use.
    unused: usize,
    tokenizer: Option<Tokenizer>,
    special: SpecialTokens,
}

impl<'a> ModelFiles<'a> {
    /// Reads config.json and tokenizer.json, and checks every tensor's name, shape and
    /// dtype against the safetensors headers (no tensor data is read).
    fn read(dir: &'a Path) -> Result<Self, CliError> {
        let model_error = |e: ModelError| CliError::from(EngineError::from(e));
        let config =
            ModelConfig::from_file(dir.join("config.json")).map_err(|e| model_error(e.into()))?;
        let checkpoint = Checkpoint::open(dir).map_err(|e| model_error(e.into()))?;
        let specs = config.tensor_specs();
        let mut paths = BTreeSet::new();
        let mut dtypes = BTreeSet::new();
        let mut stored_bytes = 0u64;
        let mut file_tensors = 0usize;
        for (name, shape) in &specs {
            // A quantized matrix is two file tensors (codes and scales) under one name.
            let t = checkpoint
                .stored_tensor(name, shape)
                .map_err(|e| model_error(e.into()))?;
            paths.insert(t.path.to_path_buf());
            dtypes.insert(t.dtype.clone());
            stored_bytes += t.bytes;
            file_tensors += t.file_tensors;
        }
        let unused = checkpoint.names().count().saturating_sub(file_tensors);
        let tokenizer_path = dir.join("tokenizer.json");
        let present = unmask_core::small_files::exists(&tokenizer_path).map_err(|why| {
            CliError::runtime(format!("cannot read {}: {why}", tokenizer_path.display()))
        })?;
        let tokenizer = if present {
            Some(Tokenizer::from_file(&tokenizer_path)?)
        } else {
            None
        };
        let special = SpecialTokens::resolve(tokenizer.as_ref(), &config)?;
        Ok(Self {
            dir,
            params: config.parameter_count(),
            config,
            files: paths.len(),
            stored_bytes,
            dtypes,
            unused,
            tokenizer,
            special,
        })
    }

    fn lines(&self, gpu: &str) -> Vec<String> {
        let c = &self.config;
        let s = &self.special;
        let eot = s.eot.map(|id| id.to_string()).unwrap_or_else(|| "-".into());
        let unused = match self.unused {
            0 => String::new(),
            n => format!(", {n} unused tensors"),
        };
        let family = c.family.spec().summary;
        vec![
            format!("model: {}", self.dir.display()),
            format!("  family: {family}"),
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
                group_digits(self.params as usize),
                short_count(self.params as usize)
            ),
            format!(
                "  checkpoint: {} bytes of {} tensors in {} file{}{unused}",
                group_digits(self.stored_bytes as usize),
                self.dtypes.iter().cloned().collect::<Vec<_>>().join("/"),
                self.files,
                if self.files == 1 { "" } else { "s" }
            ),
            format!("  weights on the GPU: {gpu}"),
            match &self.tokenizer {
                Some(t) => format!("  tokenizer: {} tokens", t.vocab_size()),
                None => "  tokenizer: none (no tokenizer.json): token ids only, e.g. \
                         --prompt-ids; text prompts and decoding need one"
                    .to_string(),
            },
            format!(
                "  special tokens: mask {}, eos {}, bos {}, eot {eot}",
                s.mask, s.eos, s.bos
            ),
        ]
    }
}

/// 8015179776 -> "8,015,179,776".
pub fn group_digits(n: usize) -> String {
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
pub fn short_count(n: usize) -> String {
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

/// Bytes in KiB, MiB or GiB, one decimal, whichever keeps the number readable.
fn bytes_text(bytes: u64) -> String {
    let b = bytes as f64;
    match b {
        b if b >= (1u64 << 30) as f64 => format!("{:.1} GiB", b / (1u64 << 30) as f64),
        b if b >= (1u64 << 20) as f64 => format!("{:.1} MiB", b / (1u64 << 20) as f64),
        b => format!("{:.1} KiB", b / 1024.0),
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
