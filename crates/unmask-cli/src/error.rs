//! The CLI's error: a usage error (exit code 2) or a runtime error (exit code 1), with the
//! chain of underlying errors printed below the message.

use std::error::Error;
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The command line is wrong: exit code 2.
    Usage,
    /// The command was valid but failed: exit code 1.
    Runtime,
}

#[derive(Debug)]
pub struct CliError {
    pub kind: ErrorKind,
    pub message: String,
    pub source: Option<Box<dyn Error>>,
}

impl CliError {
    pub fn usage(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Usage,
            message: message.into(),
            source: None,
        }
    }

    pub fn runtime(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Runtime,
            message: message.into(),
            source: None,
        }
    }

    /// A runtime error that says what was being done, caused by `source`.
    pub fn context(message: impl Into<String>, source: impl Error + 'static) -> Self {
        Self {
            kind: ErrorKind::Runtime,
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }

    pub fn exit_code(&self) -> i32 {
        match self.kind {
            ErrorKind::Usage => 2,
            ErrorKind::Runtime => 1,
        }
    }

    /// `error: <message>` followed by one `caused by:` line per underlying error whose text
    /// is not already part of what was printed (many errors embed their source's text).
    pub fn report(&self) -> String {
        let mut out = format!("error: {}", self.message);
        let mut printed = self.message.clone();
        let mut next: Option<&dyn Error> = self.source.as_deref();
        while let Some(err) = next {
            let text = err.to_string();
            if !text.is_empty() && !printed.contains(&text) {
                out.push_str(&format!("\n  caused by: {text}"));
                printed.push('\n');
                printed.push_str(&text);
            }
            next = err.source();
        }
        out
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<unmask::EngineError> for CliError {
    fn from(e: unmask::EngineError) -> Self {
        from_error(e)
    }
}

impl From<unmask_gpu::GpuError> for CliError {
    fn from(e: unmask_gpu::GpuError) -> Self {
        from_error(e)
    }
}

impl From<unmask_gpu::model::ModelError> for CliError {
    fn from(e: unmask_gpu::model::ModelError) -> Self {
        from_error(e)
    }
}

impl From<unmask_core::error::TokenizerError> for CliError {
    fn from(e: unmask_core::error::TokenizerError) -> Self {
        from_error(e)
    }
}

/// A runtime error whose message is `e`'s own text and whose chain is `e`'s sources.
fn from_error(e: impl Error + 'static) -> CliError {
    CliError {
        kind: ErrorKind::Runtime,
        message: e.to_string(),
        source: Some(Box::new(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Leaf;
    impl fmt::Display for Leaf {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("disk full")
        }
    }
    impl Error for Leaf {}

    #[test]
    fn chain_is_printed_once() {
        let e = CliError::context("cannot write out.npy", Leaf);
        assert_eq!(
            e.report(),
            "error: cannot write out.npy\n  caused by: disk full"
        );
        let e = CliError::context("cannot write out.npy: disk full", Leaf);
        assert_eq!(e.report(), "error: cannot write out.npy: disk full");
        assert_eq!(CliError::usage("x").exit_code(), 2);
        assert_eq!(CliError::runtime("x").exit_code(), 1);
    }
}
