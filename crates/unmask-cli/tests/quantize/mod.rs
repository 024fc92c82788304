//! `unmask quantize`: the folder it writes generates like quantizing at load time.

use super::{assert_fails, assert_ok, fixture, json, run, stderr, temp_path, u64s};

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
