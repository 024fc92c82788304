//! `unmask synth`: a checkpoint with random weights and the real LLaDA, Dream or DiffusionGemma
//! tensor names and shapes, in the Hugging Face layout, for load tests and benchmarks without
//! real weights.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use indicatif::ProgressBar;
use unmask_core::synth::{
    self, DEFAULT_SHARD_BYTES, PRESET_NAMES, SynthConfig, SynthError, SynthOptions, SynthProgress,
    WeightDtype,
};

use crate::error::CliError;
use crate::info::{group_digits, short_count};
use crate::live::stderr_bar;
use crate::{output, values};

/// Outputs at least this large report their progress on stderr.
const PROGRESS_FROM_BYTES: u64 = 256 << 20;

#[derive(Args, Debug)]
#[command(
    about = "Write a LLaDA, Dream or DiffusionGemma checkpoint with random weights (real names and shapes).",
    override_usage = "unmask synth --config <llada-8b|tiny|dream-7b|tiny-dream|diffusiongemma-26b-a4b|FILE> --out <DIR> [--layers <N>] [--seed <S>] \
                      [--dtype <D>] [--shard-bytes <N>] [--force]",
    after_help = "Writes config.json (and generation_config.json for the LLaDA and Dream presets,\n\
                  or when one is beside FILE), model.safetensors or model-0000K-of-0000N.safetensors\n\
                  with model.safetensors.index.json. Matrices are approximately N(0, 0.02^2);\n\
                  norm weights, and DiffusionGemma's router scales and layer scalars, are 1.\n\
                  Each tensor's values depend only on the seed and its name: the same seed\n\
                  gives the same bytes whatever the shard size. No tokenizer is written, so\n\
                  use token ids (e.g. `unmask logits --prompt-ids`)."
)]
pub struct SynthArgs {
    /// llada-8b (LLaDA-8B-Instruct's config.json), tiny (test size), dream-7b (Dream-v0-7B and
    /// DiffuCoder-7B), tiny-dream, diffusiongemma-26b-a4b (the published text stack; no
    /// vision tower), or a LLaDA, Dream or DiffusionGemma config.json (or its folder)
    #[arg(long, value_name = "C")]
    config: String,
    /// folder to write (created when missing)
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// random seed (default 0)
    #[arg(
        long,
        value_name = "S",
        value_parser = values::seed,
        allow_negative_numbers = true,
        default_value_t = 0,
        hide_default_value = true
    )]
    seed: u64,
    /// keep only N transformer layers (every other field as the config says), e.g. an
    /// LLaDA-8B-, Dream-7B- or DiffusionGemma-shaped checkpoint of 2 layers
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true)]
    layers: Option<usize>,
    /// stored weight type: bf16 (default, as LLaDA and Dream ship), f16, f32
    #[arg(long, value_name = "D", value_parser = values::choice(WeightDtype::NAMES, WeightDtype::parse))]
    dtype: Option<WeightDtype>,
    /// most tensor bytes per file, e.g. 2G (K, M, G are powers of 1024); default 5000000000
    /// (Hugging Face's 5GB)
    #[arg(long, value_name = "N", value_parser = values::byte_size)]
    shard_bytes: Option<u64>,
    /// write into a non-empty folder, replacing the checkpoint files there
    #[arg(long)]
    force: bool,
}

pub fn run(args: &SynthArgs) -> Result<(), CliError> {
    let config_spec = &args.config;
    let out = args.out.clone();
    let seed = args.seed;
    let dtype = args.dtype.unwrap_or(WeightDtype::BF16);
    let shard_bytes = args.shard_bytes.unwrap_or(DEFAULT_SHARD_BYTES);
    let layers = args.layers;
    let mut config = SynthConfig::resolve(config_spec).map_err(|e| synth_error(e, &out))?;
    if let Some(n) = layers {
        config = config.with_layers(n).map_err(|e| synth_error(e, &out))?;
    }
    let options = SynthOptions {
        seed,
        dtype,
        shard_bytes,
        force: args.force,
    };

    let start = Instant::now();
    let mut meter = ProgressMeter::new();
    let result = synth::write_checkpoint(&out, &config, &options, &mut |p| meter.update(&p));
    meter.finish();
    let summary = result.map_err(|e| synth_error(e, &out))?;
    let seconds = start.elapsed().as_secs_f64();
    output::line(&format!(
        "wrote {} ({}, seed {seed}): {} parameters ({}), {} bytes of {} tensors in {} {}, \
         {} bytes on disk, in {seconds:.1} s ({:.0} MB/s)",
        out.display(),
        config.source,
        group_digits(summary.params as usize),
        short_count(summary.params as usize),
        group_digits(summary.data_bytes as usize),
        dtype.name(),
        summary.shards.len(),
        if summary.shards.len() == 1 {
            "file"
        } else {
            "shards"
        },
        group_digits(summary.file_bytes as usize),
        summary.file_bytes as f64 / 1e6 / seconds.max(1e-9),
    ))
}

