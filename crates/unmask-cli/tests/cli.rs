//! The `unmask` binary end to end on the tiny fixture model: generation (ids and text,
//! JSON and plain, every cache mode), logits as .npy against the golden logits, piped chat,
//! eval over a small task set, BiCache's flags and reports, profiling, info, selfcheck,
//! quantized copies of a model, and the exit codes and messages of bad command lines.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

mod serve;

const MASK: u64 = 305;
const BOS: u64 = 300;
const VOCAB: usize = 320;

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

/// The answer's part of a `--json` generation: the canvas up to its first end token. A
/// request that finished early (the default) may leave masks after it, never before.
fn answer_part(v: &Value) -> Vec<u64> {
    let ids = u64s(&v["ids"]);
    let end = v["timings"]["answer_tokens"]
        .as_u64()
        .expect("answer_tokens") as usize;
    if v["timings"]["finished_early"] == true {
        assert!(v["timings"]["steps_skipped"].as_u64().is_some());
    }
    ids[..end.min(ids.len())].to_vec()
}

#[test]
fn generate_from_ids_prints_one_json_object() {
    let fix = fixture();
    let o = run(&[
        "generate",
        "--model",
        &fix,
        "--prompt-ids",
        "1,2,3",
        "--gen-length",
        "16",
        "--full-canvas",
        "--json",
    ]);
    assert_ok(&o);
    let v = json(&o);
    assert_eq!(u64s(&v["prompt_ids"]), [1, 2, 3]);
    let ids = u64s(&v["ids"]);
    assert_eq!(ids.len(), 16);
    assert!(!answer_part(&v).contains(&MASK), "mask left in {ids:?}");
    assert!(ids.iter().all(|&id| (id as usize) < VOCAB));
    assert!(v["adapter"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(v["model"].as_str().is_some_and(|s| s.contains("tiny")));
    assert_eq!(v["mask_id"], MASK);

    // gen-length 16 < 32: one block of 16 steps, one token per step, every position once.
    let steps = v["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 16);
    let mut positions: Vec<u64> = steps.iter().flat_map(|s| u64s(&s["positions"])).collect();
    positions.sort_unstable();
    assert_eq!(positions, (3..19).collect::<Vec<u64>>());
    for s in steps {
        assert_eq!(s["block"], 0);
        let (p, t) = (u64s(&s["positions"]), u64s(&s["tokens"]));
        assert_eq!(p.len(), t.len());
        for (pos, tok) in p.iter().zip(&t) {
            assert_eq!(ids[*pos as usize - 3], *tok);
        }
    }
    let t = &v["timings"];
    assert_eq!(t["steps"], 16);
    assert_eq!(t["forward_passes"], 16);
    for key in ["setup_s", "first_step_s", "total_s", "tokens_per_s"] {
        assert!(
            t[key].as_f64().is_some_and(|x| x >= 0.0),
            "timings.{key}: {t}"
        );
    }

    // Without --json (stdout is not a terminal): the same ids, comma-separated.
    let o = run(&[
        "generate",
        "--model",
        &fix,
        "--prompt-ids",
        "1,2,3",
        "--gen-length",
        "16",
        "--full-canvas",
    ]);
    assert_ok(&o);
    let plain: Vec<u64> = stdout(&o)
        .trim()
        .split(',')
        .map(|s| s.parse().expect("id"))
        .collect();
    assert_eq!(plain, ids, "temperature 0 is deterministic");
}

#[test]
fn generate_from_text_uses_the_chat_template() {
    let fix = fixture();
    let o = run(&[
        "generate",
        "--model",
        &fix,
        "--prompt",
        "Hello there",
        "--system",
        "Be brief.",
        "--gen-length",
        "8",
        "--steps",
        "4",
        "--json",
    ]);
    assert_ok(&o);
    let v = json(&o);
    let prompt = u64s(&v["prompt_ids"]);
    assert_eq!(prompt[0], BOS);
    assert_eq!(
        prompt.iter().filter(|&&t| t == 302).count(),
        3,
        "system, user, assistant headers"
    );
    let ids = u64s(&v["ids"]);
    assert_eq!(ids.len(), 8);
    assert!(!ids.contains(&MASK));
    assert_eq!(v["steps"].as_array().map(Vec::len), Some(4));
    assert!(v["text"].is_string());

    let o = run(&[
        "generate",
        "--model",
        &fix,
        "--prompt",
        "Hello",
        "--gen-length",
        "8",
    ]);
    assert_ok(&o);
    assert!(stdout(&o).ends_with('\n'));
}

#[test]
fn generate_defaults_to_the_fixture_and_two_blocks() {
    // From the workspace root without --model: models/tiny if present, else the fixture.
    let o = unmask()
        .current_dir(workspace())
        .args(["generate", "--prompt-ids", "5,6", "--json"])
        .output()
        .expect("run unmask");
    assert_ok(&o);
    assert!(stderr(&o).contains("model: "), "{}", stderr(&o));
    let v = json(&o);
    let ids = u64s(&v["ids"]);
    assert_eq!(ids.len(), 64);
    let mask = v["mask_id"].as_u64().expect("mask_id");
    assert!(!answer_part(&v).contains(&mask));
    assert_eq!(v["params"]["block_length"], 32);
    assert_eq!(v["params"]["steps"], 64);
    let blocks: Vec<u64> = v["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| s["block"].as_u64().expect("block"))
        .collect();
    // 32 steps a block, fewer in the last one run when the answer was final early.
    let skipped = v["timings"]["steps_skipped"]
        .as_u64()
        .expect("steps_skipped");
    assert_eq!(blocks.len() as u64 + skipped, 64);
    assert!(blocks.iter().all(|&b| b <= 1));
}

#[test]
fn logits_writes_npy_matching_the_goldens() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(workspace().join("tests/fixtures/tiny/goldens/logits.json"))
            .expect("goldens"),
    )
    .expect("golden JSON");
    let case = &golden["cases"][0];
    let ids = u64s(&case["ids"]);
    let ids_arg = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = std::env::temp_dir().join(format!("unmask-cli-logits-{}.npy", std::process::id()));
    let out_arg = out.display().to_string();
    let o = run(&[
        "logits",
        "--model",
        &fixture(),
        "--prompt-ids",
        &ids_arg,
        "--dtype",
        "f32",
        "--out",
        &out_arg,
    ]);
    assert_ok(&o);
    let bytes = std::fs::read(&out).expect("read .npy");
    let _ = std::fs::remove_file(&out);

    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    assert_eq!((10 + header_len) % 64, 0, "data aligned to 64 bytes");
    let npy = npyz::NpyFile::new(&bytes[..]).expect("a .npy file");
    let t = ids.len();
    assert_eq!(bytes.len(), 10 + header_len + t * VOCAB * 4);
    assert_eq!(npy.shape(), [t as u64, VOCAB as u64]);
    assert_eq!(
        npy.dtype(),
        npyz::DType::Plain("<f4".parse().expect("dtype"))
    );
    let got: Vec<f32> = npy.into_vec().expect("f32 data");
    let want: Vec<f64> = case["logits_f32"]
        .as_array()
        .expect("rows")
        .iter()
        .flat_map(|row| {
            row.as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_f64().expect("f64"))
        })
        .collect();
    assert_eq!(got.len(), want.len());
    let max_err = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (f64::from(*g) - w).abs())
        .fold(0.0, f64::max);
    eprintln!("[logits] max |error| vs golden f32 logits: {max_err:.2e} (tolerance 1e-3)");
    assert!(max_err < 1e-3, "max error {max_err}");
}

