//! `unmask logits`: the model's final logits for a list of token ids, as a `.npy` file.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use crate::args::{CommandSpec, Flag, Matches};
use crate::error::CliError;
use crate::npy;
use crate::options::{self, BACKEND, DTYPE, EMBED_WEIGHTS, MODEL, WEIGHTS};

pub fn spec() -> CommandSpec {
    CommandSpec {
        name: "logits",
        summary: "Write the logits of one forward pass over token ids to a .npy file.",
        usage: "unmask logits [--model DIR] --prompt-ids 1,2,3 --out FILE.npy",
        flags: vec![
            MODEL,
            Flag::value("prompt-ids", "IDS", "the input token ids, e.g. 1,2,3"),
            Flag::value(
                "out",
                "FILE",
                "where to write the float32 array [tokens, vocabulary]",
            ),
            BACKEND,
            DTYPE,
            WEIGHTS,
            EMBED_WEIGHTS,
        ],
        notes: "The vocabulary axis is the model's embedding_size (every row of the LM head),\n\
                so ids past the tokenizer's vocabulary have logits too.",
    }
}

pub fn run(m: &Matches) -> Result<(), CliError> {
    m.required("prompt-ids", "1,2,3")?;
    let ids = m.ids("prompt-ids")?.unwrap_or_default();
    let out = PathBuf::from(m.required("out", "FILE.npy")?);
    let engine_options = options::engine_options(m)?;
    let dir = options::model_dir(m)?;
    let engine = options::load_engine(&dir, &engine_options)?;
    options::check_ids(&engine, "prompt-ids", &ids)?;
    let logits = engine.model().logits(&ids)?;
    let shape = [ids.len(), engine.config().embedding_size];
    let file = File::create(&out)
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
