//! Unmask in the browser: a wasm-bindgen API over `unmask::Engine`.
//!
//! ```js
//! import init, { Engine } from "./pkg/unmask_wasm.js";
//! await init();
//! const engine = await Engine.fromUrl("models/tiny/", { weights: "f16" }, p => show(p));
//! const out = await engine.generate(
//!   { system: "...", prompt: "What is 2+3?", genLength: 64, cache: "bicache" },
//!   step => draw(step.pieces, step.masked, step.confidence));
//! ```
//!
//! Weights stream from `fetch` (a model folder's URL) or from `File`s a person picked into
//! GPU buffers as their bytes arrive; the checkpoint is never held in the wasm heap.
//! Everything is async: each denoising step awaits its read-back, so the page keeps
//! drawing while the model runs.

pub mod busy;
pub mod dgemma_mapping;
pub mod mapping;

#[cfg(target_arch = "wasm32")]
mod files;
#[cfg(target_arch = "wasm32")]
mod web;

#[cfg(target_arch = "wasm32")]
pub use files::{PickedFiles, UrlFiles};
/// Files already in memory; the engine crate's, so native tests stream the same way.
pub use unmask::MemoryFiles;
#[cfg(target_arch = "wasm32")]
pub use web::WebEngine;