#[test]
fn chat_answers_every_piped_line() {
    let fix = fixture();
    let args = ["chat", "--model", &fix, "--gen-length", "8", "--json"];
    let o = run_with_stdin(&args, "Hello\nWhat is 2+3?\n");
    assert_ok(&o);
    let turns: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(turns.len(), 2, "{}", stdout(&o));
    assert_eq!(turns[0]["turn"], 1);
    assert_eq!(turns[1]["user"], "What is 2+3?");
    for t in &turns {
        assert_eq!(u64s(&t["ids"]).len(), 8);
        assert!(t["text"].is_string());
    }
    // The second prompt holds the first exchange: its user turn, the answer and headers.
    let (p1, p2) = (
        turns[0]["prompt_tokens"].as_u64().expect("n"),
        turns[1]["prompt_tokens"].as_u64().expect("n"),
    );
    assert!(p2 > p1 + 4, "history not carried: {p1} then {p2}");

    // /reset starts over: the same question gets the same prompt and answer.
    let o = run_with_stdin(&args, "Hi\n/reset\n\nHi\n/quit\nignored\n");
    assert_ok(&o);
    let turns: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(turns.len(), 2);
    assert_eq!(turns[0]["prompt_tokens"], turns[1]["prompt_tokens"]);
    assert_eq!(turns[0]["ids"], turns[1]["ids"]);

    // Plain text: one answer per turn.
    let o = run_with_stdin(
        &["chat", "--model", &fix, "--gen-length", "8"],
        "one\ntwo\n",
    );
    assert_ok(&o);
    assert!(!stdout(&o).trim_start().starts_with('{'));
}

#[test]
fn bad_command_lines_exit_2_and_name_the_flag() {
    let fix = fixture();
    let f = fix.as_str();
    assert_fails(&["generate", "--stepz", "3", "--prompt", "x"], 2, "--stepz");
    assert_fails(
        &["generate", "--prompt-ids", "1", "--gen-length", "abc"],
        2,
        "--gen-length",
    );
    assert_fails(&["generate", "--prompt-ids", "1,x"], 2, "--prompt-ids");
    assert_fails(&["generate", "--prompt"], 2, "--prompt");
    assert_fails(
        &["generate", "--prompt-ids", "1", "--temperature", "-1"],
        2,
        "--temperature",
    );
    assert_fails(
        &["generate", "--prompt-ids", "1", "--remasking", "best"],
        2,
        "--remasking",
    );
    assert_fails(
        &["generate", "--prompt-ids", "1", "--backend", "cuda"],
        2,
        "--backend",
    );
    assert_fails(
        &["generate", "--prompt-ids", "1", "--dtype", "bf16"],
        2,
        "--dtype",
    );
    assert_fails(
        &["generate", "--prompt-ids", "1", "--json=maybe"],
        2,
        "--json",
    );
    assert_fails(
        &[
            "generate",
            "--prompt-ids",
            "1",
            "--gen-length",
            "48",
            "--block-length",
            "32",
        ],
        2,
        "--block-length",
    );
    assert_fails(
        &["generate", "--prompt-ids", "1", "--steps", "3"],
        2,
        "--steps",
    );
    assert_fails(
        &["generate", "--prompt", "a", "--prompt-ids", "1"],
        2,
        "--prompt-ids",
    );
    assert_fails(&["generate"], 2, "--prompt");
    assert_fails(&["generate", "stray"], 2, "stray");
    assert_fails(&["logits", "--prompt-ids", "1"], 2, "--out");
    assert_fails(&["frobnicate"], 2, "frobnicate");
    assert_fails(&[], 2, "no command");
    // Checked against the model once it is loaded.
    assert_fails(
        &["generate", "--model", f, "--prompt-ids", "1,320"],
        2,
        "320",
    );
    assert_fails(
        &[
            "generate",
            "--model",
            f,
            "--prompt-ids",
            "1,2",
            "--gen-length",
            "300",
        ],
        2,
        "--gen-length",
    );
}

#[test]
fn missing_model_exits_1_with_the_path() {
    let missing = std::env::temp_dir().join("unmask-cli-no-such-model");
    let missing = missing.display().to_string();
    assert_fails(
        &["generate", "--model", &missing, "--prompt-ids", "1"],
        1,
        &missing,
    );
    assert_fails(
        &[
            "logits",
            "--model",
            &missing,
            "--prompt-ids",
            "1",
            "--out",
            "x.npy",
        ],
        1,
        &missing,
    );
    // A folder that is not a model names the file it lacks.
    let empty = std::env::temp_dir().join(format!("unmask-cli-empty-{}", std::process::id()));
    std::fs::create_dir_all(&empty).expect("mkdir");
    let empty_arg = empty.display().to_string();
    assert_fails(
        &["generate", "--model", &empty_arg, "--prompt-ids", "1"],
        1,
        "config.json",
    );
    let _ = std::fs::remove_dir(&empty);
}

#[test]
fn help_info_and_selfcheck() {
    let o = run(&["help"]);
    assert_ok(&o);
    for command in ["generate", "chat", "eval", "logits", "info", "selfcheck"] {
        assert!(stdout(&o).contains(command), "{}", stdout(&o));
    }
    for args in [["generate", "--help"], ["help", "generate"]] {
        let o = run(&args);
        assert_ok(&o);
        assert!(stdout(&o).contains("--gen-length <N>"), "{}", stdout(&o));
    }
    let o = run(&["completions", "bash"]);
    assert_ok(&o);
    assert!(stdout(&o).contains("--gen-length"), "{}", stdout(&o));
    assert_fails(&["completions", "tcsh"], 2, "tcsh");

    let o = run(&["info", "--model", &fixture()]);
    assert_ok(&o);
    let text = stdout(&o);
    for needle in [
        "adapter:",
        "limits:",
        "parameters:",
        "weights on the GPU:",
        "tokenizer: 306",
    ] {
        assert!(text.contains(needle), "`{needle}` not in\n{text}");
    }

    // DiffusionGemma: the family, its shape and the memory of its weights per format.
    let dgemma = workspace().join("tests/fixtures/tiny-dgemma");
    let o = run(&["info", "--model", &dgemma.display().to_string()]);
    assert_ok(&o);
    let text = stdout(&o);
    for needle in [
        "family: DiffusionGemma",
        "4 layers (2 sliding-window 8, 2 full)",
        "8 experts top 2",
        "canvas 16",
        "unmask generate, logits, eval and serve run it",
        "GPU memory of the weights (router f32): f16 ",
    ] {
        assert!(text.contains(needle), "`{needle}` not in\n{text}");
    }

    let o = run(&["selfcheck"]);
    assert_ok(&o);
    assert!(stdout(&o).contains("selfcheck passed"), "{}", stdout(&o));
}

