//! The small JSON files of a model folder (config, generation config, tokenizer, index,
//! depth table): bounds on their size, checked before they are read, and how they are read
//! natively.
//!
//! Each is parsed whole into a tree, which costs several times its size in memory: a 600 MB
//! "config.json" used to take gigabytes before any error. Real files are far below these
//! bounds (a config is a few kilobytes, the largest published tokenizers some tens of
//! megabytes), so a file past them is the wrong file and is refused by name.

/// The most bytes a file may have, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    pub bytes: u64,
    pub why: &'static str,
}

const MIB: u64 = 1 << 20;

/// The bound of the file named `name` (its last path component decides).
pub fn bound(name: &str) -> Bound {
    let file = name.rsplit(['/', '\\']).next().unwrap_or(name);
    match file {
        "config.json" | "generation_config.json" => Bound {
            bytes: MIB,
            why: "1 MiB: a model's config is a few kilobytes",
        },
        "tokenizer.json" => Bound {
            bytes: 64 * MIB,
            why: "64 MiB: published tokenizers are at most some tens of megabytes",
        },
        "tokenizer_config.json" => Bound {
            bytes: 16 * MIB,
            why: "16 MiB: a tokenizer config holds a chat template and token names",
        },
        "model.safetensors.index.json" => Bound {
            bytes: crate::checkpoint::MAX_INDEX_BYTES,
            why: "64 MiB: an index lists tensor names only",
        },
        _ => Bound {
            bytes: MIB,
            why: "1 MiB: a small JSON file of the model folder",
        },
    }
}

/// Refuses a length past the bound of `name`: the message names the limit and the size.
pub fn check_len(name: &str, len: u64) -> Result<(), String> {
    let b = bound(name);
    if len > b.bytes {
        return Err(format!(
            "the file is {len} bytes, expected at most {} bytes ({})",
            b.bytes, b.why
        ));
    }
    Ok(())
}

/// Whether `path` names something, telling a broken symbolic link (an error naming its
/// target) apart from a file that is not there: a model folder whose tokenizer.json is a
/// dangling link (a Hugging Face snapshot whose blob was removed) must not load as if it
/// had no tokenizer. (In a browser there are no files: every call is an error there.)
pub fn exists(path: &std::path::Path) -> Result<bool, String> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e.to_string()),
        Ok(meta) if meta.file_type().is_symlink() => match std::fs::metadata(path) {
            Ok(_) => Ok(true),
            Err(e) => Err(broken_link(path, &e)),
        },
        Ok(_) => Ok(true),
    }
}

/// The message for a symbolic link whose target cannot be reached.
pub fn broken_link(path: &std::path::Path, e: &std::io::Error) -> String {
    let target = std::fs::read_link(path)
        .map(|t| t.display().to_string())
        .unwrap_or_else(|_| "?".into());
    format!("a broken symbolic link (to {target}: {e})")
}

/// Reads a small file whole: a regular file only (a FIFO would block forever), within its
/// bound (checked on the length first, and again while reading, for a file that grows).
pub fn read(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let name = path.to_string_lossy();
    #[cfg(target_arch = "wasm32")]
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    #[cfg(not(target_arch = "wasm32"))]
    let meta = crate::checkpoint::require_regular_file(path).map_err(|e| match e {
        crate::checkpoint::CheckpointError::NotRegularFile { kind, .. } => {
            format!("expected a regular file, found a {kind}")
        }
        crate::checkpoint::CheckpointError::Io { source, .. } => match exists(path) {
            Err(why) => why,
            Ok(_) => source.to_string(),
        },
        other => other.to_string(),
    })?;
    check_len(&name, meta.len())?;
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let limit = bound(&name).bytes;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > limit {
        return check_len(&name, bytes.len() as u64).map(|_| Vec::new());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_follow_the_file_name() {
        assert_eq!(bound("/m/config.json").bytes, 1 << 20);
        assert_eq!(bound("tokenizer.json").bytes, 64 << 20);
        let err = check_len("x/generation_config.json", (1 << 20) + 1).unwrap_err();
        assert!(
            err.contains("1048577 bytes") && err.contains("at most 1048576"),
            "{err}"
        );
        assert!(check_len("config.json", 1 << 20).is_ok());
    }

    #[cfg(unix)]
    #[test]
    fn oversized_and_broken_files_are_named_before_reading() {
        let dir = std::env::temp_dir().join(format!("unmask-small-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let big = dir.join("config.json");
        // Sparse: the length is what is checked, nothing is read.
        std::fs::File::create(&big)
            .unwrap()
            .set_len(600 << 20)
            .unwrap();
        let err = read(&big).unwrap_err();
        assert!(
            err.contains("629145600 bytes") && err.contains("at most 1048576"),
            "{err}"
        );
        let link = dir.join("tokenizer.json");
        std::os::unix::fs::symlink(dir.join("gone.json"), &link).unwrap();
        for err in [exists(&link).unwrap_err(), read(&link).unwrap_err()] {
            assert!(
                err.contains("broken symbolic link") && err.contains("gone.json"),
                "{err}"
            );
        }
        assert_eq!(exists(&dir.join("absent.json")), Ok(false));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
