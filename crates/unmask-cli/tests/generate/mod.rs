//! `unmask generate` and `unmask logits` on the tiny fixture model: ids and text prompts,
//! JSON and plain output, the default model and blocks, threshold decoding and prefix lengths
//! under every single-request cache mode, and logits as .npy against the golden logits.

use serde_json::Value;

use super::{assert_fails, assert_ok, fixture, json, run, stderr, stdout, u64s, unmask, workspace};

const MASK: u64 = 305;
const BOS: u64 = 300;
const VOCAB: usize = 320;

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

/// The modes that are step plans of one request (no shared store).
const CACHE_MODES: [&str; 4] = ["none", "fast-dllm-prefix", "fast-dllm-dual", "prefix-arm"];

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

/// Infilling from the command line: `--suffix-ids` gives the reference's canvas before the
/// suffix (tests/fixtures/tiny/goldens/infill.json), `--suffix` text tokenizes to the same
/// ids, and bad suffixes are refused by flag.
#[test]
fn generate_infills_the_canvas_before_a_suffix() {
    let fix = fixture();
    let text = std::fs::read_to_string(workspace().join("tests/fixtures/tiny/goldens/infill.json"))
        .expect("infill goldens");
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let case = &goldens["cases"][0];
    let list = |v: &Value| {
        u64s(v)
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let (prompt, suffix) = (list(&case["prompt"]), list(&case["suffix"]));
    let n = case["params"]["gen_length"].as_u64().unwrap() as usize;
    let base = [
        "generate",
        "--model",
        &fix,
        "--prompt-ids",
        &prompt,
        "--gen-length",
        "8",
        "--steps",
        "8",
        "--block-length",
        "8",
        "--confidence-precision",
        "f32",
        "--full-canvas",
        "--json",
    ];
    let output = u64s(&case["output"]);
    let p = u64s(&case["prompt"]).len();
    let want = &output[p..p + n];
    let by_ids = run(&[&base[..], &["--suffix-ids", &suffix]].concat());
    assert_ok(&by_ids);
    let v = json(&by_ids);
    assert_eq!(u64s(&v["ids"]), want);
    assert_eq!(v["suffix_len"], u64s(&case["suffix"]).len());
    let by_text = run(&[
        &base[..],
        &["--suffix", case["suffix_text"].as_str().unwrap()],
    ]
    .concat());
    assert_ok(&by_text);
    assert_eq!(u64s(&json(&by_text)["ids"]), want);
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        [base, extra].concat()
    }
    assert_fails(
        &with(&base, &["--suffix-ids", &format!("4,{MASK}")]),
        2,
        "--suffix-ids: holds the mask token 305 at position 1",
    );
    assert_fails(
        &with(&base, &["--suffix-ids", "4,999"]),
        2,
        "--suffix-ids: token id 999 is outside the model's vocabulary",
    );
    assert_fails(
        &with(&base, &["--suffix", ""]),
        2,
        "--suffix: expected at least one token",
    );
    let long = vec!["7"; 250].join(",");
    assert_fails(
        &with(&base, &["--suffix-ids", &long]),
        2,
        "+ the suffix's 250 = ",
    );
}
