//! `unmask score --text-file`: each file's text scored as it is (`Engine::log_likelihood_rolling`:
//! rolling windows when it is longer than the model's positions), and the perplexities its
//! bound gives, as lm-evaluation-harness reports them for perplexity tasks.

use std::f64::consts::LN_2;
use std::path::PathBuf;

use serde_json::{Value, json};
use unmask::{Engine, Likelihood, LikelihoodParams};

use crate::error::CliError;
use crate::output;

/// A text's estimate and what it was measured over.
struct Scored {
    file: String,
    tokens: usize,
    bytes: usize,
    words: usize,
    likelihood: Likelihood,
}

impl Scored {
    /// The bound's nats (minus the estimate) per `n` units of the text.
    fn nats_per(&self, n: usize) -> f64 {
        -self.likelihood.log_likelihood / n.max(1) as f64
    }

    /// Per-token and per-word perplexity and bits per byte of the bound.
    fn json(&self) -> Value {
        let per = |n: usize| self.nats_per(n);
        json!({
            "file": self.file,
            "log_likelihood": self.likelihood.log_likelihood,
            "standard_error": self.likelihood.standard_error,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "words": self.words,
            "windows": self.likelihood.windows,
            "token_perplexity": per(self.tokens).exp(),
            "word_perplexity": per(self.words).exp(),
            "bits_per_byte": per(self.bytes) / LN_2,
            "forward_passes": self.likelihood.forward_passes,
            "total_s": self.likelihood.total_s,
        })
    }
}

pub fn run(
    engine: &Engine,
    files: &[PathBuf],
    prompt: &[u32],
    params: &LikelihoodParams,
    json_out: bool,
) -> Result<(), CliError> {
    let mut scored = Vec::with_capacity(files.len());
    for path in files {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::context(format!("cannot read --text-file {file}"), e))?;
        if text.trim().is_empty() {
            return Err(CliError::usage(format!(
                "--text-file {file}: expected text to score, found an empty file"
            )));
        }
        let ids = engine.encode_text(&text)?;
        let likelihood = engine.log_likelihood_rolling(prompt, &ids, params)?;
        let s = Scored {
            file,
            tokens: ids.len(),
            bytes: text.len(),
            words: text.split_whitespace().count(),
            likelihood,
        };
        eprintln!(
            "[score] {}: {:.2} ± {:.2} nats over {} tokens in {} window(s) ({} passes, {:.2} s)",
            s.file,
            s.likelihood.log_likelihood,
            s.likelihood.standard_error,
            s.tokens,
            s.likelihood.windows,
            s.likelihood.forward_passes,
            s.likelihood.total_s
        );
        if !json_out {
            output::line(&format!(
                "{:>12.2} nats  {:.3} nats/token  word perplexity {:.4e}  {:.3} bits/byte  {}",
                s.likelihood.log_likelihood,
                s.nats_per(s.tokens),
                s.nats_per(s.words).exp(),
                s.nats_per(s.bytes) / LN_2,
                s.file
            ))?;
        }
        scored.push(s.json());
    }
    if json_out {
        let mut v = super::json_header(engine, prompt, params);
        v["texts"] = json!(scored);
        output::line(&v.to_string())?;
    }
    Ok(())
}
