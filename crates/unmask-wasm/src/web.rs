//! The JavaScript API: `Engine.fromUrl`, `Engine.fromFiles`, `engine.generate`, statistics.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::{Arc, Once};

use js_sys::{Array, Function, Object, Promise};
use serde_json::{Value, json};
use unmask::{Engine, EngineError, LoadProgress, MemoryFiles, ModelFiles, Request, StepEvent};
use unmask_gpu::{ContextOptions, GpuContext};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use crate::busy::BusyGuard;
use crate::files::{PickedFiles, UrlFiles};
use crate::mapping::{self, CanvasTracker, Limits};

/// A JSON value as a JavaScript object.
fn to_js(v: &Value) -> JsValue {
    js_sys::JSON::parse(&v.to_string()).unwrap_or(JsValue::NULL)
}

/// How deep `non_finite` looks: a request's numbers are at most three levels down
/// (`messages[0].content` is the deepest field read), an options object's at the top.
const FINITE_DEPTH: usize = 4;

/// A number as JavaScript writes it.
fn js_number(n: f64) -> String {
    match n {
        n if n.is_nan() => "NaN".to_string(),
        n if n > 0.0 => "Infinity".to_string(),
        _ => "-Infinity".to_string(),
    }
}

/// `JSON.stringify` writes NaN and ±Infinity as null, which `mapping` would read as "not
/// given" and replace with the default: they are found first, by their path.
fn non_finite(v: &JsValue, path: &str, depth: usize) -> Result<(), String> {
    if let Some(n) = v.as_f64() {
        if n.is_finite() {
            return Ok(());
        }
        return Err(format!(
            "{path}: expected a finite number, found {}",
            js_number(n)
        ));
    }
    if depth == 0 {
        return Ok(());
    }
    if Array::is_array(v) {
        for (i, item) in v.unchecked_ref::<Array>().iter().enumerate() {
            non_finite(&item, &format!("{path}[{i}]"), depth - 1)?;
        }
    } else if v.is_object() && !v.is_function() {
        for entry in Object::entries(v.unchecked_ref()).iter() {
            let pair: Array = entry.unchecked_into();
            let key = pair.get(0).as_string().unwrap_or_default();
            let path = if path.is_empty() {
                key
            } else {
                format!("{path}.{key}")
            };
            non_finite(&pair.get(1), &path, depth - 1)?;
        }
    }
    Ok(())
}

/// A JavaScript object (or undefined) as JSON; `what` names it in errors.
fn from_js(v: &JsValue, what: &str) -> Result<Value, String> {
    if v.is_undefined() || v.is_null() {
        return Ok(json!({}));
    }
    non_finite(v, "", FINITE_DEPTH)?;
    let text = js_sys::JSON::stringify(v).map_err(|e| {
        let why = e
            .dyn_ref::<js_sys::Error>()
            .map(|e| String::from(e.message()))
            .unwrap_or_else(|| format!("{e:?}"));
        format!("the {what} is not JSON: {why}")
    })?;
    serde_json::from_str(&String::from(text)).map_err(|e| format!("the {what} is not JSON: {e}"))
}

/// A mapping or validation message as a JavaScript `Error` (what a rejected promise holds).
fn js_error(message: &str) -> JsValue {
    JsError::new(message).into()
}

fn engine_error(e: EngineError) -> JsError {
    JsError::new(&e.to_string())
}

/// Rust panics go to the console with their message instead of "unreachable executed".
fn report_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            web_sys::console::error_1(&format!("unmask panicked: {info}").into());
        }));
    });
}

