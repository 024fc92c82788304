//! Where a model's files come from. `Engine::load_from` reads them through `ModelFiles`: a
//! directory natively (`DirFiles`), bytes already in memory (`MemoryFiles`), a web server or
//! files a person picked in a browser (the `unmask-wasm` crate), or anything else that can
//! hand over bytes in order.

use std::collections::HashMap;
use std::path::Path;

use unmask_gpu::model::{FileHeader, ModelError};

use crate::EngineError;

/// The files of one model folder.
///
/// `async fn` in a public trait: implementations are used through generics only, and in a
/// browser their futures are not `Send` (they hold JavaScript objects).
#[allow(async_fn_in_trait)]
pub trait ModelFiles {
    /// How file `name` is named in messages (its path or URL); `""` names the folder.
    fn location(&self, name: &str) -> String;

    /// The whole of a small file (config, tokenizer, index, depth table); `None` when the
    /// folder has no such file.
    async fn read(&mut self, name: &str) -> Result<Option<Vec<u8>>, EngineError>;

    /// The first `len` bytes of a file (fewer when it is shorter) and its length when known.
    async fn read_head(
        &mut self,
        name: &str,
        len: usize,
    ) -> Result<(Vec<u8>, Option<u64>), EngineError>;

    /// Hands the bytes of a file from byte `start` to its end to `sink`, in order, in
    /// pieces of any size; stops at the first error `sink` returns.
    async fn stream(
        &mut self,
        name: &str,
        start: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError>;
}

/// A small file whole, within its size bound (`unmask_core::small_files`). `DirFiles`
/// checks the bound before reading; other sources (memory, a web server) are checked here.
pub(crate) async fn read_small<F: ModelFiles>(
    files: &mut F,
    name: &str,
) -> Result<Option<Vec<u8>>, EngineError> {
    let bytes = files.read(name).await?;
    if let Some(b) = &bytes {
        unmask_core::small_files::check_len(name, b.len() as u64).map_err(|message| {
            EngineError::File {
                location: files.location(name),
                message,
            }
        })?;
    }
    Ok(bytes)
}

/// A small file as UTF-8 text.
pub(crate) async fn read_text<F: ModelFiles>(
    files: &mut F,
    name: &str,
) -> Result<Option<String>, EngineError> {
    match read_small(files, name).await? {
        Some(bytes) => String::from_utf8(bytes)
            .map(Some)
            .map_err(|e| EngineError::File {
                location: files.location(name),
                message: e.to_string(),
            }),
        None => Ok(None),
    }
}

/// The header of safetensors file `name`: its first bytes, and more when the header is
/// longer than a first guess.
pub(crate) async fn read_header<F: ModelFiles>(
    files: &mut F,
    name: &str,
) -> Result<FileHeader, EngineError> {
    // Headers of published checkpoints are a few KiB to a few hundred KiB.
    const GUESS: usize = 256 << 10;
    let path = files.location(name);
    let path = Path::new(&path);
    let (mut head, file_len) = files.read_head(name, GUESS).await?;
    let len = FileHeader::header_len(path, &head).map_err(ModelError::from)?;
    if head.len() < len {
        head = files.read_head(name, len).await?.0;
    }
    Ok(FileHeader::parse(path, &head, file_len).map_err(ModelError::from)?)
}

/// The files of a directory, read in pieces. Not memory-mapped: a file truncated while it
/// loads (an in-place copy over it) then ends the read early with a named error instead
/// of killing the process with SIGBUS.
#[cfg(not(target_arch = "wasm32"))]
pub struct DirFiles {
    dir: std::path::PathBuf,
}

#[cfg(not(target_arch = "wasm32"))]
impl DirFiles {
    pub fn new(dir: impl AsRef<Path>) -> Self {
        Self {
            dir: dir.as_ref().to_path_buf(),
        }
    }

    /// The files of `dir`, which must be a folder (a model's text side is read from one).
    pub fn folder(dir: &Path) -> Result<Self, EngineError> {
        if !dir.is_dir() {
            return Err(EngineError::File {
                location: dir.display().to_string(),
                message: "expected a model folder (config.json, tokenizer.json), found no folder"
                    .into(),
            });
        }
        Ok(Self::new(dir))
    }

    fn error(&self, name: &str, e: std::io::Error) -> EngineError {
        EngineError::File {
            location: self.location(name),
            message: e.to_string(),
        }
    }

