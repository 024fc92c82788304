//! `unmask logits`: the model's final logits for a list of token ids, as a `.npy` file.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::PathBuf;

use clap::Args;
use npyz::WriterBuilder;

use crate::error::CliError;
use crate::options::{self, EngineArgs, ModelArgs};
use crate::values;

mod dgemma;

#[derive(Args, Debug)]
#[command(
    about = "Write the logits of one forward pass over token ids to a .npy file.",
    override_usage = "unmask logits [--model <DIR>] --prompt-ids <IDS> [--canvas-ids <IDS> ...] --out <FILE>",
    after_help = "The vocabulary axis is the model's embedding_size (every row of the LM head),\n\
                  so ids past the tokenizer's vocabulary have logits too.\n\n\
                  DiffusionGemma: without --canvas-ids, the encoder's logits over the prompt\n\
                  [tokens, vocabulary]; with them, the prompt is encoded and the decoder's\n\
                  logits of each canvas in turn are written [canvases, canvas tokens, vocabulary],\n\
                  each canvas after the first self-conditioned on the previous one's logits\n\
                  divided by the temperature of the step before it (generation_config.json),\n\
                  as the reference's denoising loop feeds them."
)]
pub struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// the input token ids, e.g. 1,2,3
    // The path spelled out: one value holding the list, not a value per occurrence.
    #[arg(long, value_name = "IDS", value_parser = values::token_ids)]
    prompt_ids: ::std::vec::Vec<u32>,
    /// DiffusionGemma: a canvas for the decoder after the prompt (repeat for more steps)
    #[arg(long, value_name = "IDS", value_parser = values::token_ids)]
    canvas_ids: Vec<::std::vec::Vec<u32>>,
    /// where to write the float32 array [tokens, vocabulary]
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(args: &LogitsArgs) -> Result<(), CliError> {
    let ids = &args.prompt_ids;
    let out = &args.out;
    let engine_options = args.engine.options()?;
    let dir = args.model.dir()?;
    if crate::dgemma::is_diffusion_gemma(&dir) {
        let (shape, logits) = dgemma::logits(&dir, &engine_options, ids, &args.canvas_ids)?;
        return write(out, &shape, &logits);
    }
    if !args.canvas_ids.is_empty() {
        return Err(CliError::usage(
            "--canvas-ids: only a DiffusionGemma model has a decoder pass over a canvas",
        ));
    }
    let engine = options::load_engine(&dir, &engine_options)?;
    options::check_ids(&engine, "prompt-ids", ids)?;
    let logits = engine.model().logits(ids)?;
    let shape = [ids.len(), engine.config().embedding_size];
    write(out, &shape, &logits)
}

/// `logits` of `shape` into the `.npy` file `out`.
fn write(out: &std::path::Path, shape: &[usize], logits: &[f32]) -> Result<(), CliError> {
    let file = File::create(out)
        .map_err(|e| CliError::context(format!("cannot create {}", out.display()), e))?;
    write_npy(BufWriter::new(file), shape, logits)
        .map_err(|e| CliError::context(format!("cannot write {}", out.display()), e))?;
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    eprintln!(
        "wrote {}: float32 logits [{}]",
        out.display(),
        dims.join(", ")
    );
    Ok(())
}

/// Writes `data` (row-major, `shape.iter().product()` values) as a little-endian f32 `.npy`
/// array; a count that does not fill the shape is an error.
fn write_npy(out: impl Write, shape: &[usize], data: &[f32]) -> io::Result<()> {
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let mut writer = npyz::WriteOptions::<f32>::new()
        .default_dtype()
        .shape(&shape)
        .writer(out)
        .begin_nd()?;
    writer.extend(data.iter().copied())?;
    // Checks the count against the shape and flushes `out`.
    writer.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_reads_back_with_its_shape() {
        let mut buf = Vec::new();
        write_npy(&mut buf, &[2, 3], &[1.0, -2.0, 0.5, 3.0, f32::MIN, 7.25]).unwrap();
        // NumPy's format 1.0, the data aligned to 64 bytes.
        assert_eq!(&buf[..8], b"\x93NUMPY\x01\x00");
        let header_len = u16::from_le_bytes([buf[8], buf[9]]) as usize;
        assert_eq!((10 + header_len) % 64, 0);
        assert_eq!(buf.len(), 10 + header_len + 6 * 4);
        let npy = npyz::NpyFile::new(&buf[..]).unwrap();
        assert_eq!(npy.shape(), [2, 3]);
        assert_eq!(npy.dtype(), npyz::DType::Plain("<f4".parse().unwrap()));
        assert_eq!(
            npy.into_vec::<f32>().unwrap(),
            [1.0, -2.0, 0.5, 3.0, f32::MIN, 7.25]
        );
    }

    #[test]
    fn a_count_that_does_not_fill_the_shape_is_an_error() {
        assert!(write_npy(&mut Vec::new(), &[2, 2], &[1.0]).is_err());
        assert!(write_npy(&mut Vec::new(), &[2, 2], &[1.0; 5]).is_err());
    }
}