/// The modes that are step plans of one request (no shared store).
const CACHE_MODES: [&str; 4] = ["none", "fast-dllm-prefix", "fast-dllm-dual", "prefix-arm"];

/// What `--cache all` runs.
const ALL_CACHE_MODES: [&str; 9] = [
    "none",
    "fast-dllm-prefix",
    "fast-dllm-dual",
    "prefix-arm",
    "bicache",
    "bicache-dual",
    "acache",
    "dllm-cache",
    "bicache-dllm",
];

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

#[test]
fn generate_combines_threshold_and_prefix_len_with_every_cache_mode() {
    let fix = fixture();
    let mut passes = Vec::new();
    for mode in CACHE_MODES {
        // Threshold decoding: two blocks of 8, each taking as many steps as it needs.
        let o = run(&[
            "generate",
            "--model",
            &fix,
            "--prompt",
            "Hi there",
            "--system",
            "Be brief.",
            "--gen-length",
            "16",
            "--block-length",
            "8",
            "--threshold",
            "0.5",
            "--cache",
            mode,
            "--json",
        ]);
        assert_ok(&o);
        let v = json(&o);
        assert_eq!(v["cache"], mode);
        let ids = u64s(&v["ids"]);
        assert_eq!(ids.len(), 16);
        assert!(
            !answer_part(&v).contains(&MASK),
            "{mode}: mask left in {ids:?}"
        );
        let prompt_len = u64s(&v["prompt_ids"]).len() as u64;
        let prefix = v["prefix_len"].as_u64().expect("prefix_len");
        assert!(prefix > 0 && prefix < prompt_len, "{mode}: prefix {prefix}");
        let t = &v["timings"];
        let steps = t["steps"].as_u64().expect("steps");
        assert!((2..=16).contains(&steps), "{mode}: {steps} steps");
        assert_eq!(v["steps"].as_array().map(Vec::len), Some(steps as usize));
        for key in [
            "token_layer_passes",
            "throughput_canvas",
            "throughput_answer",
            "answer_tokens",
        ] {
            assert!(
                t[key].as_f64().is_some_and(|x| x >= 0.0),
                "{mode}: {key} in {t}"
            );
        }
        assert!(t["answer_tokens"].as_u64().is_some_and(|n| n <= 16));

        // A fixed schedule, for comparable work: 16 steps over two blocks.
        let o = run(&[
            "generate",
            "--model",
            &fix,
            "--prompt-ids",
            "1,2,3,4,5,6",
            "--gen-length",
            "16",
            "--block-length",
            "8",
            "--cache",
            mode,
            "--prefix-len",
            "4",
            "--full-canvas",
            "--json",
        ]);
        assert_ok(&o);
        let v = json(&o);
        assert_eq!(v["prefix_len"], 4);
        assert_eq!(v["timings"]["steps"], 16);
        passes.push(v["timings"]["token_layer_passes"].as_u64().expect("passes"));
    }
    // 2 layers x 22 rows x 16 steps without a cache; the caches compute fewer rows.
    assert_eq!(passes[0], 2 * 22 * 16);
    assert!(passes[1..].iter().all(|&p| p < passes[0]), "{passes:?}");
    assert!(
        passes[2] < passes[1],
        "dual computes less than prefix: {passes:?}"
    );

    assert_fails(
        &[
            "generate",
            "--model",
            &fix,
            "--prompt-ids",
            "1,2,3",
            "--cache",
            "prefix-arm",
            "--prefix-len",
            "4",
        ],
        2,
        "--prefix-len 4",
    );
    assert_fails(
        &[
            "generate",
            "--model",
            &fix,
            "--prompt-ids",
            "1,305,3",
            "--cache",
            "fast-dllm-dual",
        ],
        2,
        "--cache none",
    );
}

#[test]
fn chat_takes_a_cache_mode() {
    let fix = fixture();
    let args = [
        "chat",
        "--model",
        &fix,
        "--system",
        "Be brief.",
        "--gen-length",
        "8",
        "--threshold",
        "0.9",
        "--cache",
        "fast-dllm-dual",
        "--json",
    ];
    let o = run_with_stdin(&args, "Hello\nAnd then?\n");
    assert_ok(&o);
    let turns: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(turns.len(), 2);
    for t in &turns {
        assert_eq!(t["cache"], "fast-dllm-dual");
        assert_eq!(u64s(&t["ids"]).len(), 8);
        assert!(t["prefix_len"].as_u64() < t["prompt_tokens"].as_u64());
        assert!(t["timings"]["token_layer_passes"].as_u64().is_some());
    }
}

