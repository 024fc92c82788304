//! Loading through `ModelFiles` (the browser's path): the checkpoint arrives as a stream
//! cut into pieces of any size and is uploaded as it arrives. The streamed model must
//! generate exactly the reference goldens, and a short stream must fail naming the file.

mod common;

use common::fixture_dir;

use unmask::{
    DirFiles, Engine, EngineError, EngineOptions, GenerationParams, MemoryFiles, ModelFiles,
    Request,
};
use unmask_core::goldens::{ids, params};
use unmask_gpu::WeightFormat;

/// The fixture's files in memory, streamed in pieces of `piece` bytes with no lengths, as
/// from a server that sends none: the stream's end is checked instead.
fn pieces(piece: usize) -> MemoryFiles {
    let files = std::fs::read_dir(fixture_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_file())
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).unwrap())
        });
    MemoryFiles::new(files, piece).without_lengths()
}

fn options() -> EngineOptions {
    EngineOptions {
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    }
}

fn load(files: &mut impl ModelFiles) -> Result<Engine, EngineError> {
    pollster::block_on(Engine::load_from(
        common::ctx(),
        files,
        &options(),
        &mut |_| {},
    ))
}

/// The golden cases with quota decoding and low-confidence remasking, as (prompt, params,
/// expected prompt + canvas).
fn golden_cases() -> Vec<(Vec<u32>, GenerationParams, Vec<u32>)> {
    common::golden_cases()
        .iter()
        .filter(|c| c["params"]["remasking"] == "low_confidence")
        .map(|c| (ids(&c["prompt"]), params(c), ids(&c["output"])))
        .collect()
}

#[test]
fn a_model_streamed_in_odd_pieces_generates_the_goldens() {
    for (piece, what) in [
        (usize::MAX, "one piece per file"),
        (1013, "1013-byte pieces"),
    ] {
        let mut progress = Vec::new();
        let mut files = pieces(piece);
        let engine = pollster::block_on(Engine::load_from(
            common::ctx(),
            &mut files,
            &options(),
            &mut |p| progress.push((p.done_bytes, p.total_bytes)),
        ))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let &(done, total) = progress.last().expect("progress was reported");
        assert_eq!(done, total, "{what}: every byte was counted");
        assert!(
            progress.windows(2).all(|w| w[0].0 <= w[1].0),
            "{what}: progress only grows"
        );
        let cases = golden_cases();
        assert!(cases.len() >= 5);
        for (prompt, params, want) in cases {
            let out = engine
                .generate(&Request::ids(prompt.clone()).with_params(params))
                .unwrap();
            let mut got = prompt;
            got.extend(&out.ids);
            assert_eq!(got, want, "{what}: tokens differ from the reference");
        }
        eprintln!(
            "[stream] {what}: {} progress reports, goldens equal",
            progress.len()
        );
    }
}

#[test]
fn a_short_stream_names_the_file() {
    let mut files = pieces(4096).withholding(100);
    let err = load(&mut files)
        .err()
        .expect("a short stream fails")
        .to_string();
    eprintln!("[error] {err}");
    assert!(
        err.contains(".safetensors") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn a_folder_without_config_is_named() {
    let mut files = DirFiles::new(std::env::temp_dir().join("unmask-no-such-stream"));
    let err = load(&mut files).err().expect("fails").to_string();
    assert!(err.contains("config.json"), "{err}");
}