    /// Opens a regular file (symlinks followed, as the Hugging Face cache links snapshot
    /// files to blobs); anything else is refused before `open`, which on a FIFO would wait
    /// for a writer forever.
    fn open(&self, name: &str) -> Result<std::fs::File, EngineError> {
        let path = self.dir.join(name);
        unmask_core::checkpoint::require_regular_file(&path).map_err(|e| match e {
            unmask_gpu::model::CheckpointError::NotRegularFile { kind, .. } => EngineError::File {
                location: self.location(name),
                message: format!("expected a regular file, found a {kind}"),
            },
            unmask_gpu::model::CheckpointError::Io { source, .. } => EngineError::File {
                location: self.location(name),
                message: unmask_core::small_files::exists(&path)
                    .err()
                    .unwrap_or_else(|| source.to_string()),
            },
            other => EngineError::File {
                location: self.location(name),
                message: other.to_string(),
            },
        })?;
        std::fs::File::open(&path).map_err(|e| self.error(name, e))
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl ModelFiles for DirFiles {
    fn location(&self, name: &str) -> String {
        // The folder itself as given (joining "" would add a trailing separator).
        if name.is_empty() {
            return self.dir.display().to_string();
        }
        self.dir.join(name).display().to_string()
    }

    async fn read(&mut self, name: &str) -> Result<Option<Vec<u8>>, EngineError> {
        let path = self.dir.join(name);
        let error = |message| EngineError::File {
            location: self.location(name),
            message,
        };
        // A broken symbolic link is an error, not a missing file.
        if !unmask_core::small_files::exists(&path).map_err(error)? {
            return Ok(None);
        }
        // Small files only (config, tokenizer, index, depth table): each within its bound,
        // so a wrong file (or a device) cannot fill memory.
        unmask_core::small_files::read(&path)
            .map(Some)
            .map_err(error)
    }

    async fn read_head(
        &mut self,
        name: &str,
        len: usize,
    ) -> Result<(Vec<u8>, Option<u64>), EngineError> {
        use std::io::Read;
        let file = self.open(name)?;
        let file_len = file.metadata().map_err(|e| self.error(name, e))?.len();
        let mut head = Vec::with_capacity(len.min(file_len as usize));
        file.take(len as u64)
            .read_to_end(&mut head)
            .map_err(|e| self.error(name, e))?;
        Ok((head, Some(file_len)))
    }

    async fn stream(
        &mut self,
        name: &str,
        start: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        use std::io::{Read, Seek, SeekFrom};
        let mut file = self.open(name)?;
        file.seek(SeekFrom::Start(start))
            .map_err(|e| self.error(name, e))?;
        // Pieces large enough that the GPU upload, not the read, sets the pace.
        let mut piece = vec![0u8; 16 << 20];
        loop {
            let n = match file.read(&mut piece) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.error(name, e)),
            };
            sink(&piece[..n])?;
        }
    }
}

/// Files held in memory (tests, and pages that already have the bytes), streamed in
/// pieces of `piece` bytes as a download would arrive.
pub struct MemoryFiles {
    files: HashMap<String, Vec<u8>>,
    piece: usize,
    lengths: bool,
    withheld: usize,
}

impl MemoryFiles {
    pub fn new(files: impl IntoIterator<Item = (String, Vec<u8>)>, piece: usize) -> Self {
        Self {
            files: files.into_iter().collect(),
            piece: piece.max(1),
            lengths: true,
            withheld: 0,
        }
    }

    /// Reports no file lengths, as a server that sends none: a load then relies on the
    /// stream's end to find a short file.
    pub fn without_lengths(mut self) -> Self {
        self.lengths = false;
        self
    }

    /// Ends every stream `bytes` before the end of its file, as a cut-off download does.
    pub fn withholding(mut self, bytes: usize) -> Self {
        self.withheld = bytes;
        self
    }

    fn file(&self, name: &str) -> Result<&[u8], EngineError> {
        self.files
            .get(name)
            .map(Vec::as_slice)
            .ok_or_else(|| EngineError::File {
                location: name.to_string(),
                message: "not found".into(),
            })
    }
}

impl ModelFiles for MemoryFiles {
    fn location(&self, name: &str) -> String {
        name.to_string()
    }

    async fn read(&mut self, name: &str) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(self.files.get(name).cloned())
    }

    async fn read_head(
        &mut self,
        name: &str,
        len: usize,
    ) -> Result<(Vec<u8>, Option<u64>), EngineError> {
        let f = self.file(name)?;
        let length = self.lengths.then_some(f.len() as u64);
        Ok((f[..len.min(f.len())].to_vec(), length))
    }

    async fn stream(
        &mut self,
        name: &str,
        start: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let f = self.file(name)?;
        let end = f.len().saturating_sub(self.withheld);
        for piece in f[(start as usize).min(end)..end].chunks(self.piece) {
            sink(piece)?;
        }
        Ok(())
    }
}