#[test]
fn eval_runs_every_cache_mode_over_the_set() {
    let set = tiny_set();
    let md = temp_path("eval.md");
    let out = temp_path("eval.json");
    let (md_arg, out_arg) = (md.display().to_string(), out.display().to_string());
    let o = run(&[
        "eval",
        "--model",
        &fixture(),
        "--set",
        &set,
        "--cache",
        "all",
        "--gen-length",
        "8",
        "--full-canvas",
        "--json",
        "--markdown",
        &md_arg,
        "--out",
        &out_arg,
    ]);
    assert_ok(&o);
    let v = json(&o);
    assert!(v["adapter"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(v["backend"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(v["model"].as_str().is_some_and(|s| s.contains("tiny")));
    assert_eq!(v["set"], set.as_str());
    assert_eq!(v["n_items"], 4);
    // Eval's defaults: steps and block length follow the generation length.
    assert_eq!(v["params"]["gen_length"], 8);
    assert_eq!(v["params"]["steps"], 8);
    assert_eq!(v["params"]["block_length"], 8);
    assert_eq!(v["params"]["temperature"], 0.0);

    let modes = v["modes"].as_array().expect("modes");
    let names: Vec<&str> = modes
        .iter()
        .map(|m| m["cache"].as_str().expect("cache"))
        .collect();
    assert_eq!(names, ALL_CACHE_MODES);
    for m in modes {
        let name = &m["cache"];
        assert_eq!(m["n_items"], 4, "{name}");
        let accuracy = f64_of(&m["accuracy"]);
        assert!((0.0..=1.0).contains(&accuracy), "{name}: {accuracy}");
        assert_eq!(
            accuracy,
            f64_of(&m["correct"]) / 4.0,
            "{name}: accuracy is correct / items"
        );
        for task in ["lookup", "pair", "record", "format"] {
            let a = f64_of(&m["accuracy_per_task"][task]);
            assert!((0.0..=1.0).contains(&a), "{name}: {task}");
            assert_eq!(m["items_per_task"][task], 1, "{name}: {task}");
        }
        for key in [
            "total_s",
            "mean_s",
            "throughput_canvas",
            "throughput_answer",
            "mean_token_layer_passes",
            "mean_forward_passes",
            "mean_ttft_s",
            "agreement_with_none",
            "cache_bytes",
            "kv_arena_bytes",
        ] {
            assert!(f64_of(&m[key]) >= 0.0, "{name}: {key}");
        }
        assert_eq!(m["canvas_tokens"], 32, "{name}");
        assert!(f64_of(&m["throughput_canvas"]) > 0.0, "{name}");
        assert!(f64_of(&m["agreement_with_none"]) <= 1.0, "{name}");
        // The fixture has no depth table and no --depth is given: BiCache falls back on
        // every item, says why, and holds nothing in the store.
        assert_eq!(m["cache_bytes"], m["kv_arena_bytes"]);
        assert_eq!(m["cache_hits"], 0, "{name}");
        assert_eq!(m["cache_misses"], 0, "{name}");
        if name.as_str().is_some_and(|n| n.starts_with("bicache")) {
            assert_eq!(m["fallbacks"], 4, "{name}");
            let why = m["first_fallback"].as_str().expect("first_fallback");
            assert!(why.contains("bicache_depth.json"), "{name}: {why}");
        } else if name == "acache" {
            // The set names no span and the store holds none: the dual cache runs.
            assert_eq!(m["fallbacks"], 4, "{name}");
            let why = m["first_fallback"].as_str().expect("first_fallback");
            assert!(why.contains("no shared span"), "{name}: {why}");
        } else {
            assert_eq!(m["fallbacks"], 0, "{name}");
            assert!(m["first_fallback"].is_null(), "{name}");
        }
        // Several modes: the per-item lists go only to --out.
        assert!(m.get("items").is_none(), "{name}: items on stdout");
    }
    let passes = |i: usize| f64_of(&modes[i]["mean_token_layer_passes"]);
    assert!(
        passes(2) < passes(0),
        "dual {} vs none {}",
        passes(2),
        passes(0)
    );
    assert_eq!(modes[0]["agreement_with_none"], 1.0);
    assert_eq!(modes[0]["mean_forward_passes"], 8.0);
    // K and V of 2 layers x 2 heads x 16 dims in f32 over every position: 512 bytes each.
    let kv = modes[0]["kv_arena_bytes"].as_u64().expect("bytes");
    assert_eq!(kv % 4, 0);
    assert!(kv > 512 * 8, "{kv}");

    let full: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("read --out")).expect("JSON");
    let _ = std::fs::remove_file(&out);
    let full_modes = full["modes"].as_array().expect("modes");
    assert_eq!(full_modes.len(), ALL_CACHE_MODES.len());
    for (m, full_m) in modes.iter().zip(full_modes) {
        assert_eq!(m["accuracy"], full_m["accuracy"]);
        let items = full_m["items"].as_array().expect("items in --out");
        let ids: Vec<&str> = items
            .iter()
            .map(|i| i["id"].as_str().expect("id"))
            .collect();
        assert_eq!(ids, ["g1-lookup", "g1-pair", "g1-record", "g2-format"]);
        for item in items {
            assert_eq!(u64s(&item["ids"]).len(), 8);
            assert!(item["output"].is_string());
            assert!(item["answer"].is_string());
            assert!(item["correct"].is_boolean());
            assert!(f64_of(&item["total_s"]) >= 0.0);
            assert!(item["token_layer_passes"].as_u64().is_some_and(|n| n > 0));
            if m["cache"]
                .as_str()
                .is_some_and(|n| n.starts_with("bicache"))
            {
                assert!(item["bicache"]["fallback"].is_string(), "{item}");
            } else {
                assert!(item["bicache"].is_null(), "{item}");
            }
        }
    }

    let table = std::fs::read_to_string(&md).expect("read --markdown");
    let _ = std::fs::remove_file(&md);
    let header = table.lines().next().expect("header line");
    for needle in [
        "adapter:",
        "model:",
        "set:",
        "gen_length=8",
        "unmask eval",
        "--cache all",
    ] {
        assert!(header.contains(needle), "`{needle}` not in {header}");
    }
    assert!(table.contains("| cache | accuracy | lookup | pair | record | format |"));
    assert!(table.contains(
        "| TTFT (s) | agreement with none | shared entry hit/miss/fallback | anchors (on asked lines / asked lines' tokens anchored) |"
    ));
    for mode in ALL_CACHE_MODES {
        let rows = table
            .lines()
            .filter(|l| {
                // dLLM-Cache rows name their settings: `| dllm-cache (ρ 0.25, …) |`.
                l.starts_with(&format!("| {mode} |")) || l.starts_with(&format!("| {mode} ("))
            })
            .count();
        assert_eq!(rows, 1, "{mode} rows in\n{table}");
    }
    assert_eq!(
        table.lines().filter(|l| l.starts_with("| ")).count(),
        2 + ALL_CACHE_MODES.len()
    );
}

#[test]
fn eval_scores_exact_matches_and_limits_items() {
    let fix = fixture();
    // Defaults (32 tokens, 32 steps, one block) over the first two items.
    let o = run(&[
        "eval",
        "--model",
        &fix,
        "--set",
        &tiny_set(),
        "--limit",
        "2",
        "--json",
    ]);
    assert_ok(&o);
    let v = json(&o);
    assert_eq!(v["params"]["gen_length"], 32);
    assert_eq!(v["params"]["steps"], 32);
    assert_eq!(v["params"]["block_length"], 32);
    assert_eq!(v["n_items"], 2);
    assert_eq!(v["limit"], 2);
    let modes = v["modes"].as_array().expect("modes");
    assert_eq!(modes.len(), 1);
    assert_eq!(modes[0]["cache"], "none");
    assert_eq!(modes[0]["n_items"], 2);
    assert_eq!(modes[0]["items_per_task"]["lookup"], 1);
    assert_eq!(modes[0]["items_per_task"]["record"], 0);
    assert!(modes[0]["accuracy_per_task"]["record"].is_null());
    let items = modes[0]["items"].as_array().expect("items with one mode");
    assert_eq!(items.len(), 2);
    for item in items {
        assert_eq!(u64s(&item["ids"]).len(), 32);
    }
    let first_output = items[0]["output"].as_str().expect("output").to_string();

    // The same items, the first expecting exactly what the model answered and the second
    // garbage: half right. A set of garbage answers scores 0.
    let line = |id: &str, task: &str, answer: &str, system: &str, user: &str| {
        serde_json::json!({
            "id": id, "task": task, "system": system, "user": user,
            "answer": answer, "prompt_group": "g1",
        })
        .to_string()
    };
    let system = "Alice: Oslo, cat, 31. Bruno: Rome, dog, 27. Answer after ####.";
    let scored = temp_path("scored.jsonl");
    std::fs::write(
        &scored,
        format!(
            "{}\n{}\n",
            line(
                "g1-lookup",
                "lookup",
                &first_output,
                system,
                "Which city is Alice from?"
            ),
            line(
                "g1-pair",
                "combine",
                "§ no model says this §",
                system,
                "What pet has the person from Rome?"
            ),
        ),
    )
    .expect("write set");
    let scored_arg = scored.display().to_string();
    let o = run(&["eval", "--model", &fix, "--set", &scored_arg, "--json"]);
    let _ = std::fs::remove_file(&scored);
    assert_ok(&o);
    let v = json(&o);
    let m = &v["modes"][0];
    assert_eq!(m["accuracy"], 0.5);
    assert_eq!(m["accuracy_per_task"]["lookup"], 1.0);
    assert_eq!(m["accuracy_per_task"]["combine"], 0.0);
    assert_eq!(m["items"][0]["correct"], true);
    assert_eq!(m["items"][1]["correct"], false);
    assert_eq!(
        m["items"][0]["ids"], items[0]["ids"],
        "temperature 0 is deterministic"
    );

    // Without --json: a progress line per item on stderr and the table on stdout.
    let garbage = temp_path("garbage.jsonl");
    std::fs::write(
        &garbage,
        format!(
            "{}\n",
            line("x1", "arithmetic", "§§§ 1234567 §§§", system, "Sum?")
        ),
    )
    .expect("write set");
    let garbage_arg = garbage.display().to_string();
    let o = run(&[
        "eval",
        "--model",
        &fix,
        "--set",
        &garbage_arg,
        "--gen-length",
        "8",
        "--cache",
        "none,fast-dllm-dual",
    ]);
    let _ = std::fs::remove_file(&garbage);
    assert_ok(&o);
    let err = stderr(&o);
    assert!(err.contains("[none 1/1] x1 (arithmetic): wrong"), "{err}");
    assert!(err.contains("[fast-dllm-dual 1/1] x1"), "{err}");
    let table = stdout(&o);
    assert!(table.contains("| none | 0.000 (0/1) |"), "{table}");
    assert!(
        table.contains("| fast-dllm-dual | 0.000 (0/1) |"),
        "{table}"
    );
}

#[test]
fn eval_errors_name_the_value_the_file_and_the_line() {
    let fix = fixture();
    let f = fix.as_str();
    let set = tiny_set();
    let s = set.as_str();
    assert_fails(
        &["eval", "--model", f, "--set", s, "--cache", "all,none"],
        2,
        "`all`",
    );
    assert_fails(
        &["eval", "--model", f, "--set", s, "--cache", "bicash"],
        2,
        "`bicash`",
    );
    assert_fails(
        &[
            "eval",
            "--model",
            f,
            "--set",
            s,
            "--cache",
            "none,bicache-triple",
        ],
        2,
        "`bicache-triple`",
    );
    assert_fails(
        &["eval", "--model", f, "--set", s, "--cache", "none,none"],
        2,
        "more than once",
    );
    assert_fails(
        &["generate", "--prompt-ids", "1", "--cache", "bicash"],
        2,
        "'bicash'",
    );
    assert_fails(&["chat", "--cache", "dual"], 2, "'dual'");
    assert_fails(&["eval", "--model", f], 2, "--set");
    assert_fails(
        &["eval", "--model", f, "--set", s, "--limit", "0"],
        2,
        "--limit",
    );
    assert_fails(&["eval", "--model", f, "--set", s, "--raw"], 2, "--raw");

    let missing = temp_path("no-such-set.jsonl").display().to_string();
    assert_fails(&["eval", "--model", f, "--set", &missing], 1, &missing);

    let bad = temp_path("bad-set.jsonl");
    let bad_arg = bad.display().to_string();
    let good = r#"{"id": "a", "task": "lookup", "system": "S", "user": "U", "answer": "x", "prompt_group": "g"}"#;
    for (second, why) in [
        ("{\"id\": \"b\", \"task\": ", "not a valid JSON"),
        (
            r#"{"id": "b", "task": "lookup", "system": "S", "answer": "x"}"#,
            "missing field \"user\"",
        ),
        (
            r#"{"id": "b", "task": "lookup", "user": "U", "answer": 7}"#,
            "\"answer\" must be a string",
        ),
        (good, "already used on line 1"),
    ] {
        std::fs::write(&bad, format!("{good}\n{second}\n")).expect("write set");
        assert_fails(
            &["eval", "--model", f, "--set", &bad_arg],
            1,
            &format!("{bad_arg}:2: "),
        );
        assert_fails(&["eval", "--model", f, "--set", &bad_arg], 1, why);
    }
    std::fs::write(&bad, "\n\n").expect("write set");
    assert_fails(
        &["eval", "--model", f, "--set", &bad_arg],
        1,
        "holds no items",
    );
    let _ = std::fs::remove_file(&bad);

    let nowhere = temp_path("no-such-dir/table.md").display().to_string();
    assert_fails(
        &["eval", "--model", f, "--set", s, "--markdown", &nowhere],
        2,
        "does not exist",
    );
}

/// `a` followed by `b`.
fn joined<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    [a, b].concat()
}

/// The three-item set of the profiling test: two items share a system prompt.
fn profile_set() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/profile-set.jsonl")
        .display()
        .to_string()
}

#[test]
fn profile_writes_the_depth_table_the_matrix_and_the_heat_map() {
    let out = temp_path("profile");
    let out_arg = out.display().to_string();
    let o = run(&[
        "profile",
        "--model",
        &fixture(),
        "--set",
        &profile_set(),
        "--out",
        &out_arg,
        "--user-repeat",
        "2",
    ]);
    assert_ok(&o);
    let err = stderr(&o);
    assert!(err.contains("[profile 6/6]"), "{err}");
    assert!(stdout(&o).contains("table: r >= 0: b = "), "{}", stdout(&o));

    let text = std::fs::read_to_string(out.join("bicache_depth.json")).expect("table");
    let table = unmask_core::depth_policy::DepthTable::from_json(&text, "bicache_depth.json")
        .expect("a valid depth table");
    assert_eq!(table.model_id, "tiny");
    assert_eq!(table.n_layers, 2);
    assert_eq!(table.tau, 0.97);
    assert_eq!(table.entries[0].0, 0);
    assert!(table.samples_per_ratio >= 1);
    assert!(table.ratio_definition.contains("P/(P+U)"));
    assert!(table.source.contains("unmask profile"), "{}", table.source);

    let matrix: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("similarity.json")).expect("matrix"),
    )
    .expect("JSON");
    let ratios = u64s(&matrix["ratios"]);
    assert!(
        !ratios.is_empty() && ratios.windows(2).all(|w| w[0] < w[1]),
        "{ratios:?}"
    );
    let samples = u64s(&matrix["samples"]);
    assert_eq!(samples.len(), ratios.len());
    assert_eq!(
        samples.iter().sum::<u64>(),
        6,
        "three items, each also repeated twice"
    );
    let rows = matrix["similarity"].as_array().expect("similarity");
    assert_eq!(rows.len(), ratios.len());
    for row in rows {
        let row = row.as_array().expect("row");
        assert_eq!(row.len(), 2);
        // Layer 0's K/V do not see the rest of the prompt; layer 1's do.
        assert!((f64_of(&row[0]) - 1.0).abs() < 1e-6, "{row:?}");
        assert!(f64_of(&row[1]) < 1.0, "{row:?}");
    }

    let svg = std::fs::read_to_string(out.join("similarity.svg")).expect("heat map");
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let named = |tag: &'static str| doc.descendants().filter(move |n| n.has_tag_name(tag));
    // A cell per bucket and layer (besides the background and the colour bar), and the
    // ratios as row labels.
    assert!(named("rect").count() > 2 * ratios.len());
    let texts: Vec<&str> = named("text")
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for r in &ratios {
        assert!(texts.contains(&r.to_string().as_str()), "{r} in {texts:?}");
    }
    let _ = std::fs::remove_dir_all(&out);

    // With a canvas the ratio counts it.
    let o = run(&[
        "profile",
        "--model",
        &fixture(),
        "--set",
        &profile_set(),
        "--out",
        &out_arg,
        "--limit",
        "1",
        "--gen-length",
        "32",
        "--tau",
        "0.5",
    ]);
    assert_ok(&o);
    let text = std::fs::read_to_string(out.join("bicache_depth.json")).expect("table");
    let table = unmask_core::depth_policy::DepthTable::from_json(&text, "t").expect("valid");
    assert!(
        table.ratio_definition.contains("G = 32"),
        "{}",
        table.ratio_definition
    );
    assert_eq!(table.tau, 0.5);
    let _ = std::fs::remove_dir_all(&out);

    let fix = fixture();
    let set = profile_set();
    let base = ["profile", "--model", fix.as_str(), "--set", set.as_str()];
    assert_fails(&base, 2, "--out");
    assert_fails(
        &joined(&base, &["--out", &out_arg, "--tau", "0"]),
        2,
        "--tau",
    );
    assert_fails(
        &joined(&base, &["--out", &out_arg, "--tau", "1.5"]),
        2,
        "--tau",
    );
    assert_fails(
        &joined(&base, &["--out", &out_arg, "--user-repeat", "2,0"]),
        2,
        "--user-repeat",
    );
    assert_fails(
        &joined(&base, &["--out", &out_arg, "--gen-length", "-1"]),
        2,
        "--gen-length",
    );
}

