//! The `unmask` binary end to end on the tiny fixture model: generation (ids and text,
//! JSON and plain, every cache mode), logits as .npy against the golden logits, piped chat,
//! eval over a small task set, BiCache's flags and reports, profiling, info, selfcheck,
//! quantized copies of a model, and the exit codes and messages of bad command lines.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

mod bicache;
mod chat;
mod dgemma;
mod errors;
mod eval;
mod generate;
mod info;
mod profile;
mod quantize;
mod score;
mod serve;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture() -> String {
    workspace()
        .join("tests/fixtures/tiny")
        .display()
        .to_string()
}

fn unmask() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_unmask"));
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        let dir = std::env::temp_dir().join("unmask-cli-tests-xdg");
        std::fs::create_dir_all(&dir).expect("create XDG_RUNTIME_DIR");
        cmd.env("XDG_RUNTIME_DIR", dir);
    }
    cmd
}

fn run(args: &[&str]) -> Output {
    unmask().args(args).output().expect("run unmask")
}

fn run_with_stdin(args: &[&str], stdin: &str) -> Output {
    let mut child = unmask()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn unmask");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("wait for unmask")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_ok(o: &Output) {
    assert!(
        o.status.success(),
        "unmask failed with {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        stdout(o),
        stderr(o)
    );
}

/// Exits with `code`, prints `error: ...` naming `needle`, and does not panic.
fn assert_fails(args: &[&str], code: i32, needle: &str) {
    let o = run(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(code), "{args:?}\nstderr:\n{err}");
    assert!(
        err.contains("error: "),
        "{args:?}: no `error:` line in\n{err}"
    );
    assert!(err.contains(needle), "{args:?}: `{needle}` not in\n{err}");
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
}

fn json(o: &Output) -> Value {
    serde_json::from_str(stdout(o).trim())
        .unwrap_or_else(|e| panic!("bad JSON ({e}):\n{}", stdout(o)))
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("integer"))
        .collect()
}

/// `a` followed by `b`.
fn joined<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    [a, b].concat()
}

/// The four-item task set of the tests: one item of every task type.
fn tiny_set() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tiny-set.jsonl")
        .display()
        .to_string()
}

/// A path in the temporary folder, unique to this test process.
fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("unmask-cli-{}-{name}", std::process::id()))
}

fn f64_of(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}
