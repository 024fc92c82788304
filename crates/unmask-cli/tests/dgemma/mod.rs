//! The `unmask` commands on the tiny DiffusionGemma: logits that follow the reference loop,
//! generation from text, eval with a shared system turn, and the kernel timings of `bench`.

use serde_json::Value;

use super::{assert_fails, assert_ok, fixture, json, run, temp_path, u64s, workspace};

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
    // `tokenize` reads the same layout from the text side alone.
    let o = run(&[
        "tokenize",
        "--model",
        &dir_arg,
        "--prompt",
        "What is 2 + 3?",
        "--json",
    ]);
    assert_ok(&o);
    let t = json(&o);
    assert_eq!(u64s(&t["tokens"]), prompt);
    assert_eq!(t["max_model_len"], 1024);
    // Flags of the masked-diffusion sampler are refused by name, not ignored.
    assert_fails(
        &[
            "generate",
            "--model",
            &dir_arg,
            "--prompt",
            "q",
            "--temperature",
            "0.5",
        ],
        2,
        "--temperature: not a DiffusionGemma setting",
    );
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
    // Measured on the device (weights included): two canvases at once hold more.
    let peak = |r: &serde_json::Value| r["peak_gpu_bytes"].as_u64().expect("peak_gpu_bytes");
    assert!(
        peak(&batched) > peak(&r),
        "{} vs {}",
        peak(&batched),
        peak(&r)
    );
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

/// `unmask trace` on a DiffusionGemma folder: the decoder step's dispatches, the same number
/// in every layer, the experts and the sampler's statistics among its kernel families; cache
/// modes refused by name.
#[test]
fn trace_lists_a_diffusion_gemma_decoder_step() {
    let dir = workspace().join("tests/fixtures/tiny-dgemma");
    let dir = dir.display().to_string();
    let o = run(&[
        "trace",
        "--model",
        &dir,
        "--prompt-ids",
        "2,17,40,41,42",
        "--gen-length",
        "16",
        "--steps",
        "4",
        "--json",
    ]);
    assert_ok(&o);
    let r = json(&o);
    assert_eq!(r["family"], "diffusion_gemma", "{r}");
    assert_eq!(r["label"], "diffusion gemma denoising step");
    assert_eq!(r["step"], 2);
    let per_layer = u64s(&r["dispatches_per_layer"]);
    assert_eq!(per_layer.len(), 4, "{r}");
    assert!(per_layer.iter().all(|&n| n == per_layer[0] && n > 0), "{r}");
    let families: Vec<&str> = r["families"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["kernel"].as_str().unwrap())
        .collect();
    for family in ["moe_experts:main", "denoise_rows:main", "soft_embed:main"] {
        assert!(families.contains(&family), "{family} not in {families:?}");
    }
    assert_fails(
        &["trace", "--model", &dir, "--cache", "bicache"],
        2,
        "--cache bicache: DiffusionGemma has no cache modes",
    );
}