/// `generate --json` with BiCache's flags on a prompt whose system turn is the prefix.
fn bicache_generate(extra: &[&str]) -> Value {
    let fix = fixture();
    let mut args = vec![
        "generate",
        "--model",
        fix.as_str(),
        "--system",
        "Alice: Oslo, cat, 31. Bruno: Rome, dog, 27. Answer after ####.",
        "--prompt",
        "Which city is Alice from?",
        "--gen-length",
        "16",
        "--block-length",
        "16",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = run(&args);
    assert_ok(&o);
    json(&o)
}

#[test]
fn generate_reports_bicache_and_its_fallbacks() {
    let v = bicache_generate(&["--cache", "bicache", "--depth", "1", "--refresh", "4"]);
    assert_eq!(v["cache"], "bicache");
    let b = &v["bicache"];
    assert_eq!(b["depth"], 1, "{b}");
    assert_eq!(b["hit"], false, "one process, one request: a miss");
    assert!(b["fallback"].is_null(), "{b}");
    assert_eq!(b["entry_tokens"], v["prefix_len"]);
    assert!(b["entry_bytes"].as_u64().is_some_and(|n| n > 0), "{b}");
    let prompt = u64s(&v["prompt_ids"]).len() as f64;
    let p = f64_of(&v["prefix_len"]);
    let r = (100.0 * p / (prompt + 16.0)).round();
    assert_eq!(f64_of(&b["ratio"]), r, "{b}");
    assert_eq!(u64s(&v["ids"]).len(), 16);

    // A budget of 4 tokens cannot hold the prefix: the request runs uncached and says why.
    let v = bicache_generate(&["--cache", "bicache", "--depth", "1", "--cache-budget", "4"]);
    let why = v["bicache"]["fallback"].as_str().expect("fallback reason");
    assert!(
        why.contains("budget") && why.contains("ran as none"),
        "{why}"
    );
    let v = bicache_generate(&[
        "--cache",
        "bicache-dual",
        "--depth",
        "1",
        "--cache-budget",
        "1000,1K",
    ]);
    let why = v["bicache"]["fallback"].as_str().expect("fallback reason");
    assert!(
        why.contains("fast-dllm-dual") && why.contains("1024 bytes"),
        "{why}"
    );
    // Without a depth table or --depth.
    let v = bicache_generate(&["--cache", "bicache"]);
    let why = v["bicache"]["fallback"].as_str().expect("fallback reason");
    assert!(why.contains("bicache_depth.json"), "{why}");
    // Other modes have no report.
    assert!(bicache_generate(&["--cache", "none"])["bicache"].is_null());

    let fix = fixture();
    let f = fix.as_str();
    let base = [
        "generate",
        "--model",
        f,
        "--prompt-ids",
        "1,2",
        "--cache",
        "bicache",
    ];
    assert_fails(&joined(&base, &["--depth", "-1"]), 2, "--depth");
    assert_fails(&joined(&base, &["--refresh", "0"]), 2, "--refresh");
    assert_fails(
        &joined(&base, &["--cache-budget", "many"]),
        2,
        "--cache-budget",
    );
    assert_fails(
        &joined(&base, &["--cache-budget", "4,2T"]),
        2,
        "--cache-budget",
    );
}

#[test]
fn eval_and_chat_share_the_system_prompt_through_bicache() {
    let o = run(&[
        "eval",
        "--model",
        &fixture(),
        "--set",
        &tiny_set(),
        "--cache",
        "none,bicache,bicache-dual",
        "--depth",
        "1",
        "--gen-length",
        "8",
        "--json",
    ]);
    assert_ok(&o);
    let v = json(&o);
    let modes = v["modes"].as_array().expect("modes");
    // Three items share group g1's system prompt, the fourth has its own: two entries are
    // built, then every later request of the run finds its prefix stored.
    assert_eq!(modes[1]["cache"], "bicache");
    assert_eq!(modes[1]["cache_misses"], 2);
    assert_eq!(modes[1]["cache_hits"], 2);
    assert_eq!(modes[2]["cache_misses"], 0);
    assert_eq!(modes[2]["cache_hits"], 4);
    for m in &modes[1..] {
        assert_eq!(m["fallbacks"], 0, "{m}");
        assert!(m["first_fallback"].is_null());
        assert!(
            f64_of(&m["cache_bytes"]) > f64_of(&m["kv_arena_bytes"]),
            "the store's entries count: {m}"
        );
        assert!(
            f64_of(&m["mean_token_layer_passes"]) < f64_of(&modes[0]["mean_token_layer_passes"]),
            "{m}"
        );
    }
    let err = stderr(&o);
    assert!(err.contains("BiCache depth 1 at r = "), "{err}");
    assert!(err.contains(", hit)"), "{err}");

    // Up to 3 items at once (continuous batching) give each item's tokens of one at a time
    // (one matmul kernel for every row count, so batched rows round as alone).
    let items_at = |batch: &str| {
        let o = run(&[
            "eval",
            "--model",
            &fixture(),
            "--set",
            &tiny_set(),
            "--cache",
            "bicache-dual",
            "--depth",
            "1",
            "--gen-length",
            "8",
            "--matmul",
            "tiled",
            "--batch",
            batch,
            "--json",
        ]);
        assert_ok(&o);
        json(&o)["modes"][0]["items"]
            .as_array()
            .expect("items")
            .clone()
    };
    let (alone, batched) = (items_at("1"), items_at("3"));
    assert_eq!(alone.len(), 4);
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(a["ids"], b["ids"], "{} differs in a batch", a["id"]);
        assert_eq!(a["bicache"]["batch"], 1);
    }
    let most = batched
        .iter()
        .filter_map(|i| i["bicache"]["batch"].as_u64())
        .max();
    assert_eq!(most, Some(3), "g1's three items share the forward passes");

    let args = [
        "chat",
        "--model",
        &fixture(),
        "--system",
        "Be brief.",
        "--gen-length",
        "8",
        "--cache",
        "bicache",
        "--depth",
        "1",
        "--json",
    ];
    let o = run_with_stdin(&args, "Hello\n");
    assert_ok(&o);
    let turn: Value = serde_json::from_str(stdout(&o).trim()).expect("JSON line");
    assert_eq!(turn["bicache"]["depth"], 1, "{turn}");
    assert!(turn["bicache"]["fallback"].is_null(), "{turn}");
}

