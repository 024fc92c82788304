//! The JavaScript API: `Engine.fromUrl`, `Engine.fromFiles`, `engine.generate`, statistics.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::{Arc, Once};

use js_sys::{Array, Function, Promise};
use serde_json::{Value, json};
use unmask::{Engine, EngineError, LoadProgress, MemoryFiles, ModelFiles, StepEvent};
use unmask_gpu::{ContextOptions, GpuContext};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use crate::files::{PickedFiles, UrlFiles};
use crate::mapping::{self, CanvasTracker};

/// A JSON value as a JavaScript object.
fn to_js(v: &Value) -> JsValue {
    js_sys::JSON::parse(&v.to_string()).unwrap_or(JsValue::NULL)
}

/// A JavaScript object (or undefined) as JSON.
fn from_js(v: &JsValue) -> Result<Value, JsError> {
    if v.is_undefined() || v.is_null() {
        return Ok(json!({}));
    }
    let text = js_sys::JSON::stringify(v).map_err(|_| JsError::new("the value is not JSON"))?;
    serde_json::from_str(&String::from(text)).map_err(|e| JsError::new(&e.to_string()))
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
    let opts = ContextOptions {
        backends: Some(wgpu::Backends::BROWSER_WEBGPU),
        allow_shader_f16: options.get("shaderF16").and_then(Value::as_bool) != Some(false),
        max_binding_bytes: options.get("maxBindingBytes").and_then(Value::as_u64),
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
    /// One generation at a time: they would share the device queue and the prefix store.
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
        let opts = from_js(&options)?;
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
}

#[wasm_bindgen(js_class = Engine)]
impl WebEngine {
    /// Loads the model folder at `baseUrl` (config.json, tokenizer.json, model.safetensors
    /// or its index and shards). `options`: `{weights, embedWeights, cacheTokens,
    /// cacheBytes, maxBindingBytes, shaderF16}`.
    #[wasm_bindgen(js_name = fromUrl)]
    pub async fn from_url(
        base_url: String,
        options: JsValue,
        on_progress: Option<Function>,
    ) -> Result<WebEngine, JsError> {
        Self::load(&mut UrlFiles::new(&base_url), options, on_progress).await
    }

    /// Loads from `File`s a person picked: config.json, tokenizer.json and the safetensors
    /// files (with model.safetensors.index.json when sharded), found by name.
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
    pub fn generate(&self, request: JsValue, on_step: Option<Function>) -> Promise {
        let engine = self.engine.clone();
        let busy = self.busy.clone();
        let parsed =
            from_js(&request).and_then(|v| mapping::request(&v).map_err(|e| JsError::new(&e)));
        future_to_promise(async move {
            let request = parsed.map_err(JsValue::from)?;
            if busy.replace(true) {
                return Err(JsError::new("a generation is already running").into());
            }
            let mut tracker = CanvasTracker::new(request.params.gen_length);
            let mut each_step = |e: &StepEvent<'_>| {
                if let Some(f) = &on_step {
                    let v = tracker.event(e, engine.tokenizer.as_ref());
                    let _ = f.call1(&JsValue::NULL, &to_js(&v));
                }
            };
            let result = engine.generate_async(&request, &mut each_step).await;
            busy.set(false);
            let g = result.map_err(|e| JsValue::from(engine_error(e)))?;
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
        let v = from_js(&request)?;
        let r = mapping::request(&v).map_err(|e| JsError::new(&e))?;
        self.engine.encode_prompt(&r.prompt).map_err(engine_error)
    }
}
