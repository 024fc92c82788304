//! `unmask logits`: the model's final logits for a list of token ids, as a `.npy` file.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use clap::Args;

use crate::error::CliError;
use crate::npy;
use crate::options::{self, EngineArgs, ModelArgs};
use crate::values;

#[derive(Args, Debug)]
#[command(
    about = "Write the logits of one forward pass over token ids to a .npy file.",
    override_usage = "unmask logits [--model <DIR>] --prompt-ids <IDS> --out <FILE>",
    after_help = "The vocabulary axis is the model's embedding_size (every row of the LM head),\n\
                  so ids past the tokenizer's vocabulary have logits too."
)]
pub struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// the input token ids, e.g. 1,2,3
    // The path spelled out: one value holding the list, not a value per occurrence.
    #[arg(long, value_name = "IDS", value_parser = values::token_ids)]
    prompt_ids: ::std::vec::Vec<u32>,
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
    let engine = options::load_engine(&dir, &engine_options)?;
    options::check_ids(&engine, "prompt-ids", ids)?;
    let logits = engine.model().logits(ids)?;
    let shape = [ids.len(), engine.config().embedding_size];
    let file = File::create(out)
        .map_err(|e| CliError::context(format!("cannot create {}", out.display()), e))?;
    let mut writer = BufWriter::new(file);
    npy::write_f32(&mut writer, &shape, &logits)
        .and_then(|()| writer.flush())
        .map_err(|e| CliError::context(format!("cannot write {}", out.display()), e))?;
    eprintln!(
        "wrote {}: float32 logits [{}, {}]",
        out.display(),
        shape[0],
        shape[1]
    );
    Ok(())
}
