//! Checkpoint files on disk (native only): refusing what is not a regular file before it
//! is opened, and `Checkpoint::open`, which reads the headers now and a file's data when a
//! tensor of it is first asked for (never memory-mapped: see `FileBytes::OnDisk`).

use std::path::Path;

use super::{
    Checkpoint, CheckpointError, CheckpointLayout, FileBytes, FileHeader, MAX_INDEX_BYTES,
    ShardIndex,
};

/// Refuses a path that is not a regular file, before anything opens it: opening a FIFO
/// blocks until a writer comes (forever, for a stray `mkfifo model.safetensors`), and a
/// directory, socket or device is never a checkpoint file. `metadata` follows symlinks, so
/// the Hugging Face cache's snapshot files, links to blobs elsewhere, are judged by the blob.
/// The file could still be swapped between this check and the open; that needs someone
/// racing the loader on purpose, which is not the mistake this guards against. Returns the
/// file's metadata: its length bounds what a caller reads whole.
pub fn require_regular_file(path: &Path) -> Result<std::fs::Metadata, CheckpointError> {
    let meta = std::fs::metadata(path).map_err(|source| {
        // A dangling link reads "not found"; say what it is and where it points.
        let source = match crate::small_files::exists(path) {
            Err(why) => std::io::Error::new(source.kind(), why),
            Ok(_) => source,
        };
        CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        }
    })?;
    let file_type = meta.file_type();
    if file_type.is_file() {
        return Ok(meta);
    }
    Err(CheckpointError::NotRegularFile {
        path: path.to_path_buf(),
        kind: file_kind(&file_type),
    })
}

