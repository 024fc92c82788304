//! `unmask quantize`: write a q8 / q4 copy of a model folder that loads without
//! re-quantizing.

use std::fs::File;
use std::io::BufWriter;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use clap::Args;
use unmask_core::config::ModelConfig;
use unmask_core::quant::QuantFormat;
use unmask_gpu::WeightFormat;
use unmask_gpu::model::{Checkpoint, ModelError, WeightFormats, weight_bytes, write_quantized};

use crate::error::CliError;
use crate::live::LoadBar;
use crate::options::ModelArgs;
use crate::values;

/// File name of the quantized checkpoint in the output folder.
const OUT_FILE: &str = "model.safetensors";

#[derive(Args, Debug)]
#[command(
    about = "Write a copy of a model with 8- or 4-bit weights (loads without re-quantizing).",
    override_usage = "unmask quantize [--model <DIR>] --weights <q8|q4> [--embed-weights <f16|q8|q4>] --out <DIR>",
    after_help = "The output folder gets model.safetensors with the quantized matrices and every\n\
                  other file of the model folder (config.json, tokenizer files, ...). Loading it\n\
                  (e.g. `unmask generate --model DIR`) uploads the stored codes as they are; its\n\
                  matrices keep their format whatever --weights says. Needs no GPU."
)]
pub struct QuantizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// q8 or q4: the transformer blocks' matrices in blocks of 32 weights with an f16 scale
    /// (8.5 or 4.5 bits per weight)
    #[arg(long, value_name = "W", value_parser = values::choice(["q8", "q4"], QuantFormat::from_name))]
    weights: QuantFormat,
    /// embedding table and LM head: q8, q4, or f16 to keep them as stored (default: as
    /// --weights)
    #[arg(long, value_name = "W", value_parser = ["f16", "q8", "q4"])]
    embed_weights: Option<String>,
    /// the new model folder (created; must not hold a checkpoint yet)
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

pub fn run(args: &QuantizeArgs) -> Result<(), CliError> {
    let layers = args.weights;
    // `f16` keeps the embedding table and LM head as stored (no quantization).
    let embed = match args.embed_weights.as_deref() {
        Some(name) => QuantFormat::from_name(name),
        None => Some(layers),
    };
    let out_dir = &args.out;
    let dir = args.model.dir()?;
    check_out_dir(&dir, out_dir)?;

    let cfg = ModelConfig::from_file(dir.join("config.json")).map_err(ModelError::from)?;
    let ckpt = Checkpoint::open(&dir).map_err(ModelError::from)?;
    std::fs::create_dir_all(out_dir)
        .map_err(|e| CliError::context(format!("cannot create {}", out_dir.display()), e))?;
    // Written under another name first, so an interrupted run leaves no checkpoint behind.
    let partial = out_dir.join(format!("{OUT_FILE}.partial"));
    let file = File::create(&partial)
        .map_err(|e| CliError::context(format!("cannot create {}", partial.display()), e))?;
    let show = std::io::stderr().is_terminal();
    let mut bar = LoadBar::new();
    let result = write_quantized(
        &cfg,
        &ckpt,
        Some(layers),
        embed,
        BufWriter::new(file),
        &mut |p| {
            if show {
                bar.update(&p);
            }
        },
    );
    bar.finish();
    let bytes = match result {
        Ok(bytes) => bytes,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e.into());
        }
    };
    let target = out_dir.join(OUT_FILE);
    std::fs::rename(&partial, &target)
        .map_err(|e| CliError::context(format!("cannot rename {}", partial.display()), e))?;
    let copied = copy_model_files(&dir, out_dir)?;
    let on_gpu = WeightFormats {
        layers: WeightFormat::from(layers),
        embed: embed.map_or(WeightFormat::F16Packed, WeightFormat::from),
    };
    let gpu_bytes = weight_bytes(&cfg, on_gpu, 128 << 20)?;
    eprintln!(
        "wrote {} ({}; blocks {}, embedding and LM head {}; {} on the GPU) and copied {} file{}: {}",
        target.display(),
        gb(bytes),
        layers.name(),
        embed.map_or("as stored", QuantFormat::name),
        gb(gpu_bytes),
        copied.len(),
        if copied.len() == 1 { "" } else { "s" },
        copied.join(", ")
    );
    eprintln!("{}", gpu_weight_sizes(&cfg, 128 << 20)?);
    Ok(())
}

/// The output folder may not be the input or already hold a checkpoint.
fn check_out_dir(dir: &Path, out_dir: &Path) -> Result<(), CliError> {
    if let (Ok(a), Ok(b)) = (dir.canonicalize(), out_dir.canonicalize())
        && a == b
    {
        return Err(CliError::usage(
            "--out is the model folder itself; give a new folder",
        ));
    }
    for name in [OUT_FILE, "model.safetensors.index.json"] {
        if out_dir.join(name).exists() {
            return Err(CliError::usage(format!(
                "{} already holds a checkpoint ({name}); remove it or choose another --out",
                out_dir.display()
            )));
        }
    }
    Ok(())
}

/// Copies every file of `dir` except the checkpoint itself; returns their names.
fn copy_model_files(dir: &Path, out_dir: &Path) -> Result<Vec<String>, CliError> {
    let read_err = |e| CliError::context(format!("cannot list {}", dir.display()), e);
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_checkpoint =
            name.ends_with(".safetensors") || name == "model.safetensors.index.json";
        if is_checkpoint {
            continue;
        }
        // A broken link (a tokenizer.json whose blob is gone) is an error, not a file the
        // copy silently lacks.
        unmask_core::small_files::exists(&entry.path()).map_err(|why| {
            CliError::runtime(format!("cannot copy {}: {why}", entry.path().display()))
        })?;
        if !entry.path().is_file() {
            continue;
        }
        std::fs::copy(entry.path(), out_dir.join(&name))
            .map_err(|e| CliError::context(format!("cannot copy {name}"), e))?;
        names.push(name);
    }
    names.sort();
    Ok(names)
}

fn gb(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}

/// One line for `unmask info`: the bytes `cfg`'s weights take on the GPU in each format
/// (`unmask_gpu::model::weight_bytes`, chunked for bindings of `max_binding_bytes`).
pub fn gpu_weight_sizes(cfg: &ModelConfig, max_binding_bytes: u64) -> Result<String, CliError> {
    let mut parts = Vec::new();
    for format in [
        WeightFormat::F32,
        WeightFormat::F16Packed,
        WeightFormat::Q8,
        WeightFormat::Q4,
    ] {
        let bytes = weight_bytes(cfg, WeightFormats::uniform(format), max_binding_bytes)?;
        let name = if format == WeightFormat::F16Packed {
            "f16"
        } else {
            format.name()
        };
        parts.push(format!("{name} {}", gb(bytes)));
    }
    let mixed = WeightFormats {
        layers: WeightFormat::Q4,
        embed: WeightFormat::F16Packed,
    };
    Ok(format!(
        "weights on the GPU by format: {} (q4 with f16 embedding and LM head {})",
        parts.join(", "),
        gb(weight_bytes(cfg, mixed, max_binding_bytes)?)
    ))
}