/// The browser's WebGPU device, with `maxBindingBytes` (cap on one storage binding) and
/// `shaderF16: false` (use packed f16 even where the adapter has shader-f16) from `options`.
async fn context(options: &Value) -> Result<Arc<GpuContext>, JsError> {
    let device = mapping::device_options(options).map_err(|e| JsError::new(&e))?;
    let opts = ContextOptions {
        backends: Some(wgpu::Backends::BROWSER_WEBGPU),
        allow_shader_f16: device.shader_f16,
        max_binding_bytes: device.max_binding_bytes,
        ..ContextOptions::default()
    };
    GpuContext::new_async(&opts)
        .await
        .map_err(|e| JsError::new(&e.to_string()))
}

/// A model on the page's GPU.
#[wasm_bindgen(js_name = Engine)]
pub struct WebEngine {
    engine: Rc<Engine>,
    /// One generation at a time (see `BusyGuard`, the only thing that sets it).
    busy: Rc<Cell<bool>>,
}

impl WebEngine {
    /// Loads through any file source; `on_progress` gets `{tensor, done, total}` (bytes).
    pub async fn load<F: ModelFiles>(
        files: &mut F,
        options: JsValue,
        on_progress: Option<Function>,
    ) -> Result<WebEngine, JsError> {
        report_panics();
        let opts = from_js(&options, "options").map_err(|e| JsError::new(&e))?;
        let engine_options = mapping::engine_options(&opts).map_err(|e| JsError::new(&e))?;
        let ctx = context(&opts).await?;
        let mut progress = |p: LoadProgress<'_>| {
            if let Some(f) = &on_progress {
                let v = json!({"tensor": p.tensor, "done": p.done_bytes, "total": p.total_bytes});
                let _ = f.call1(&JsValue::NULL, &to_js(&v));
            }
        };
        let engine = Engine::load_from(ctx, files, &engine_options, &mut progress)
            .await
            .map_err(engine_error)?;
        Ok(WebEngine {
            engine: Rc::new(engine),
            busy: Rc::new(Cell::new(false)),
        })
    }

    /// The engine, for Rust callers (tests).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// A JavaScript request, checked whole against the model before anything is sized
    /// from it: its numbers (`mapping::request`), then its prompt's length with the
    /// canvas (`mapping::fit_prompt`). The prompt is encoded here and again by the
    /// engine; tokenizing is cheap next to one step, and the engine keeps its own way of
    /// finding a chat's shared prefix.
    fn checked_request(engine: &Engine, request: &JsValue) -> Result<Request, String> {
        let limits = Limits::of(engine);
        let r = mapping::request(&from_js(request, "request")?, &limits)?;
        let prompt = engine
            .encode_prompt(&r.prompt)
            .map_err(|e| format!("prompt: {e}"))?;
        mapping::fit_prompt(&r, prompt.len(), &limits)?;
        Ok(r)
    }
}

#[wasm_bindgen(js_class = Engine)]
impl WebEngine {
    /// Loads the model folder at `baseUrl` (config.json, tokenizer.json, model.safetensors
    /// or its index and shards). `options`: `{weights, embedWeights, kv, cacheTokens,
    /// cacheBytes, maxBindingBytes, shaderF16}` (`kv`: "f32" or "f16" K/V storage).
    #[wasm_bindgen(js_name = fromUrl)]
    pub async fn from_url(
        base_url: String,
        options: JsValue,
        on_progress: Option<Function>,
    ) -> Result<WebEngine, JsError> {
        Self::load(&mut UrlFiles::new(&base_url), options, on_progress).await
    }

    /// Loads from `File`s a person picked: config.json, tokenizer.json and the safetensors
    /// files (with model.safetensors.index.json when sharded), found by name; a LLaDA or a
    /// Dream folder (the family comes from config.json; tokenizer_config.json, when picked,
    /// gives the chat template).
    #[wasm_bindgen(js_name = fromFiles)]
    pub async fn from_files(
        files: Array,
        options: JsValue,
        on_progress: Option<Function>,
    ) -> Result<WebEngine, JsError> {
        let mut picked = Vec::new();
        for f in files.iter() {
            picked.push(
                f.dyn_into::<web_sys::File>()
                    .map_err(|_| JsError::new("fromFiles takes an array of File objects"))?,
            );
        }
        Self::load(&mut PickedFiles::new(picked), options, on_progress).await
    }

