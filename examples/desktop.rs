//! How a desktop app embeds the engine: the model lives on a background thread, the UI
//! thread sends it questions and receives each answer's text as it becomes final, and a
//! cancel button stops a request between two denoising steps.
//!
//!     cargo run --release --example desktop -- [MODEL_DIR]
//!
//! The "UI" here is the main thread: it asks two questions about the bundled system
//! prompt, prints the text as it streams in, and cancels the second one after a few steps.
//! MODEL_DIR defaults to `models/tiny`, else the test fixture `tests/fixtures/tiny`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use unmask::{CacheMode, DecodeMode, Engine, EngineOptions, GenerationParams, Request};

const SYSTEM: &str = include_str!("../data/tasks/demo-system.txt");

/// What the UI asks the engine thread.
enum Command {
    Ask {
        request: Box<Request>,
        /// Set by the UI to stop this request at its next step.
        cancel: Arc<AtomicBool>,
    },
    Quit,
}

/// What the engine thread tells the UI.
enum Update {
    /// New final text of the current answer.
    Text(String),
    /// The canvas after a step: how many positions are still masked.
    Step {
        step: usize,
        masked: usize,
    },
    Finished {
        text: String,
        tokens_per_s: f64,
    },
    Cancelled {
        after_steps: usize,
    },
    Failed(String),
}

/// The engine thread: loads the model, then runs each request step by step.
fn engine_thread(model: String, commands: mpsc::Receiver<Command>, updates: mpsc::Sender<Update>) {
    let engine = match Engine::load(&model, &EngineOptions::default()) {
        Ok(e) => e,
        Err(e) => {
            let _ = updates.send(Update::Failed(format!("cannot load {model}: {e}")));
            return;
        }
    };
    while let Ok(Command::Ask { request, cancel }) = commands.recv() {
        // `start` prepares the request and its GPU state; nothing runs until `step`.
        let mut run = match engine.start(*request) {
            Ok(run) => run,
            Err(e) => {
                let _ = updates.send(Update::Failed(e.to_string()));
                continue;
            }
        };
        let mut sent = 0;
        loop {
            if cancel.load(Ordering::Relaxed) {
                // Dropping the run frees its GPU state (and any pin on a shared prefix).
                let _ = updates.send(Update::Cancelled {
                    after_steps: run.steps(),
                });
                break;
            }
            let step = run.step(&mut |event| {
                let generated = event.generated();
                let masked = generated.iter().filter(|&&t| t == event.mask_id).count();
                let _ = updates.send(Update::Step {
                    step: event.global_step,
                    masked,
                });
                // Tokens before the first mask never change again: their text is final.
                let done = generated
                    .iter()
                    .position(|&t| t == event.mask_id)
                    .unwrap_or(generated.len());
                if let Some(t) = engine.tokenizer()
                    && let Ok(text) = t.decode(&generated[..done], DecodeMode::Clean)
                    && text.len() > sent
                    && text.is_char_boundary(sent)
                    && !text.ends_with('\u{FFFD}')
                {
                    let _ = updates.send(Update::Text(text[sent..].to_string()));
                    sent = text.len();
                }
            });
            match step {
                Ok(None) => {}
                Ok(Some(g)) => {
                    let _ = updates.send(Update::Finished {
                        text: g.text.unwrap_or_default(),
                        tokens_per_s: g.timings.throughput_canvas,
                    });
                    break;
                }
                Err(e) => {
                    let _ = updates.send(Update::Failed(e.to_string()));
                    break;
                }
            }
        }
    }
}

fn main() {
    let model = std::env::args().nth(1).unwrap_or_else(|| {
        if std::path::Path::new("models/tiny").is_dir() {
            "models/tiny".into()
        } else {
            "tests/fixtures/tiny".into()
        }
    });
    let (command_tx, command_rx) = mpsc::channel();
    let (update_tx, update_rx) = mpsc::channel();
    let worker = std::thread::spawn(move || engine_thread(model, command_rx, update_tx));

    let params = GenerationParams {
        gen_length: 32,
        steps: 32,
        block_length: 32,
        ..GenerationParams::default()
    };
    for (question, cancel_after) in [
        ("What is the city of Bella?", None),
        ("Give the record of Peter.", Some(4)),
    ] {
        println!("> {question}");
        let request = Request::chat(Some(SYSTEM.trim()), question)
            .with_params(params.clone())
            .with_cache(CacheMode::BicacheDual);
        let cancel = Arc::new(AtomicBool::new(false));
        let ask = Command::Ask {
            request: Box::new(request),
            cancel: Arc::clone(&cancel),
        };
        if command_tx.send(ask).is_err() {
            break;
        }
        // The UI's event loop: draw each update as it comes.
        for update in update_rx.iter() {
            match update {
                Update::Text(t) => print!("{t}"),
                Update::Step { step, masked } => {
                    if cancel_after == Some(step) {
                        // The user pressed "stop".
                        cancel.store(true, Ordering::Relaxed);
                    }
                    if masked == 0 {
                        eprintln!("  [step {step}: canvas complete]");
                    }
                }
                Update::Finished { text, tokens_per_s } => {
                    println!("\n  [done at {tokens_per_s:.1} tok/s: {text:?}]");
                    break;
                }
                Update::Cancelled { after_steps } => {
                    println!("\n  [cancelled after {after_steps} steps]");
                    break;
                }
                Update::Failed(why) => {
                    eprintln!("error: {why}");
                    break;
                }
            }
        }
    }
    let _ = command_tx.send(Command::Quit);
    let _ = worker.join();
}