#[test]
fn quantize_writes_a_folder_that_generates_like_load_time_quantization() {
    let fix = fixture();
    let out = temp_path("q4");
    let _ = std::fs::remove_dir_all(&out);
    let out_s = out.display().to_string();
    let o = run(&[
        "quantize",
        "--model",
        &fix,
        "--weights",
        "q4",
        "--out",
        &out_s,
    ]);
    assert_ok(&o);
    assert!(stderr(&o).contains("model.safetensors"), "{}", stderr(&o));
    for file in ["model.safetensors", "config.json", "tokenizer.json"] {
        assert!(out.join(file).is_file(), "{file} missing");
    }
    assert!(!out.join("model.safetensors.index.json").exists());
    let ids = |model: &str, extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--prompt-ids",
            "300,5,6,7",
            "--gen-length",
            "16",
            "--json",
        ];
        args.extend_from_slice(extra);
        let o = run(&args);
        assert_ok(&o);
        (u64s(&json(&o)["ids"]), stderr(&o))
    };
    let (saved, saved_log) = ids(&out_s, &[]);
    assert!(saved_log.contains("q4 weights"), "{saved_log}");
    let (at_load, _) = ids(&fix, &["--weights", "q4"]);
    assert_eq!(
        saved, at_load,
        "saved q4 and load-time q4 generate differently"
    );
    let (_, mixed_log) = ids(&fix, &["--weights", "q8", "--embed-weights", "f16"]);
    assert!(
        mixed_log.contains("q8, embedding and LM head f16"),
        "{mixed_log}"
    );

    assert_fails(
        &[
            "quantize",
            "--model",
            &fix,
            "--weights",
            "q4",
            "--out",
            &out_s,
        ],
        2,
        "already holds a checkpoint",
    );
    assert_fails(
        &["quantize", "--model", &fix, "--out", &out_s],
        2,
        "--weights",
    );
    assert_fails(
        &[
            "generate",
            "--model",
            &fix,
            "--prompt-ids",
            "1",
            "--dtype",
            "f32",
            "--weights",
            "q8",
        ],
        2,
        "disagree",
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// The demo page names the bundled model's size before loading it; after loading it shows
/// the loader's count. The two must agree (the label said 1.1 M when the model had 0.54 M).
#[test]
fn the_demo_page_labels_the_bundled_model_with_the_loaders_parameter_count() {
    let o = run(&[
        "info",
        "--model",
        workspace().join("models/tiny").to_str().unwrap(),
    ]);
    assert_ok(&o);
    let out = stdout(&o);
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("parameters:"))
        .unwrap_or_else(|| panic!("no parameters line in\n{out}"));
    let count: f64 = line
        .split_whitespace()
        .nth(1)
        .unwrap()
        .replace(',', "")
        .parse()
        .unwrap();
    let page = std::fs::read_to_string(workspace().join("web/index.html")).unwrap();
    let at = page.find("<code>models/tiny</code>, ").expect("the label") + 26;
    let label: f64 = page[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        page[at..].starts_with(&format!("{label} M parameters")),
        "{}",
        &page[at..at + 30]
    );
    assert_eq!(
        format!("{label:.1}"),
        format!("{:.1}", count / 1e6),
        "the page says {label} M, the loader {count}"
    );
}

