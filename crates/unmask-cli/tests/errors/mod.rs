//! How `unmask` refuses bad command lines and missing models: the exit code, an `error:`
//! line naming the flag, value or path, and never a panic.

use super::{assert_fails, fixture};

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
