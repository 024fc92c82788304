//! The smallest program that embeds Unmask: load a model, generate an answer, print it.
//!
//!     cargo run --release --example generate -- [MODEL_DIR] [PROMPT]
//!
//! MODEL_DIR defaults to `models/tiny`, else the test fixture `tests/fixtures/tiny`.

use unmask::{Engine, EngineOptions, GenerationParams, Request};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| {
        let bundled = "models/tiny";
        if std::path::Path::new(bundled).is_dir() {
            bundled.into()
        } else {
            "tests/fixtures/tiny".into()
        }
    });
    let prompt = args.next().unwrap_or_else(|| "What is 2 + 3?".into());

    // Loading compiles the kernels and uploads the weights to the GPU (f16 by default).
    let engine = Engine::load(&dir, &EngineOptions::default())?;

    // 64 tokens in two blocks of 32, one token committed per step, greedy.
    let params = GenerationParams {
        gen_length: 64,
        steps: 64,
        block_length: 32,
        ..GenerationParams::default()
    };
    let request = Request::chat(Some("You are a helpful assistant."), &prompt).with_params(params);

    // `generate_with` calls back after every denoising step; `generate` just returns the result.
    let out = engine.generate_with(&request, &mut |step| {
        let masked = step.canvas.iter().filter(|&&t| t == step.mask_id).count();
        eprint!("\r{masked:>4} tokens still masked");
    })?;
    eprintln!();

    println!("{}", out.text.unwrap_or_default());
    eprintln!(
        "{} tokens in {:.2} s on {}",
        out.ids.len(),
        out.timings.total_s,
        engine.ctx().info.name
    );
    Ok(())
}