/// `unmask logits` on the tiny DiffusionGemma: the encoder's logits without canvases, and
/// with the same canvas twice the decoder's logits without and then with self-conditioning
/// on the first one's logits at the first step's temperature — the fixture's `dec.p24_c2`
/// and `dec.p24_c2_sc`, whose self-conditioning input is `dec.p24_c2 / 0.8`.
#[test]
fn logits_of_diffusion_gemma_follow_the_reference_loop() {
    let dir = workspace().join("tests/fixtures/tiny-dgemma");
    let meta: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("goldens/logits.json")).expect("goldens"),
    )
    .expect("golden JSON");
    let case = meta["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == "dec.p24_c2")
        .expect("dec.p24_c2");
    let list = |v: &Value| {
        u64s(v)
            .iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (prompt, canvas) = (list(&case["prompt"]), list(&case["canvas"]));
    let bytes = std::fs::read(dir.join("goldens/logits.safetensors")).expect("golden logits");
    let goldens = unmask_core::checkpoint::Checkpoint::from_bytes(
        vec![("model.safetensors".into(), bytes)],
        None,
    )
    .expect("safetensors");
    let golden = |name: &str, rows: usize| {
        let t = goldens.tensor(name, &[rows, 320]).expect(name);
        let mut out = vec![0.0; rows * 320];
        t.read_f32(0, &mut out);
        out
    };
    let out = temp_path("dgemma-logits.npy");
    let out_arg = out.display().to_string();
    let dir_arg = dir.display().to_string();
    let read = |shape: &[u64]| {
        let bytes = std::fs::read(&out).expect("read .npy");
        let npy = npyz::NpyFile::new(&bytes[..]).expect("a .npy file");
        assert_eq!(npy.shape(), shape);
        npy.into_vec::<f32>().expect("f32 data")
    };
    let close = |what: &str, got: &[f32], want: &[f32]| {
        let scale = want.iter().fold(0f32, |m, w| m.max(w.abs()));
        let err = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (g, w)| m.max((g - w).abs()))
            / scale;
        assert!(err < 1e-3, "{what}: relative error {err}");
    };
    let base = [
        "logits",
        "--model",
        &dir_arg,
        "--prompt-ids",
        &prompt,
        "--out",
        &out_arg,
    ];
    assert_ok(&run(&base));
    close("encoder", &read(&[24, 320]), &golden("enc.p24", 24));
    let mut args = base.to_vec();
    args.extend(["--canvas-ids", &canvas, "--canvas-ids", &canvas]);
    assert_ok(&run(&args));
    let got = read(&[2, 16, 320]);
    let _ = std::fs::remove_file(&out);
    close("decoder", &got[..16 * 320], &golden("dec.p24_c2", 16));
    close(
        "self-conditioned decoder",
        &got[16 * 320..],
        &golden("dec.p24_c2_sc", 16),
    );
    // Canvases of different lengths, and canvases for a model without a decoder, are refused.
    let mut args = base.to_vec();
    args.extend(["--canvas-ids", &canvas, "--canvas-ids", "1,2"]);
    assert_fails(&args, 2, "--canvas-ids");
    let llada = fixture();
    assert_fails(
        &[
            "logits",
            "--model",
            &llada,
            "--prompt-ids",
            "1",
            "--canvas-ids",
            "1",
            "--out",
            &out_arg,
        ],
        2,
        "--canvas-ids",
    );
}

