//! Where `unmask bench` writes its records.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::CliError;

/// Where records go: a file or standard output, one JSON object per line, flushed per
/// record so a long run can be watched and a killed one keeps what it measured.
pub(super) struct Sink {
    out: Box<dyn Write>,
    path: Option<PathBuf>,
}

impl Sink {
    pub(super) fn open(path: Option<&Path>) -> Result<Self, CliError> {
        match path {
            None => Ok(Self {
                out: Box::new(std::io::stdout()),
                path: None,
            }),
            Some(path) => {
                if let Some(parent) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(parent).map_err(|e| {
                        CliError::context(format!("cannot create {}", parent.display()), e)
                    })?;
                }
                let file = File::create(path).map_err(|e| {
                    CliError::context(format!("cannot create {}", path.display()), e)
                })?;
                Ok(Self {
                    out: Box::new(BufWriter::new(file)),
                    path: Some(path.to_path_buf()),
                })
            }
        }
    }

    pub(super) fn write(&mut self, record: &Value) -> Result<(), CliError> {
        let where_ = || {
            self.path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "standard output".into())
        };
        writeln!(self.out, "{record}")
            .and_then(|()| self.out.flush())
            .map_err(|e| CliError::context(format!("cannot write {}", where_()), e))
    }
}
