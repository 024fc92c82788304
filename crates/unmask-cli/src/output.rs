//! Writing results to stdout, with write failures reported as errors instead of panics.

use std::io::{self, Write};

use crate::error::CliError;

/// Writes `text` and a newline to stdout and flushes it.
pub fn line(text: &str) -> Result<(), CliError> {
    let mut out = io::stdout().lock();
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(|e| CliError::context("cannot write to stdout", e))
}

/// Writes `text` without a newline (a prompt) and flushes it.
pub fn partial(text: &str) -> Result<(), CliError> {
    let mut out = io::stdout().lock();
    write!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(|e| CliError::context("cannot write to stdout", e))
}