/// What a path that is not a regular file is, for `CheckpointError::NotRegularFile`.
fn file_kind(file_type: &std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        return "directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_fifo() {
            return "FIFO (named pipe)";
        }
        if file_type.is_socket() {
            return "socket";
        }
        if file_type.is_block_device() {
            return "block device";
        }
        if file_type.is_char_device() {
            return "character device";
        }
    }
    "special file"
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` and its shards, or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single_path = dir.join("model.safetensors");
        let present = |path: &Path| {
            crate::small_files::exists(path).map_err(|message| CheckpointError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, message),
            })
        };
        if present(&index_path)? {
            let len = require_regular_file(&index_path)?.len();
            if len > MAX_INDEX_BYTES {
                return Err(CheckpointError::Index {
                    path: index_path,
                    message: format!(
                        "the file is {len} bytes, expected at most {MAX_INDEX_BYTES} (an index \
                         lists tensor names only)"
                    ),
                });
            }
            let text =
                std::fs::read_to_string(&index_path).map_err(|source| CheckpointError::Io {
                    path: index_path.clone(),
                    source,
                })?;
            let index = ShardIndex::parse(&index_path, &text)?;
            let mut headers = Vec::new();
            let mut bytes = Vec::new();
            for shard in &index.shards {
                let (h, b) = Self::map_file(&dir.join(shard))?;
                headers.push(h);
                bytes.push(b);
            }
            Ok(Self {
                layout: CheckpointLayout::sharded(dir, &index, headers)?,
                bytes,
            })
        } else if present(&single_path)? {
            let (h, b) = Self::map_file(&single_path)?;
            Ok(Self {
                layout: CheckpointLayout::single(dir, h),
                bytes: vec![b],
            })
        } else {
            Err(CheckpointError::NotFound {
                dir: dir.to_path_buf(),
            })
        }
    }

    /// A file's header (read now) and its data (read when first used).
    fn map_file(path: &Path) -> Result<(FileHeader, FileBytes), CheckpointError> {
        use std::io::Read;
        let len = require_regular_file(path)?.len();
        let io = |source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(io)?;
        let mut first8 = Vec::with_capacity(8);
        (&mut file).take(8).read_to_end(&mut first8).map_err(io)?;
        let header_len = FileHeader::header_len(path, &first8)?;
        let mut head = first8;
        (&mut file)
            .take(header_len.saturating_sub(8) as u64)
            .read_to_end(&mut head)
            .map_err(io)?;
        let header = FileHeader::parse(path, &head, Some(len))?;
        Ok((
            header,
            FileBytes::OnDisk {
                path: path.to_path_buf(),
                len,
                bytes: std::sync::OnceLock::new(),
            },
        ))
    }
}

/// The whole of a checkpoint file whose header was validated at length `len`: an error
/// naming both lengths when the file is now shorter or longer (cut or rewritten while in
/// use), never a crash.
pub(super) fn read_whole(path: &Path, len: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read it again: {e}"))?;
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(len.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read it again: {e}"))?;
    if bytes.len() as u64 != len {
        return Err(format!(
            "the file is now {} bytes, but its header was read when it had {len}: it changed \
             while in use (truncated or rewritten?)",
            bytes.len()
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Span;
    use crate::checkpoint::tests::fixture_dir;
    use std::path::PathBuf;

    /// A fresh, empty folder for one test.
    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("unmask-core-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// `Checkpoint::open` on another thread, so that a regression which blocks in `open()`
    /// fails the test instead of hanging the test run.
    fn open_with_deadline(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let dir = dir.to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(Checkpoint::open(&dir));
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("Checkpoint::open blocked for 20 s: it opened a path that is not a file")
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_is_refused_before_it_is_opened() {
        let dir = scratch("fifo");
        let fifo = dir.join("model.safetensors");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo runs");
        assert!(status.success(), "mkfifo {}", fifo.display());
        let err = open_with_deadline(&dir)
            .err()
            .expect("a FIFO is no checkpoint");
        assert!(
            matches!(&err, CheckpointError::NotRegularFile { kind, .. } if kind.contains("FIFO")),
            "{err}"
        );
        let message = err.to_string();
        assert!(message.contains("model.safetensors") && message.contains("not a regular file"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_directory_named_like_a_checkpoint_is_named_as_one() {
        let dir = scratch("dir");
        std::fs::create_dir(dir.join("model.safetensors.index.json")).unwrap();
        let err = open_with_deadline(&dir)
            .err()
            .expect("a directory is no index");
        assert!(
            matches!(&err, CheckpointError::NotRegularFile { kind: "directory", path }
                if path.ends_with("model.safetensors.index.json")),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The Hugging Face cache's layout: every file of a snapshot is a symlink to a blob.
    #[cfg(unix)]
    #[test]
    fn symlinks_to_checkpoint_files_open() {
        let dir = scratch("symlinks");
        let fixture = fixture_dir().canonicalize().unwrap();
        for name in [
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ] {
            std::os::unix::fs::symlink(fixture.join(name), dir.join(name)).unwrap();
        }
        let linked = open_with_deadline(&dir).expect("symlinked checkpoint opens");
        let direct = Checkpoint::open(&fixture).unwrap();
        assert_eq!(linked.names().count(), direct.names().count());
        assert_eq!(linked.data_bytes(), direct.data_bytes());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_oversized_index_is_refused_before_it_is_read() {
        let dir = scratch("bigindex");
        let index = std::fs::File::create(dir.join("model.safetensors.index.json")).unwrap();
        // Sparse: the size is what is checked, no byte is written or read.
        index.set_len(MAX_INDEX_BYTES + 1).unwrap();
        let err = open_with_deadline(&dir).err().expect("too large");
        assert!(
            matches!(&err, CheckpointError::Index { message, .. } if message.contains("at most")),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `info` and `quantize` open checkpoints this way: a shard cut short after `open` (an
    /// in-place copy over it) is a named error when its tensors are read, never SIGBUS.
    #[test]
    fn a_checkpoint_cut_while_open_is_a_named_error() {
        let dir = scratch("cut");
        let fixture = fixture_dir();
        for name in [
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ] {
            std::fs::copy(fixture.join(name), dir.join(name)).unwrap();
        }
        let ckpt = open_with_deadline(&dir).expect("opens");
        let shard = dir.join("model-00002-of-00002.safetensors");
        let full = std::fs::metadata(&shard).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&shard)
            .unwrap()
            .set_len(full / 2)
            .unwrap();
        let mut errors = Vec::new();
        for span in ckpt
            .layout()
            .files
            .iter()
            .enumerate()
            .map(|(file, h)| Span {
                file,
                bytes: h.data_start..h.data_start + 1,
            })
        {
            if let Err(e) = ckpt.span_bytes(&span) {
                errors.push(e.to_string());
            }
        }
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("model-00002-of-00002.safetensors")
                && errors[0].contains(&format!("now {} bytes", full / 2))
                && errors[0].contains(&full.to_string()),
            "{}",
            errors[0]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