/// The library's errors in terms of the flags.
fn synth_error(e: SynthError, out: &std::path::Path) -> CliError {
    match e {
        SynthError::UnknownConfig { given } => CliError::usage(format!(
            "invalid value for --config: `{given}` is neither a preset ({}) nor an existing \
             config.json or model folder",
            PRESET_NAMES.join(", ")
        )),
        SynthError::NotEmpty { path, entry } => CliError::usage(format!(
            "--out {} is not empty (it holds {entry}): choose an empty or new folder, or pass \
             --force to write there (its checkpoint files are replaced)",
            path.display()
        )),
        SynthError::NotADirectory { path } => CliError::usage(format!(
            "--out {} exists and is not a directory",
            path.display()
        )),
        other @ SynthError::Config { .. } => CliError::context(other.to_string(), other),
        other => CliError::context(format!("cannot synthesize into {}", out.display()), other),
    }
}

pub(crate) const WRITE_TEMPLATE: &str = "writing [{bar:24}] {percent:>3}%  {decimal_bytes} / \
                              {decimal_total_bytes}  {decimal_bytes_per_sec}  {wide_msg}";

/// Bytes written so far, on stderr for large outputs: an indicatif bar on a terminal, one
/// line per tenth otherwise (logs), since indicatif draws nothing off a terminal.
struct ProgressMeter {
    bar: Option<ProgressBar>,
    last_tenth: u64,
    started: Instant,
}

impl ProgressMeter {
    fn new() -> Self {
        Self {
            bar: None,
            last_tenth: 0,
            started: Instant::now(),
        }
    }

    fn update(&mut self, p: &SynthProgress<'_>) {
        if p.total_bytes < PROGRESS_FROM_BYTES {
            return;
        }
        let bar = self
            .bar
            .get_or_insert_with(|| stderr_bar(p.total_bytes, WRITE_TEMPLATE));
        bar.set_position(p.done_bytes);
        bar.set_message(p.file.to_string());
        if !bar.is_hidden() {
            return;
        }
        let tenth = p.done_bytes * 10 / p.total_bytes;
        if tenth > self.last_tenth {
            self.last_tenth = tenth;
            let gb = |b: u64| b as f64 / 1e9;
            let rate = p.done_bytes as f64 / 1e6 / self.started.elapsed().as_secs_f64().max(1e-9);
            eprintln!(
                "writing {:>3.0}%  {:.2} / {:.2} GB  {rate:.0} MB/s  {}",
                p.done_bytes as f64 / p.total_bytes as f64 * 100.0,
                gb(p.done_bytes),
                gb(p.total_bytes),
                p.file
            );
        }
    }

    /// Leaves the bar on its line as it stands (short of 100 % when writing failed).
    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_flags() {
        let out = std::path::Path::new("/tmp/model");
        let e = synth_error(
            SynthError::UnknownConfig {
                given: "llada-70b".into(),
            },
            out,
        );
        assert_eq!(e.exit_code(), 2);
        assert!(e.message.contains("--config") && e.message.contains("llada-8b, tiny"));
        let e = synth_error(
            SynthError::NotEmpty {
                path: out.into(),
                entry: "notes.txt".into(),
            },
            out,
        );
        assert!(e.message.contains("/tmp/model") && e.message.contains("--force"));
        let e = synth_error(
            SynthError::Create {
                path: out.join("config.json"),
                source: std::io::ErrorKind::PermissionDenied.into(),
            },
            out,
        );
        assert_eq!(e.exit_code(), 1);
        assert!(
            e.report().contains("/tmp/model/config.json"),
            "{}",
            e.report()
        );
    }
}