    /// Loads from bytes already in memory: `files` is an array of `[name, Uint8Array]`.
    #[wasm_bindgen(js_name = fromBytes)]
    pub async fn from_bytes(
        files: Array,
        options: JsValue,
        on_progress: Option<Function>,
    ) -> Result<WebEngine, JsError> {
        let mut list = Vec::new();
        for pair in files.iter() {
            let pair: Array = pair
                .dyn_into()
                .map_err(|_| JsError::new("fromBytes takes [name, Uint8Array] pairs"))?;
            let name = pair.get(0).as_string().unwrap_or_default();
            let bytes = js_sys::Uint8Array::new(&pair.get(1)).to_vec();
            list.push((name, bytes));
        }
        Self::load(&mut MemoryFiles::new(list, 1 << 20), options, on_progress).await
    }

    /// Adapter, features in use, model shape and weight formats.
    pub fn info(&self) -> JsValue {
        to_js(&mapping::engine_info(&self.engine))
    }

    /// Generates. `request`: `{system, prompt}` or `{messages}` or `{ids}`, and
    /// `genLength, steps, blockLength, temperature, remasking, cfgScale, threshold,
    /// logitsEosInf, confidenceEosEotInf, seed, cache, prefixLen, depth, refreshEvery,
    /// decode`. `onStep` gets the canvas after every step (see `CanvasTracker::event`).
    /// Resolves to `{ids, text, cache, timings, bicache, store, ...}`.
    ///
    /// A request the model cannot run rejects with an `Error` naming the field, what it
    /// expected and what it found; the engine stays usable.
    pub fn generate(&self, request: JsValue, on_step: Option<Function>) -> Promise {
        let engine = self.engine.clone();
        let busy = self.busy.clone();
        let checked = Self::checked_request(&engine, &request);
        future_to_promise(async move {
            let request = checked.map_err(|e| js_error(&e))?;
            // Held to the end of this block: every way out, error or not, clears it.
            let _busy = BusyGuard::acquire(&busy)
                .ok_or_else(|| js_error("a generation is already running"))?;
            // Sized by genLength, which `checked_request` bounded by the model's context.
            let mut tracker = CanvasTracker::new(request.params.gen_length);
            let mut each_step = |e: &StepEvent<'_>| {
                if let Some(f) = &on_step {
                    let v = tracker.event(e, engine.tokenizer());
                    let _ = f.call1(&JsValue::NULL, &to_js(&v));
                }
            };
            let g = engine
                .generate_async(&request, &mut each_step)
                .await
                .map_err(|e| JsValue::from(engine_error(e)))?;
            Ok(to_js(&mapping::generation(
                &engine,
                &g,
                request.params.cfg_scale > 0.0,
            )))
        })
    }

    /// Counters of the BiCache prefix store: hits, misses, inserts, evictions, entries...
    #[wasm_bindgen(js_name = cacheStats)]
    pub fn cache_stats(&self) -> JsValue {
        to_js(&mapping::store_stats(&self.engine))
    }

    /// Drops every shared prefix entry not in use; returns how many.
    #[wasm_bindgen(js_name = clearCache)]
    pub fn clear_cache(&self) -> usize {
        self.engine.clear_prefix_store()
    }

    /// The token ids of a chat prompt (`{system, prompt}` or `{messages}`).
    #[wasm_bindgen(js_name = encodePrompt)]
    pub fn encode_prompt(&self, request: JsValue) -> Result<Vec<u32>, JsError> {
        let v = from_js(&request, "request").map_err(|e| JsError::new(&e))?;
        let r = mapping::request(&v, &Limits::of(&self.engine)).map_err(|e| JsError::new(&e))?;
        self.engine.encode_prompt(&r.prompt).map_err(engine_error)
    }
}
