//! The JavaScript API: `Engine.fromUrl`, `Engine.fromFiles`, `engine.generate`, statistics.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::{Arc, Once};

use js_sys::{Array, Function, Object, Promise};
use serde_json::{Value, json};
use unmask::{
    DgemmaEngine, DgemmaRequest, Engine, EngineError, LoadProgress, MemoryFiles, ModelFiles,
    Request, StepEvent, is_diffusion_gemma_config,
};
use unmask_gpu::dgemma::StepReport;
use unmask_gpu::{ContextOptions, GpuContext};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use crate::busy::BusyGuard;
use crate::dgemma_mapping;
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

/// The loaded model, by family: the masked-diffusion engine (LLaDA, Dream) or
/// DiffusionGemma's.
enum Loaded {
    Masked(Rc<Engine>),
    Gemma(Rc<DgemmaEngine>),
}

/// A model on the page's GPU.
#[wasm_bindgen(js_name = Engine)]
pub struct WebEngine {
    loaded: Loaded,
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
        let config = files.read("config.json").await.map_err(engine_error)?;
        let gemma = config
            .as_deref()
            .and_then(|b| std::str::from_utf8(b).ok())
            .is_some_and(is_diffusion_gemma_config);
        if gemma {
            let engine = DgemmaEngine::load_from(ctx, files, &engine_options)
                .await
                .map_err(engine_error)?;
            return Ok(WebEngine {
                loaded: Loaded::Gemma(Rc::new(engine)),
                busy: Rc::new(Cell::new(false)),
            });
        }
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
            loaded: Loaded::Masked(Rc::new(engine)),
            busy: Rc::new(Cell::new(false)),
        })
    }

    /// The masked-diffusion engine, for Rust callers (tests); `None` for DiffusionGemma.
    pub fn engine(&self) -> Option<&Engine> {
        match &self.loaded {
            Loaded::Masked(e) => Some(e),
            Loaded::Gemma(_) => None,
        }
    }

    /// The DiffusionGemma engine; `None` for the other families.
    pub fn dgemma(&self) -> Option<&DgemmaEngine> {
        match &self.loaded {
            Loaded::Gemma(e) => Some(e),
            Loaded::Masked(_) => None,
        }
    }

    /// A DiffusionGemma request, checked whole before anything runs: its fields and
    /// numbers, then whether its prompt and canvases fit the model's positions.
    fn checked_dgemma(engine: &DgemmaEngine, request: &JsValue) -> Result<DgemmaRequest, String> {
        let r = dgemma_mapping::request(
            &from_js(request, "request")?,
            &dgemma_mapping::limits(engine),
        )?;
        let (ids, _) = engine
            .encode_prompt(&r.prompt)
            .map_err(|e| format!("prompt: {e}"))?;
        dgemma_mapping::fit_prompt(&r, ids.len(), engine)?;
        Ok(r)
    }

    fn generate_dgemma(
        &self,
        engine: Rc<DgemmaEngine>,
        request: JsValue,
        on_step: Option<Function>,
    ) -> Promise {
        let busy = self.busy.clone();
        let checked = Self::checked_dgemma(&engine, &request);
        future_to_promise(async move {
            let request = checked.map_err(|e| js_error(&e))?;
            let _busy = BusyGuard::acquire(&busy)
                .ok_or_else(|| js_error("a generation is already running"))?;
            let mut tracker = dgemma_mapping::StepTracker::new();
            // `onStep` returning `false` stops the generation there.
            let mut each_step = |r: StepReport<'_>| {
                if let Some(f) = &on_step {
                    let v = tracker.event(&r, engine.tokenizer());
                    let answer = f.call1(&JsValue::NULL, &to_js(&v));
                    if answer.is_ok_and(|a| a.as_bool() == Some(false)) {
                        return std::ops::ControlFlow::Break(());
                    }
                }
                std::ops::ControlFlow::Continue(())
            };
            let out = engine
                .generate_async(&request, &mut each_step)
                .await
                .map_err(|e| JsValue::from(engine_error(e)))?;
            Ok(to_js(&dgemma_mapping::generation(&engine, &out)))
        })
    }

    /// A JavaScript request, checked whole against the model before anything is sized
    /// from it: its numbers (`mapping::request`), then its prompt's length with the
    /// canvas (`mapping::fit_prompt`). The prompt is encoded here and again by the
    /// engine; tokenizing is cheap next to one step, and the engine keeps its own way of
    /// finding a chat's shared prefix.
    fn checked_request(engine: &Engine, request: &JsValue) -> Result<Request, String> {
        let limits = Limits::of(engine);
        let obj = from_js(request, "request")?;
        let mut r = mapping::request(&obj, &limits)?;
        r.suffix = match mapping::suffix(&obj, &limits)? {
            None => Vec::new(),
            Some(mapping::SuffixInput::Ids(ids)) => ids,
            Some(mapping::SuffixInput::Text(text)) => engine
                .encode_text(&text)
                .map_err(|e| format!("suffix: {e}"))?,
        };
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

    /// Adapter, features in use, model shape and weight formats; `family` is
    /// "diffusion_gemma" for DiffusionGemma (whose requests take other settings).
    pub fn info(&self) -> JsValue {
        match &self.loaded {
            Loaded::Masked(e) => to_js(&mapping::engine_info(e)),
            Loaded::Gemma(e) => to_js(&dgemma_mapping::engine_info(e)),
        }
    }

    /// Generates. `request`: `{system, prompt}` or `{messages}` or `{ids}`, and
    /// `genLength, steps, blockLength, temperature, remasking, cfgScale, threshold,
    /// logitsEosInf, confidenceEosEotInf, seed, cache, prefixLen, depth, refreshEvery,
    /// decode, logprobs, topLogprobs`. `onStep` gets the canvas after every step (see
    /// `CanvasTracker::event`). Resolves to `{ids, text, cache, timings, bicache, store,
    /// ...}`, with `logprobs` (and `topLogprobs`) per canvas position when asked for.
    ///
    /// A request the model cannot run rejects with an `Error` naming the field, what it
    /// expected and what it found; the engine stays usable.
    ///
    /// DiffusionGemma: `{system, prompt}` or `{messages}` or `{ids}`, and `genLength, steps,
    /// seed, shareSystem`; any other field is refused. `onStep` gets each denoising step
    /// shaped like the above (the argmax canvas, accepted positions as committed, the rest
    /// as masked); `onStep` returning `false` stops the generation there (the promise
    /// rejects: `cancelled after N denoising steps`). Resolves to `{ids, text, canvases,
    /// prefix, store, timings}`; each canvas carries its output tokens' log-probabilities.
    pub fn generate(&self, request: JsValue, on_step: Option<Function>) -> Promise {
        let engine = match &self.loaded {
            Loaded::Masked(e) => e.clone(),
            Loaded::Gemma(e) => return self.generate_dgemma(e.clone(), request, on_step),
        };
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
                request.top_logprobs,
            )))
        })
    }

    /// Scores `answers` after a prompt by LLaDA's Monte Carlo estimate of their
    /// log-likelihood, as `unmask score` does: `{system, prompt}`, `{messages}` or `{ids}`
    /// (`ids: []`: no prompt, the answer's own likelihood); `answers: [text | ids, ...]`
    /// (text tokenized as it is: a chat prompt ends with the assistant's header, so an
    /// answer is scored as the reply); `rolling` (answers of any length, scored in windows
    /// of the context and summed); `mcNum` (128), `mcBatch` (16, or `mcNum` when smaller),
    /// `cfgScale`, `seed`, `passSamples`. Resolves to
    /// `{promptTokens, answers: [{index, logLikelihood, standardError, tokens, windows, perToken,
    /// forwardPasses, totalS}], best}`. DiffusionGemma rejects it.
    pub fn score(&self, request: JsValue) -> Promise {
        let engine = match &self.loaded {
            Loaded::Masked(e) => e.clone(),
            Loaded::Gemma(_) => {
                return Promise::reject(&js_error(
                    "score: DiffusionGemma's decoder denoises whole canvases with \
                     self-conditioning; the masked-token estimate is defined for LLaDA and Dream \
                     models",
                ));
            }
        };
        let busy = self.busy.clone();
        let checked = from_js(&request, "request")
            .and_then(|v| mapping::score::score_request(&v, &Limits::of(&engine)));
        future_to_promise(async move {
            let request = checked.map_err(|e| js_error(&e))?;
            let _busy = BusyGuard::acquire(&busy)
                .ok_or_else(|| js_error("a generation is already running"))?;
            let prompt = engine
                .encode_prompt(&request.prompt)
                .map_err(|e| JsValue::from(engine_error(e)))?;
            let mut estimates = Vec::with_capacity(request.answers.len());
            for (i, answer) in request.answers.iter().enumerate() {
                let named = |e: EngineError| js_error(&format!("answers[{i}]: {e}"));
                let ids = match answer {
                    mapping::score::AnswerInput::Ids(ids) => ids.clone(),
                    mapping::score::AnswerInput::Text(t) => engine.encode_text(t).map_err(named)?,
                };
                let estimate = if request.rolling {
                    engine
                        .log_likelihood_rolling_async(&prompt, &ids, &request.params)
                        .await
                } else {
                    engine
                        .log_likelihood_async(&prompt, &ids, &request.params)
                        .await
                };
                let estimate = estimate.map_err(|e| match e {
                    EngineError::Invalid {
                        field: "answer", ..
                    } => named(e),
                    e => JsValue::from(engine_error(e)),
                })?;
                estimates.push(estimate);
            }
            Ok(to_js(&mapping::score::scores(prompt.len(), &estimates)))
        })
    }

    /// Counters of the BiCache prefix store: hits, misses, inserts, evictions, entries...
    #[wasm_bindgen(js_name = cacheStats)]
    pub fn cache_stats(&self) -> JsValue {
        match &self.loaded {
            Loaded::Masked(e) => to_js(&mapping::store_stats(e)),
            Loaded::Gemma(e) => to_js(&dgemma_mapping::store_stats(e)),
        }
    }

    /// Drops every shared prefix entry not in use; returns how many.
    #[wasm_bindgen(js_name = clearCache)]
    pub fn clear_cache(&self) -> usize {
        match &self.loaded {
            Loaded::Masked(e) => e.clear_prefix_store(),
            Loaded::Gemma(e) => e.clear_prefix_store(),
        }
    }

    /// The token ids of a chat prompt (`{system, prompt}` or `{messages}`).
    #[wasm_bindgen(js_name = encodePrompt)]
    pub fn encode_prompt(&self, request: JsValue) -> Result<Vec<u32>, JsError> {
        let v = from_js(&request, "request").map_err(|e| JsError::new(&e))?;
        match &self.loaded {
            Loaded::Masked(e) => {
                let r = mapping::request(&v, &Limits::of(e)).map_err(|e| JsError::new(&e))?;
                e.encode_prompt(&r.prompt).map_err(engine_error)
            }
            Loaded::Gemma(e) => {
                let r = dgemma_mapping::request(&v, &dgemma_mapping::limits(e))
                    .map_err(|e| JsError::new(&e))?;
                Ok(e.encode_prompt(&r.prompt).map_err(engine_error)?.0)
            }
        }
    }

    /// The text of token ids, special tokens left out: `decode([id])` spells an
    /// alternative of `topLogprobs` (a token may hold part of a character).
    pub fn decode(&self, ids: Vec<u32>) -> Result<String, JsError> {
        let tokenizer = match &self.loaded {
            Loaded::Masked(e) => e.tokenizer(),
            Loaded::Gemma(e) => e.tokenizer(),
        }
        .ok_or_else(|| JsError::new("decode: this model was loaded without tokenizer.json"))?;
        tokenizer
            .decode(&ids, unmask::DecodeMode::Raw)
            .map_err(|e| JsError::new(&format!("decode: {e}")))
    }
}