/// `unmask generate` on the tiny DiffusionGemma: the prompt in Gemma 4's chat layout (the ids
/// the reference template gives), canvases of the config's length, the same output for the
/// same seed.
#[test]
fn generate_runs_diffusion_gemma_from_text() {
    let dir = workspace().join("tests/fixtures/tiny-dgemma");
    let dir_arg = dir.display().to_string();
    let generate = |seed: &str| {
        let o = run(&[
            "generate",
            "--model",
            &dir_arg,
            "--prompt",
            "What is 2 + 3?",
            "--seed",
            seed,
            "--gen-length",
            "32",
            "--steps",
            "12",
            "--json",
        ]);
        assert_ok(&o);
        json(&o)
    };
    let a = generate("5");
    let prompt = u64s(&a["prompt_ids"]);
    assert_eq!(&prompt[..3], &[2, 105, 90], "<bos><|turn>user");
    assert_eq!(prompt.len(), 34, "the reference template's 34 ids");
    let ids = u64s(&a["ids"]);
    assert_eq!(ids.len() % 16, 0, "whole canvases of 16");
    let canvases = a["canvases"].as_array().expect("canvases");
    assert!(
        !canvases.is_empty() && canvases.len() <= 2,
        "--gen-length 32: at most 2 canvases"
    );
    assert!(
        canvases.iter().all(|c| c["steps"].as_u64().unwrap() <= 12),
        "--steps 12: at most 12 steps a canvas"
    );
    assert_eq!(generate("5")["ids"], a["ids"], "same seed, same output");
}

/// `unmask eval` on the tiny DiffusionGemma: each item answers what `unmask generate` gives
/// for its system and user turns with the same seed, the second item takes the shared system
/// turn from the prefix store, and cache modes are refused by name.
#[test]
fn eval_runs_diffusion_gemma() {
    let dir = workspace().join("tests/fixtures/tiny-dgemma");
    let dir_arg = dir.display().to_string();
    let set = std::env::temp_dir().join(format!(
        "unmask-cli-{}-dgemma-set.jsonl",
        std::process::id()
    ));
    let system = "Answer from the table.\n- Ada city : Rome";
    let item = |id: &str, user: &str| {
        serde_json::json!({"id": id, "task": "lookup", "system": system, "user": user,
            "answer": "Ada city : Rome"})
        .to_string()
    };
    let lines = [
        item("a", "What is the city of Ada?"),
        item("b", "Where does Ada live?"),
    ];
    std::fs::write(&set, lines.join("\n") + "\n").unwrap();
    let set_arg = set.display().to_string();
    let common = ["--gen-length", "16", "--steps", "6", "--seed", "4"];
    let mut args = vec!["eval", "--model", &dir_arg, "--set", &set_arg, "--json"];
    args.extend(common);
    let o = run(&args);
    assert_ok(&o);
    let r = json(&o);
    assert_eq!(r["family"], "diffusion_gemma");
    assert_eq!(r["items"], 2);
    assert_eq!(
        r["system_turn_hits"], 1,
        "the second item reuses the system turn"
    );
    let results = r["results"].as_array().unwrap();
    for (res, user) in results
        .iter()
        .zip(["What is the city of Ada?", "Where does Ada live?"])
    {
        let mut args = vec![
            "generate", "--model", &dir_arg, "--system", system, "--prompt", user, "--json",
        ];
        args.extend(common);
        let g = run(&args);
        assert_ok(&g);
        assert_eq!(
            res["ids"],
            json(&g)["ids"],
            "eval and generate agree on {user:?}"
        );
    }
    // Both items denoised together (--batch 2) give the same answers.
    args.extend(["--batch", "2"]);
    let o = run(&args);
    assert_ok(&o);
    let batched = json(&o);
    assert_eq!(batched["batch"], 2);
    for (a, b) in results.iter().zip(batched["results"].as_array().unwrap()) {
        assert_eq!(a["ids"], b["ids"], "{} alone and batched", a["id"]);
    }
    let o = run(&[
        "eval", "--model", &dir_arg, "--set", &set_arg, "--cache", "bicache",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--cache bicache: DiffusionGemma has no cache modes"),
        "{err}"
    );
}

/// `unmask bench` on a DiffusionGemma folder: one record per kernel of a decoder step (the
/// projections of both layer types, the router, the LM head, the experts, both attentions),
/// each with its time and the environment.
#[test]
fn bench_times_diffusion_gemma_kernels() {
    let dir = workspace().join("tests/fixtures/tiny-dgemma");
    let out = temp_path("dgemma-bench.jsonl");
    let o = run(&[
        "bench",
        "--model",
        &dir.display().to_string(),
        "--formats",
        "q4",
        "--kv-lens",
        "24",
        "--out",
        &out.display().to_string(),
    ]);
    assert_ok(&o);
    let text = std::fs::read_to_string(&out).expect("records");
    let _ = std::fs::remove_file(&out);
    let records: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON record per line"))
        .collect();
    let cases: Vec<&str> = records
        .iter()
        .map(|r| r["case"].as_str().unwrap())
        .collect();
    for case in [
        "sliding.q",
        "sliding.v",
        "full.q",
        "full.o",
        "mlp.gate_up",
        "router",
        "lm_head",
        "experts",
        "sliding.attention",
        "full.attention",
    ] {
        assert!(cases.contains(&case), "{case} not in {cases:?}");
    }
    for r in &records {
        assert!(r["ms"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["model"]["family"], "diffusion_gemma");
    }
    let sliding = records
        .iter()
        .find(|r| r["case"] == "sliding.attention")
        .unwrap();
    assert_eq!(
        sliding["keys"],
        16 + 7,
        "the canvas and the last W - 1 prompt positions"
    );
    // The whole step from them: each layer type's kernels times its layers, the dense MLP,
    // router and experts times every layer, the LM head once.
    let step = records
        .iter()
        .find(|r| r["record"] == "step")
        .expect("a step estimate");
    let ms = |case: &str| {
        let r = records.iter().find(|r| r["case"] == case).unwrap();
        r["ms"].as_f64().unwrap()
    };
    let layers = step["layers"].as_f64().unwrap();
    let at_least = ms("lm_head") + layers * (ms("experts") + ms("router") + ms("mlp.down"));
    let total = step["ms"].as_f64().unwrap();
    assert!(total >= at_least && total.is_finite(), "{step}");
    assert!(step["experts_ms"].as_f64().unwrap() > 0.0, "{step}");
}
