//! Loading through `ModelFiles` (the browser's path): the checkpoint arrives as a stream
//! cut into pieces of any size and is uploaded as it arrives. The streamed model must
//! generate exactly the reference goldens, and a short stream must fail naming the file.

mod common;

use common::fixture_dir;

use serde_json::Value;
use unmask::{
    DirFiles, Engine, EngineError, EngineOptions, GenerationParams, ModelFiles, Remasking, Request,
};
use unmask_gpu::WeightFormat;

/// A directory whose files are streamed in pieces of `piece` bytes, optionally cut short.
struct Pieces {
    dir: DirFiles,
    piece: usize,
    /// Bytes of each streamed file withheld at its end.
    cut: usize,
}

impl ModelFiles for Pieces {
    fn location(&self, name: &str) -> String {
        self.dir.location(name)
    }

    async fn read(&mut self, name: &str) -> Result<Option<Vec<u8>>, EngineError> {
        self.dir.read(name).await
    }

    async fn read_head(
        &mut self,
        name: &str,
        len: usize,
    ) -> Result<(Vec<u8>, Option<u64>), EngineError> {
        // No length, as from a server that sends none: the stream's end is checked instead.
        let (head, _) = self.dir.read_head(name, len).await?;
        Ok((head, None))
    }

    async fn stream(
        &mut self,
        name: &str,
        start: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let bytes = std::fs::read(fixture_dir().join(name)).unwrap();
        let body = &bytes[start as usize..bytes.len() - self.cut];
        for piece in body.chunks(self.piece) {
            sink(piece)?;
        }
        Ok(())
    }
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

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The golden cases with quota decoding and low-confidence remasking, as (prompt, params,
/// expected prompt + canvas).
fn golden_cases() -> Vec<(Vec<u32>, GenerationParams, Vec<u32>)> {
    let text = std::fs::read_to_string(fixture_dir().join("goldens/generate.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["params"]["remasking"] == "low_confidence")
        .map(|c| {
            let p = &c["params"];
            let params = GenerationParams {
                gen_length: p["gen_length"].as_u64().unwrap() as usize,
                steps: p["steps"].as_u64().unwrap() as usize,
                block_length: p["block_length"].as_u64().unwrap() as usize,
                temperature: p["temperature"].as_f64().unwrap() as f32,
                remasking: Remasking::LowConfidence,
                cfg_scale: p["cfg_scale"].as_f64().unwrap() as f32,
                threshold: p["threshold"].as_f64().map(|t| t as f32),
                logits_eos_inf: p["logits_eos_inf"].as_bool().unwrap(),
                confidence_eos_eot_inf: p["confidence_eos_eot_inf"].as_bool().unwrap(),
                seed: p["seed"].as_u64().unwrap(),
                round_confidence_bf16: false,
            };
            (ids(&c["prompt"]), params, ids(&c["output"]))
        })
        .collect()
}

#[test]
fn a_model_streamed_in_odd_pieces_generates_the_goldens() {
    for (piece, what) in [
        (usize::MAX, "one piece per file"),
        (1013, "1013-byte pieces"),
    ] {
        let mut progress = Vec::new();
        let mut files = Pieces {
            dir: DirFiles::new(fixture_dir()),
            piece,
            cut: 0,
        };
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
    let mut files = Pieces {
        dir: DirFiles::new(fixture_dir()),
        piece: 4096,
        cut: 100,
    };
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
