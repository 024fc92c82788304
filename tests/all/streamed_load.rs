//! Loading through `ModelFiles` (the browser's path): the checkpoint arrives as a stream
//! cut into pieces of any size and is uploaded as it arrives. The streamed model must
//! generate exactly the reference goldens, and a short stream must fail naming the file.

use crate::common;

use common::fixture_dir;

use unmask::{
    DirFiles, Engine, EngineError, EngineOptions, GenerationParams, MemoryFiles, ModelFiles,
    Request,
};
use unmask_goldens::{ids, params};
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
                .generate(
                    &Request::ids(prompt.clone())
                        .with_params(params)
                        .with_full_canvas(),
                )
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

// ---------------------------------------------------------------------------------------
// Faults while loading and GPU memory: named errors, and an engine that stays usable.
// ---------------------------------------------------------------------------------------

/// A fresh copy of the fixture's files in a temporary folder unique to `name`.
fn copy_fixture(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("unmask-load-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture_dir()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    dir
}

const SHARD2: &str = "model-00002-of-00002.safetensors";

fn load_dir(dir: &std::path::Path) -> Result<Engine, EngineError> {
    Engine::load_on(common::ctx(), dir, &options(), &mut |_| {})
}

#[cfg(unix)]
#[test]
fn a_fifo_is_refused_and_symlinks_are_followed() {
    let dir = copy_fixture("fifo");
    std::fs::remove_file(dir.join(SHARD2)).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(dir.join(SHARD2))
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    // Refused before open: opening a FIFO for reading would wait for a writer forever.
    let err = load_dir(&dir).err().expect("a FIFO fails").to_string();
    eprintln!("[error] {err}");
    assert!(err.contains(SHARD2) && err.contains("FIFO"), "{err}");

    // Every file a symlink into another folder, as in the Hugging Face cache.
    let linked = std::env::temp_dir().join(format!("unmask-load-{}-links", std::process::id()));
    let _ = std::fs::remove_dir_all(&linked);
    std::fs::create_dir_all(&linked).unwrap();
    for entry in std::fs::read_dir(fixture_dir()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::os::unix::fs::symlink(entry.path(), linked.join(entry.file_name())).unwrap();
        }
    }
    assert!(load_dir(&linked).is_ok(), "a folder of symlinks loads");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&linked);
}

#[test]
fn a_checkpoint_truncated_while_it_loads_is_a_named_error() {
    let dir = copy_fixture("truncated-while-loading");
    let shard2 = dir.join(SHARD2);
    let mut cut = false;
    // Both headers are read before any data; the second shard is cut while the first
    // uploads, as an in-place copy over it would.
    let result = Engine::load_on(common::ctx(), &dir, &options(), &mut |_| {
        if !cut {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(&shard2)
                .unwrap();
            let len = file.metadata().unwrap().len();
            file.set_len(len / 2).unwrap();
            cut = true;
        }
    });
    assert!(cut, "the load reported progress");
    let err = result.err().expect("a truncated shard fails").to_string();
    eprintln!("[error] {err}");
    assert!(err.contains(SHARD2) && err.contains("truncated"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn non_finite_weights_are_named_when_they_load() {
    let dir = copy_fixture("nan");
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let name = "model.transformer.blocks.1.ff_out.weight";
    let shard = dir.join(index["weight_map"][name].as_str().unwrap());
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let info = &header[name];
    assert_eq!(info["dtype"], "BF16");
    let cols = info["shape"][1].as_u64().unwrap() as usize;
    let start = 8 + n + info["data_offsets"][0].as_u64().unwrap() as usize;
    // Row 3, column 5 becomes a bf16 NaN.
    let at = start + 2 * (3 * cols + 5);
    bytes[at..at + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
    std::fs::write(&shard, bytes).unwrap();
    let err = load_dir(&dir).err().expect("NaN weights fail").to_string();
    eprintln!("[error] {err}");
    assert!(
        err.contains(name) && err.contains("NaN") && err.contains("row 3, column 5"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_gpu_memory_budget_refuses_work_by_name_and_the_engine_stays_usable() {
    let with_budget = |gpu_memory| {
        Engine::load(
            fixture_dir(),
            &EngineOptions {
                gpu_memory,
                ..options()
            },
        )
    };
    let free = with_budget(None).unwrap();
    let loaded = free.ctx().memory.live_bytes();
    let small = |engine: &Engine| {
        engine.generate(
            &Request::ids(vec![300, 40, 41, 42]).with_params(GenerationParams {
                gen_length: 8,
                steps: 8,
                block_length: 8,
                ..GenerationParams::default()
            }),
        )
    };
    let want = small(&free).unwrap().ids;
    let small_state = free.model().state_bytes(12, 12);
    drop(free);

    // Below what the weights need: the load fails naming a buffer.
    let err = with_budget(Some(loaded / 2))
        .err()
        .expect("too small")
        .to_string();
    eprintln!("[error] {err}");
    assert!(err.contains("budget") && err.contains("buffer"), "{err}");

    // Room for the weights and a small request, not a large one.
    let engine = with_budget(Some(loaded + small_state + (64 << 10))).unwrap();
    let large = Request::ids(vec![300, 40, 41, 42]).with_params(GenerationParams {
        gen_length: 200,
        steps: 200,
        block_length: 200,
        ..GenerationParams::default()
    });
    let err = engine
        .generate(&large)
        .expect_err("over budget")
        .to_string();
    eprintln!("[error] {err}");
    assert!(
        err.contains("request state") && err.contains("budget"),
        "{err}"
    );
    assert_eq!(small(&engine).unwrap().ids, want, "the engine still works");
}

#[test]
fn an_error_outside_any_scope_is_reported_not_a_panic() {
    // Its own device: the fault must not reach other tests on the shared one.
    let ctx = unmask_gpu::GpuContext::new(&unmask_gpu::ContextOptions::default()).unwrap();
    assert!(ctx.check_faults().is_ok());
    // MAP_READ with STORAGE is invalid: wgpu's default handler would panic.
    let _bad = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("invalid on purpose"),
        size: 16,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let err = ctx
        .check_faults()
        .expect_err("the fault is reported")
        .to_string();
    eprintln!("[error] {err}");
    assert!(
        err.contains("invalid on purpose") || err.contains("usage"),
        "{err}"
    );
    assert!(ctx.check_faults().is_ok(), "reported once");
}
