//! Unmask: a WebGPU inference runtime for diffusion language models (LLaDA).
//!
//! ```no_run
//! use unmask::{Engine, EngineOptions, Request};
//! let engine = Engine::load("models/tiny", &EngineOptions::default())?;
//! let out = engine.generate(&Request::chat(None, "What is 2+3?"))?;
//! println!("{}", out.text.unwrap_or_default());
//! # Ok::<(), unmask::EngineError>(())
//! ```
//!
//! The `Engine` loads a Hugging Face LLaDA folder onto the GPU and runs the reference
//! sampler (`unmask_core::sampler`) with every forward pass on the GPU
//! (`unmask_gpu::model`): one command encoder per step, 8 bytes read back per sampled row.
//!
//! Generation is one `async` implementation (`Engine::generate_async`): natively the
//! blocking `generate` drives it with `pollster`, polling the device at each read-back; in a
//! browser it is awaited and each read-back yields to the page's event loop. Models load
//! from a directory (`Engine::load`, memory-mapped) or from any `ModelFiles` source that
//! streams the checkpoint (`Engine::load_from`; the browser's fetch or picked files).

// Prefix entries are shared through `Arc` so native callers can use an engine from any
// thread; in a browser wgpu's handles are neither `Send` nor `Sync`, and the one thread
// makes the `Arc` merely a reference count.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use thiserror::Error;
use unmask_core::cache::{PassPlan, PlanInput, plan_step};
use unmask_core::chat::{encode_chat, prefix_split};
use unmask_core::config::LladaConfig;
use unmask_core::depth_policy::{DepthTable, prefix_ratio};
use unmask_core::error::{ConfigError, SamplerError, TokenizerError};
pub use unmask_core::prefix_store::Recount;
use unmask_core::prefix_store::{Pin, PrefixStore, SharedStore, StoreBudget, StoreStats};
use unmask_core::sampler::Sampler;
use unmask_core::step_plan::{SeqStep, StepPlan};
use unmask_core::tokenizer::{SpecialTokens, Tokenizer};
#[cfg(not(target_arch = "wasm32"))]
use unmask_gpu::ContextOptions;
use unmask_gpu::model::{
    BodyStream, CheckpointLayout, ForwardState, LladaModel, ModelError, ShardIndex, WeightUpload,
};
use unmask_gpu::ops::sampling::SelectParams;
use unmask_gpu::{GpuContext, GpuError, StepEncoder};

mod batch;
mod bicache;
mod clock;
mod files;
pub mod profile;

pub use batch::BatchSession;
pub use bicache::PrefixEntry;
pub use clock::Stopwatch;
#[cfg(not(target_arch = "wasm32"))]
pub use files::DirFiles;
pub use files::{MemoryFiles, ModelFiles};
pub use unmask_core::cache::CacheMode;
pub use unmask_core::prefix_store::StoreBudget as CacheBudget;

/// File in a model folder holding its BiCache depth table (r → b), made by `unmask profile`.
pub const DEPTH_TABLE_FILE: &str = "bicache_depth.json";
pub use unmask_core::chat::{Message, Role};
pub use unmask_core::sampler::{GenerationParams, Remasking, StepRecord};
pub use unmask_core::tokenizer::DecodeMode;
pub use unmask_gpu::WeightFormat;
pub use unmask_gpu::model::{LoadProgress, WeightFormats};

/// Anything that can stop a load or a generation.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// A request field or option outside what the engine accepts.
    #[error("{field}: expected {expected}, found {found}")]
    Invalid {
        field: &'static str,
        expected: String,
        found: String,
    },
    #[error("{dir} has no tokenizer.json: give token ids instead of text", dir = dir.display())]
    NoTokenizer { dir: PathBuf },
    /// A batch session cannot take this request, with the reason.
    #[error("{0}")]
    Refused(String),
    /// A step of the batch this request ran in failed; the request stopped with it.
    #[error("stopped with its batch: {0}")]
    BatchStopped(String),
    #[error("{0}")]
    DepthTable(String),
    /// A broken invariant of the runtime: a bug, not bad input.
    #[error("internal error: {0}")]
    Internal(String),
    /// `Engine::inject_fault_after_pin` at work (tests).
    #[error("injected fault after pinning a prefix")]
    InjectedFault,
    #[error("cannot read {location}: {message}")]
    File { location: String, message: String },
}

/// How to load a model.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Backend name (`vulkan`, `metal`, `dx12`, `gl`); `None` honours `WGPU_BACKEND`.
    pub backend: Option<String>,
    /// Weight storage on the GPU; f16 by default (native when the device has shader-f16).
    /// `Q8` / `Q4` quantize the matrices as they load. A checkpoint written by
    /// `unmask quantize` keeps its own formats whatever is asked here.
    pub weight_format: WeightFormat,
    /// Storage of the embedding table and LM head; `None` means `weight_format`.
    pub embed_format: Option<WeightFormat>,
    /// What the BiCache prefix store may hold (tokens and bytes over all entries).
    pub cache_budget: StoreBudget,
    /// Most GPU memory (storage buffers: weights, states, cached prefixes) the engine may
    /// hold; work that would pass it is refused with an error before it is allocated.
    /// `None`: as much as the device gives.
    pub gpu_memory: Option<u64>,
    /// Keep wgpu's runtime bounds checks in the kernels (the default). Natively they may be
    /// turned off (`ContextOptions::runtime_checks`); a browser always checks.
    pub shader_checks: bool,
}

impl EngineOptions {
    /// The storage formats asked for.
    pub fn formats(&self) -> WeightFormats {
        WeightFormats {
            layers: self.weight_format,
            embed: self.embed_format.unwrap_or(self.weight_format),
        }
    }
}

/// Parses a model folder's BiCache depth table (`file` names it in errors).
fn parse_depth_table(text: &str, file: &str) -> Result<DepthTable, EngineError> {
    DepthTable::from_json(text, file).map_err(|e| EngineError::DepthTable(e.to_string()))
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            backend: None,
            weight_format: WeightFormat::F16Native,
            embed_format: None,
            cache_budget: StoreBudget {
                max_tokens: 1 << 16,
                max_bytes: 1 << 30,
            },
            gpu_memory: None,
            shader_checks: true,
        }
    }
}

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// A conversation, rendered with the LLaDA-Instruct chat template.
    Chat(Vec<Message>),
    /// Token ids used as they are (no tokenizer needed).
    Ids(Vec<u32>),
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Prompt,
    pub params: GenerationParams,
    pub decode: DecodeMode,
    /// How K/V are reused between steps.
    pub cache: CacheMode,
    /// Tokens of the shared prefix; `None` takes everything before the last user turn of a
    /// chat prompt (the whole prompt for token ids).
    pub prefix_len: Option<usize>,
    /// Recompute every row at every step whatever the cache mode (a check of the plumbing).
    pub recompute_all: bool,
    /// BiCache depth b (shallow layers reusing the shared entry); `None` looks it up in
    /// the model's depth table.
    pub depth: Option<usize>,
    /// BiCache: steps between deep-prefix refreshes when the request has one block.
    pub refresh_every: usize,
}

impl Request {
    /// A single user turn, with an optional system prompt, and default parameters.
    pub fn chat(system: Option<&str>, user: &str) -> Self {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(Message::system(s));
        }
        messages.push(Message::user(user));
        Self {
            prompt: Prompt::Chat(messages),
            params: GenerationParams::default(),
            decode: DecodeMode::Clean,
            cache: CacheMode::None,
            prefix_len: None,
            recompute_all: false,
            depth: None,
            refresh_every: 16,
        }
    }

    pub fn ids(ids: Vec<u32>) -> Self {
        Self {
            prompt: Prompt::Ids(ids),
            params: GenerationParams::default(),
            decode: DecodeMode::Clean,
            cache: CacheMode::None,
            prefix_len: None,
            recompute_all: false,
            depth: None,
            refresh_every: 16,
        }
    }

    pub fn with_params(mut self, params: GenerationParams) -> Self {
        self.params = params;
        self
    }

    pub fn with_cache(mut self, cache: CacheMode) -> Self {
        self.cache = cache;
        self
    }
}

/// What happened at one step, passed to the step callback.
#[derive(Clone, Debug)]
pub struct StepEvent<'a> {
    pub record: &'a StepRecord,
    /// Steps run so far in this request, counting from 1 (the record's step restarts per block).
    pub global_step: usize,
    /// The whole sequence after the step (prompt, committed tokens, masks).
    pub canvas: &'a [u32],
    pub prompt_len: usize,
    pub mask_id: u32,
    pub elapsed_s: f64,
    /// The positions predicted at this step and each prediction (token, confidence), in
    /// the same order; the committed ones are in `record`.
    pub rows: &'a [u32],
    pub predictions: &'a [(u32, f32)],
}

/// Wall-clock timings of one generation.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Timings {
    /// Encoding and allocating the request's buffers.
    pub setup_s: f64,
    /// From the start of the request to the end of the first step.
    pub first_step_s: f64,
    pub total_s: f64,
    /// Forward passes (NFE); a CFG step counts two.
    pub forward_passes: usize,
    /// Rows × layers computed over all passes (the work a cache saves).
    pub token_layer_passes: usize,
    pub steps: usize,
    /// Generated canvas tokens per second (gen_length / total).
    pub throughput_canvas: f64,
    /// Tokens up to the end of the answer (first EOS/EoT) per second.
    pub throughput_answer: f64,
    /// Generated tokens before the first EOS/EoT.
    pub answer_tokens: usize,
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    /// Tokens of the shared prefix used by prefix caches.
    pub prefix_len: usize,
    pub cache: CacheMode,
    /// The generated canvas (gen_length ids, after the prompt).
    pub ids: Vec<u32>,
    /// Decoded text, when the model has a tokenizer.
    pub text: Option<String>,
    pub steps: Vec<StepRecord>,
    pub timings: Timings,
    /// What BiCache did, for BiCache modes.
    pub bicache: Option<BicacheReport>,
}

/// How a BiCache request used the shared prefix store.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BicacheReport {
    /// Shallow layers that read the shared entry (in a batch, the smallest depth of its
    /// requests).
    pub depth: usize,
    /// The depth this request alone would have used.
    pub requested_depth: usize,
    /// The prefix's share of the request, in percent.
    pub ratio: u32,
    /// The entry was already stored.
    pub hit: bool,
    pub entry_tokens: usize,
    pub entry_bytes: u64,
    /// Requests that ran their steps in the same forward passes (1: alone).
    pub batch: usize,
    /// Why the request ran without BiCache (and which mode it ran instead).
    pub fallback: Option<String>,
}

impl BicacheReport {
    fn fallback(mode: CacheMode, why: String) -> Self {
        Self {
            depth: 0,
            requested_depth: 0,
            ratio: 0,
            hit: false,
            entry_tokens: 0,
            entry_bytes: 0,
            batch: 1,
            fallback: Some(format!("ran as {mode}: {why}")),
        }
    }
}

/// A pinned shared entry in use by one request; the pin goes when this is dropped.
struct PrefixRun {
    _pin: Pin<Arc<PrefixEntry>>,
    entry: Arc<PrefixEntry>,
    /// The boundary state of the run's depth: the entry's, or the run's own when the store
    /// could not take its bytes.
    boundary: Arc<unmask_gpu::Tensor>,
    hit: bool,
}

/// A request ready to run: its tokens, its sampler and how it will use the caches.
struct Prepared<'r> {
    /// Borrowed from the caller, or owned by a `BatchSession`.
    request: std::borrow::Cow<'r, Request>,
    start: Stopwatch,
    prompt: Vec<u32>,
    prefix_len: usize,
    sampler: Sampler,
    conf_exclude: [Option<u32>; 2],
    /// The mode that runs: a BiCache mode that cannot share its prefix falls back.
    mode: CacheMode,
    report: Option<BicacheReport>,
    /// (depth, ratio) of a request that shares its prefix through the store.
    shared: Option<(usize, u32)>,
    timings: Timings,
}

impl Prepared<'_> {
    /// The prompt's shared prefix.
    fn prefix(&self) -> &[u32] {
        &self.prompt[..self.prefix_len]
    }

    /// Why the request does not share a prefix entry: its fallback, or its mode.
    fn why_not_shared(&self) -> String {
        self.report
            .as_ref()
            .and_then(|r| r.fallback.clone())
            .unwrap_or_else(|| format!("cache mode {} is not a BiCache mode", self.mode))
    }

    /// Runs without BiCache: `bicache-dual` as `fast-dllm-dual`, `bicache` as `none`.
    fn fall_back(&mut self, why: String) {
        let mode = if self.mode == CacheMode::BicacheDual {
            CacheMode::FastDllmDual
        } else {
            CacheMode::None
        };
        self.mode = mode;
        self.shared = None;
        self.report = Some(BicacheReport::fallback(mode, why));
    }
}

/// Commits the predictions of `rows` to a request's sampler, counts the step and reports
/// it through `on_step`; `prompt` is (prompt length, mask id) for the event.
fn commit_predictions(
    sampler: &mut Sampler,
    timings: &mut Timings,
    start: Stopwatch,
    prompt: (usize, u32),
    rows: &[u32],
    predictions: &[(u32, f32)],
    on_step: &mut dyn FnMut(&StepEvent<'_>),
) -> Result<StepRecord, EngineError> {
    let record = sampler.commit(predictions)?;
    timings.steps += 1;
    if timings.steps == 1 {
        timings.first_step_s = start.elapsed_s();
    }
    on_step(&StepEvent {
        record: &record,
        global_step: timings.steps,
        canvas: sampler.tokens(),
        prompt_len: prompt.0,
        mask_id: prompt.1,
        elapsed_s: start.elapsed_s(),
        rows,
        predictions,
    });
    Ok(record)
}

/// The results of a set of requests, each of which ran.
fn all_ran(
    results: Vec<Option<Result<Generation, EngineError>>>,
) -> Vec<Result<Generation, EngineError>> {
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(EngineError::Internal("a request did not run".into()))))
        .collect()
}

/// A model loaded on a GPU, ready to generate.
pub struct Engine {
    pub ctx: Arc<GpuContext>,
    pub model: LladaModel,
    pub tokenizer: Option<Tokenizer>,
    pub special: SpecialTokens,
    pub dir: PathBuf,
    pub load_s: f64,
    /// BiCache's shared prefix entries, shared by every request of this engine.
    prefix_store: SharedStore<Arc<PrefixEntry>>,
    /// Test hook: the number of prefix pins still to take before one fails on purpose
    /// (0: never). See `inject_fault_after_pin`.
    fault_countdown: std::sync::atomic::AtomicUsize,
    /// Identity of the weights in the store's keys: unique to this engine, whose weights
    /// never change, so no entry can meet other weights even in a store shared wider.
    model_id: u64,
    /// The model's r → b table, when its folder has one.
    pub depth_table: Option<DepthTable>,
}

impl Engine {
    /// Loads `dir` (config.json, safetensors, optional tokenizer.json).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn load(dir: impl AsRef<Path>, options: &EngineOptions) -> Result<Self, EngineError> {
        Self::load_with_progress(dir, options, &mut |_| {})
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn load_with_progress(
        dir: impl AsRef<Path>,
        options: &EngineOptions,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, EngineError> {
        let dir = dir.as_ref();
        let start = Stopwatch::start();
        let backends = options
            .backend
            .as_deref()
            .map(unmask_gpu::parse_backend)
            .transpose()?;
        let ctx = GpuContext::new(&ContextOptions {
            backends,
            memory_budget: options.gpu_memory,
            runtime_checks: options.shader_checks,
            ..ContextOptions::default()
        })?;
        Self::load_on(ctx, dir, options, progress).map(|mut e| {
            e.load_s = start.elapsed_s();
            e
        })
    }

    /// Loads onto an existing context (several models, or tests sharing one device). The
    /// files are read in pieces (`DirFiles`), not memory-mapped, so a checkpoint truncated
    /// while it loads is a named error.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn load_on(
        ctx: Arc<GpuContext>,
        dir: &Path,
        options: &EngineOptions,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, EngineError> {
        if !dir.is_dir() {
            return Err(EngineError::File {
                location: dir.display().to_string(),
                message: "expected a model folder (config.json, *.safetensors), found no folder"
                    .into(),
            });
        }
        pollster::block_on(Self::load_from(
            ctx,
            &mut DirFiles::new(dir),
            options,
            progress,
        ))
    }

    /// Loads a model whose files come from `files` (a web server, files a person picked, a
    /// directory): the small files whole, then every safetensors header, then each file's
    /// tensors uploaded as their bytes arrive, so the checkpoint is never held in memory.
    pub async fn load_from<F: ModelFiles>(
        ctx: Arc<GpuContext>,
        files: &mut F,
        options: &EngineOptions,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, EngineError> {
        let start = Stopwatch::start();
        let dir = PathBuf::from(files.location(""));
        let config_text = files::read_text(files, "config.json")
            .await?
            .ok_or_else(|| EngineError::File {
                location: files.location("config.json"),
                message: "not found".into(),
            })?;
        let mut cfg = LladaConfig::from_json_str(&config_text)?;
        const GENERATION: &str = "generation_config.json";
        if let Some(text) = files::read_text(files, GENERATION).await? {
            cfg = cfg.with_generation_config(&text, &files.location(GENERATION))?;
        }
        let tokenizer = match files.read("tokenizer.json").await? {
            Some(b) => Some(Tokenizer::from_bytes(&b)?),
            None => None,
        };
        let depth_table = match files::read_text(files, DEPTH_TABLE_FILE).await? {
            Some(text) => Some(parse_depth_table(&text, &files.location(DEPTH_TABLE_FILE))?),
            None => None,
        };
        const INDEX: &str = "model.safetensors.index.json";
        let index = match files::read_text(files, INDEX).await? {
            Some(text) => Some(
                ShardIndex::parse(Path::new(&files.location(INDEX)), &text)
                    .map_err(ModelError::from)?,
            ),
            None => None,
        };
        let names = match &index {
            Some(i) => i.shards.clone(),
            None => vec!["model.safetensors".to_string()],
        };
        let mut headers = Vec::with_capacity(names.len());
        for name in &names {
            headers.push(files::read_header(files, name).await?);
        }
        let layout = match &index {
            Some(i) => CheckpointLayout::sharded(&dir, i, headers).map_err(ModelError::from)?,
            None => CheckpointLayout::single(&dir, headers.remove(0)),
        };
        let mut upload = WeightUpload::plan(&ctx, &cfg, &layout, options.formats(), progress)?;
        for (name, header) in names.iter().zip(&layout.files) {
            let mut body = BodyStream::new(header);
            files
                .stream(name, header.data_start as u64, &mut |piece| {
                    body.push(&mut upload, piece).map_err(EngineError::from)
                })
                .await?;
            body.finish()?;
        }
        let weights = upload.finish()?;
        let model = LladaModel::from_weights(ctx, cfg, weights)?;
        Self::assemble(model, tokenizer, depth_table, &dir, options, start)
    }

    /// The engine around a loaded model: special tokens from the tokenizer (or the config).
    fn assemble(
        model: LladaModel,
        tokenizer: Option<Tokenizer>,
        depth_table: Option<DepthTable>,
        dir: &Path,
        options: &EngineOptions,
        start: Stopwatch,
    ) -> Result<Self, EngineError> {
        let cfg = &model.cfg;
        let special = match &tokenizer {
            Some(t) => t.special_tokens(cfg)?,
            None => SpecialTokens {
                mask: cfg.mask_token_id,
                eos: cfg.eos_token_id,
                bos: cfg.bos_token_id.unwrap_or(cfg.eos_token_id),
                eot: None,
                start_header: None,
                end_header: None,
            },
        };
        Ok(Self {
            ctx: model.ctx.clone(),
            model,
            tokenizer,
            special,
            dir: dir.to_path_buf(),
            load_s: start.elapsed_s(),
            prefix_store: Arc::new(Mutex::new(PrefixStore::new(options.cache_budget))),
            fault_countdown: std::sync::atomic::AtomicUsize::new(0),
            model_id: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
            depth_table,
        })
    }

    pub fn config(&self) -> &LladaConfig {
        &self.model.cfg
    }

    /// The prompt's token ids.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids.clone()),
            Prompt::Chat(messages) => Ok(encode_chat(self.require_tokenizer()?, messages)?),
        }
    }

    fn require_tokenizer(&self) -> Result<&Tokenizer, EngineError> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| EngineError::NoTokenizer {
                dir: self.dir.clone(),
            })
    }

    /// Like `encode_with_prefix`, with the reason when a chat prompt yields no usable prefix.
    fn prompt_and_prefix(
        &self,
        request: &Request,
    ) -> Result<(Vec<u32>, usize, Option<String>), EngineError> {
        let (ids, p) = self.encode_with_prefix(request)?;
        let note = if p > 0 {
            None
        } else if matches!(request.prompt, Prompt::Chat(_)) && request.prefix_len.is_none() {
            Some("the prompt has no turns before its last user turn".to_string())
        } else {
            Some("the shared prefix is empty".to_string())
        };
        Ok((ids, p, note))
    }

    /// The prompt's ids and the length of its shared prefix: an explicit `prefix_len`, else
    /// everything before the last user turn of a chat, else the whole prompt.
    pub fn encode_with_prefix(&self, request: &Request) -> Result<(Vec<u32>, usize), EngineError> {
        let (ids, split) = match &request.prompt {
            Prompt::Chat(messages) if messages.iter().any(|m| m.role == Role::User) => {
                let split = prefix_split(self.require_tokenizer()?, messages)?;
                let at = split.split_at();
                (split.whole, at)
            }
            Prompt::Chat(_) => (self.encode_prompt(&request.prompt)?, 0),
            Prompt::Ids(ids) => (ids.clone(), ids.len()),
        };
        match request.prefix_len {
            Some(p) if p > ids.len() => Err(EngineError::Invalid {
                field: "prefix_len",
                expected: format!("at most the prompt's {} tokens", ids.len()),
                found: p.to_string(),
            }),
            Some(p) => Ok((ids, p)),
            None => Ok((ids, split)),
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate(&self, request: &Request) -> Result<Generation, EngineError> {
        self.generate_with(request, &mut |_| {})
    }

    /// Generates, calling `on_step` with the canvas after every step.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate_with(
        &self,
        request: &Request,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<Generation, EngineError> {
        pollster::block_on(self.generate_async(request, on_step))
    }

    /// Generates, calling `on_step` with the canvas after every step; each step's read-back
    /// is awaited (in a browser the page keeps running meanwhile).
    pub async fn generate_async(
        &self,
        request: &Request,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<Generation, EngineError> {
        let prepared = self.prepare(std::borrow::Cow::Borrowed(request))?;
        if prepared.shared.is_some() {
            let mut out = self
                .run_shared_prefix(vec![prepared], &mut |_, event| on_step(event))
                .await;
            return out.pop().unwrap_or_else(|| {
                Err(EngineError::Internal(
                    "the request produced no result".into(),
                ))
            });
        }
        self.run_alone(prepared, on_step).await
    }

    /// Runs several requests. BiCache requests with the same shared prefix run in the same
    /// forward passes (one weight read per step for all of them; the depth b is the
    /// smallest theirs ask for); the others run one after another. Results come in the
    /// order given, each its own: one request's bad input does not stop the rest.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate_batch(&self, requests: &[Request]) -> Vec<Result<Generation, EngineError>> {
        pollster::block_on(self.generate_batch_async(requests, &mut |_, _| {}))
    }

    /// `generate_batch`, calling `on_step` with the request's index and its step.
    pub async fn generate_batch_async(
        &self,
        requests: &[Request],
        on_step: &mut dyn FnMut(usize, &StepEvent<'_>),
    ) -> Vec<Result<Generation, EngineError>> {
        let mut results: Vec<Option<Result<Generation, EngineError>>> =
            requests.iter().map(|_| None).collect();
        // Requests grouped by their shared prefix, in the order the groups first appear.
        let mut groups: Vec<Vec<(usize, Prepared<'_>)>> = Vec::new();
        let mut alone = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            match self.prepare(std::borrow::Cow::Borrowed(request)) {
                Err(e) => results[i] = Some(Err(e)),
                Ok(p) if p.shared.is_some() => {
                    match groups.iter_mut().find(|g| g[0].1.prefix() == p.prefix()) {
                        Some(g) => g.push((i, p)),
                        None => groups.push(vec![(i, p)]),
                    }
                }
                Ok(p) => alone.push((i, p)),
            }
        }
        // A batch's activations and arenas are single buffers: a group larger than one
        // storage binding allows runs as several batches, one after another.
        let max_rows = self.model.max_state_rows();
        for group in groups {
            let lengths: Vec<usize> = group
                .iter()
                .map(|(_, p)| p.sampler.tokens().len())
                .collect();
            let mut rest = group.into_iter();
            for part in unmask_core::step_plan::split_by_rows(&lengths, max_rows) {
                let (index, prepared): (Vec<usize>, Vec<Prepared<'_>>) =
                    rest.by_ref().take(part.len()).unzip();
                let out = self
                    .run_shared_prefix(prepared, &mut |k, event| on_step(index[k], event))
                    .await;
                for (i, r) in index.into_iter().zip(out) {
                    results[i] = Some(r);
                }
            }
        }
        for (i, p) in alone {
            results[i] = Some(self.run_alone(p, &mut |event| on_step(i, event)).await);
        }
        all_ran(results)
    }

    /// The shared prefix a BiCache request would use and its depth b: what a
    /// `BatchSession` for it needs. The error says why the request cannot share a prefix.
    pub fn shared_prefix(&self, request: &Request) -> Result<(Vec<u32>, usize), EngineError> {
        let p = self.prepare(std::borrow::Cow::Borrowed(request))?;
        match p.shared {
            Some((depth, _)) => Ok((p.prefix().to_vec(), depth)),
            None => Err(EngineError::Refused(p.why_not_shared())),
        }
    }

    /// Tokens, sampler and cache decisions of a request, before any GPU work.
    fn prepare<'r>(
        &self,
        request: std::borrow::Cow<'r, Request>,
    ) -> Result<Prepared<'r>, EngineError> {
        let start = Stopwatch::start();
        let req: &Request = &request;
        let (prompt, prefix_len, prefix_note) = self.prompt_and_prefix(req)?;
        let p = &req.params;
        let cfg = &self.model.cfg;
        let sampler = Sampler::new(
            &prompt,
            p.clone(),
            self.special.mask,
            cfg.max_sequence_length,
        )?;
        if let Some((i, t)) = prompt
            .iter()
            .enumerate()
            .find(|&(_, &t)| t as usize >= cfg.embedding_size)
        {
            return Err(EngineError::Invalid {
                field: "prompt",
                expected: format!("token ids below the vocabulary's {}", cfg.embedding_size),
                found: format!("{t} at position {i}"),
            });
        }
        if let Some(b) = req.depth.filter(|&b| b > cfg.n_layers) {
            return Err(EngineError::Invalid {
                field: "depth",
                expected: format!("at most the model's {} layers", cfg.n_layers),
                found: b.to_string(),
            });
        }
        let cached = req.cache != CacheMode::None && !req.recompute_all;
        if cached && prompt.contains(&self.special.mask) {
            return Err(EngineError::Invalid {
                field: "cache",
                expected: "none for a prompt with masks inside it (infilling): cached modes \
                           predict only the current block"
                    .into(),
                found: req.cache.to_string(),
            });
        }
        let conf_exclude = match (p.confidence_eos_eot_inf, p.temperature == 0.0) {
            // The reference's chained assignment: at T = 0 both EOS and EoT drop out of the
            // confidence softmax; at T > 0 only EoT does (see llada.md §3.1).
            (true, true) => [Some(self.special.eos), self.special.eot],
            (true, false) => [self.special.eot, None],
            (false, _) => [None, None],
        };
        // BiCache needs a shared prefix it can key on; otherwise the request runs with the
        // mode's fallback and the report says why.
        let sharing = if req.cache.is_bicache() && !req.recompute_all {
            let u = prompt.len() - prefix_len;
            Some(if let Some(note) = prefix_note {
                Err(note)
            } else if p.cfg_scale > 0.0 {
                Err("classifier-free guidance masks the prefix, so it cannot be shared".into())
            } else {
                self.bicache_depth(req, prefix_len, u, p.gen_length)
            })
        } else {
            None
        };
        let mode = req.cache;
        let mut prepared = Prepared {
            request,
            start,
            prompt,
            prefix_len,
            sampler,
            conf_exclude,
            mode,
            report: None,
            shared: None,
            timings: Timings::default(),
        };
        match sharing {
            Some(Ok(shared)) => prepared.shared = Some(shared),
            Some(Err(why)) => prepared.fall_back(why),
            None => {}
        }
        Ok(prepared)
    }

    /// Runs a request that shares no prefix entry: every cache mode but BiCache's.
    async fn run_alone(
        &self,
        mut prepared: Prepared<'_>,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<Generation, EngineError> {
        let Prepared {
            request,
            start,
            prompt,
            prefix_len,
            sampler,
            conf_exclude,
            mode,
            timings,
            ..
        } = &mut prepared;
        let (start, prefix_len, conf_exclude, mode) = (*start, *prefix_len, *conf_exclude, *mode);
        let p = &request.params;
        let n_layers = self.model.cfg.n_layers;
        let seq_len = sampler.tokens().len();
        let cond = self.model.new_state(seq_len, seq_len)?;
        let uncond = if p.cfg_scale > 0.0 {
            Some(self.model.new_state(seq_len, seq_len)?)
        } else {
            None
        };
        let sel = self.model.new_select(seq_len)?;
        timings.setup_s = start.elapsed_s();
        let mut records = Vec::new();
        let mut last_block = None;
        while !sampler.is_done() {
            let rows = sampler.rows_to_predict();
            let block_start = last_block != Some(sampler.block_index());
            let first_step = last_block.is_none();
            last_block = Some(sampler.block_index());
            let states: Vec<(&ForwardState, Vec<u32>)> =
                std::iter::once((&cond, sampler.tokens().to_vec()))
                    .chain(uncond.iter().map(|u| (u, sampler.unconditional_tokens())))
                    .collect();
            let planned = plan_step(&PlanInput {
                mode,
                seq_len,
                prefix_len,
                block: sampler.block(),
                block_start,
                first_step,
                recompute_all: request.recompute_all,
            });
            // Without a shared prefix a step is one pass over every layer.
            let single = |pass: &PassPlan, predict: Vec<u32>| {
                let seq = SeqStep {
                    rows: pass.rows.clone(),
                    prefix_len: 0,
                    refresh: false,
                    seq_len,
                    kv_len: pass.kv_len,
                    kv_base: 0,
                    predict,
                };
                StepPlan::alone(&[seq], n_layers)
                    .map_err(|e| EngineError::Internal(format!("cache mode {mode}: {e}")))
            };
            if let Some(w) = &planned.warmup {
                // Its own submit: the main pass rewrites the same ids buffer.
                let plan = single(w, Vec::new())?;
                let mut warm = StepEncoder::new(&self.ctx, "prefix pass");
                for (st, tokens) in &states {
                    let ids = &tokens[w.rows.clone()];
                    self.model
                        .encode_plan(&mut warm, st, None, &plan, ids, None)?;
                    timings.forward_passes += 1;
                }
                warm.submit()?;
            }
            let plan = single(&planned.pass, rows)?;
            let mut step = StepEncoder::new(&self.ctx, "denoise step");
            let mut hidden = Vec::with_capacity(states.len());
            for (st, tokens) in &states {
                let ids = &tokens[planned.pass.rows.clone()];
                hidden.push(
                    self.model
                        .encode_plan(&mut step, st, None, &plan, ids, None)?,
                );
                timings.forward_passes += 1;
            }
            timings.token_layer_passes += planned.token_layer_passes(n_layers) * states.len();
            let (row_index, positions) = plan.sampled_rows();
            self.model.write_select(&sel, &row_index, &positions)?;
            let params = self.select_params(sampler, conf_exclude);
            self.model.encode_select_from(
                &mut step,
                hidden[0],
                hidden.get(1).copied(),
                &sel,
                row_index.len(),
                &params,
            )?;
            let slot = self
                .model
                .read_back_choices(&mut step, &sel, row_index.len());
            let read = step.submit()?.read_async().await?;
            let predictions: Vec<(u32, f32)> = LladaModel::decode_choices(&read[slot])
                .iter()
                .map(|c| (c.token, c.confidence))
                .collect();
            let record = commit_predictions(
                sampler,
                timings,
                start,
                (prompt.len(), self.special.mask),
                &positions,
                &predictions,
                on_step,
            )?;
            records.push(record);
        }
        self.finish(prepared, records)
    }

    /// Commits one step's predictions of a request and reports the step.
    fn commit_step(
        &self,
        p: &mut Prepared<'_>,
        rows: &[u32],
        predictions: &[(u32, f32)],
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<StepRecord, EngineError> {
        commit_predictions(
            &mut p.sampler,
            &mut p.timings,
            p.start,
            (p.prompt.len(), self.special.mask),
            rows,
            predictions,
            on_step,
        )
    }

    /// What the sampler's request asks of the token choice at its current step.
    fn select_params(&self, sampler: &Sampler, conf_exclude: [Option<u32>; 2]) -> SelectParams {
        let p = sampler.params();
        SelectParams {
            temperature: p.temperature,
            cfg_scale: p.cfg_scale,
            seed: p.seed,
            step: sampler.global_step() as u32,
            suppress_token: p.logits_eos_inf.then_some(self.special.eos),
            conf_exclude,
        }
    }

    /// The generation of a request whose sampler is done.
    fn finish(&self, f: Prepared<'_>, records: Vec<StepRecord>) -> Result<Generation, EngineError> {
        let mut timings = f.timings;
        timings.total_s = f.start.elapsed_s();
        let ids = f.sampler.generated().to_vec();
        let stop = |t: &u32| *t == self.special.eos || Some(*t) == self.special.eot;
        timings.answer_tokens = ids.iter().position(stop).unwrap_or(ids.len());
        if timings.total_s > 0.0 {
            timings.throughput_canvas = ids.len() as f64 / timings.total_s;
            timings.throughput_answer = timings.answer_tokens as f64 / timings.total_s;
        }
        let text = match &self.tokenizer {
            Some(t) => Some(t.decode(&ids, f.request.decode)?),
            None => None,
        };
        Ok(Generation {
            prompt_ids: f.prompt,
            prefix_len: f.prefix_len,
            cache: f.request.cache,
            ids,
            text,
            steps: records,
            timings,
            bicache: f.report,
        })
    }

    /// b for a request: the request's own, else the model's depth table at
    /// r = round(100·P/(P+U+G)); an error message when neither exists.
    fn bicache_depth(
        &self,
        request: &Request,
        p: usize,
        u: usize,
        g: usize,
    ) -> Result<(usize, u32), String> {
        let ratio = prefix_ratio(p, u, g);
        let n_layers = self.model.cfg.n_layers;
        if let Some(b) = request.depth {
            // `prepare` refused a depth past the layers.
            return Ok((b, ratio));
        }
        match &self.depth_table {
            Some(t) => Ok((t.depth(ratio).min(n_layers), ratio)),
            None => Err(format!(
                "{} has no {DEPTH_TABLE_FILE}: profile the model (unmask profile) or give the depth explicitly",
                self.dir.display()
            )),
        }
    }

    /// The shared entry for `prefix` (pinned), built on a miss; Ok(Err(why)) when it cannot
    /// be stored and the request must run uncached.
    fn acquire_prefix(
        &self,
        st: &ForwardState,
        prefix: &[u32],
        depth: usize,
        timings: &mut Timings,
    ) -> Result<Result<PrefixRun, String>, EngineError> {
        let n_layers = self.model.cfg.n_layers;
        let found = {
            let mut store = self.store()?;
            store.acquire(self.model_id, prefix).map(|id| {
                let entry = store.payload(id).cloned();
                (Pin::adopt(&self.prefix_store, id), entry)
            })
        };
        if let Some((pin, Some(entry))) = found {
            // From here every return, `?` included, drops `pin` and so releases it.
            self.injected_fault()?;
            let boundary = match entry.boundary(depth) {
                Some(b) => b,
                None => {
                    timings.token_layer_passes += prefix.len() * depth;
                    let b = bicache::compute_boundary(&self.model, st, prefix, depth)?;
                    // Kept in the entry only when the store can charge its bytes; else
                    // this request uses it alone.
                    let mut store = self.store()?;
                    if entry.boundary(depth).is_none()
                        && store.charge(pin.id(), b.size_bytes()).is_ok()
                    {
                        entry.add_boundary(depth, b.clone());
                    }
                    b
                }
            };
            return Ok(Ok(PrefixRun {
                _pin: pin,
                entry,
                boundary,
                hit: true,
            }));
        }
        // Checked before building, so an entry that can never fit costs no GPU work.
        let budget = self.store()?.budget();
        let bytes = bicache::entry_bytes(&self.model, prefix.len());
        if prefix.len() > budget.max_tokens || bytes > budget.max_bytes {
            return Ok(Err(format!(
                "the prefix ({} tokens, {bytes} bytes) exceeds the cache budget ({} tokens, {} bytes)",
                prefix.len(),
                budget.max_tokens,
                budget.max_bytes
            )));
        }
        let entry = Arc::new(bicache::build_entry(&self.model, st, prefix, depth)?);
        timings.token_layer_passes += prefix.len() * n_layers;
        timings.forward_passes += 1;
        let boundary = entry
            .boundary(depth)
            .ok_or_else(|| EngineError::Internal("a new prefix entry lacks its boundary".into()))?;
        let mut store = self.store()?;
        match store.insert(self.model_id, prefix.to_vec(), bytes, entry.clone()) {
            Ok(id) => {
                let pin = Pin::adopt(&self.prefix_store, id);
                drop(store);
                self.injected_fault()?;
                Ok(Ok(PrefixRun {
                    _pin: pin,
                    entry,
                    boundary,
                    hit: false,
                }))
            }
            Err((why, _)) => Ok(Err(why.to_string())),
        }
    }

    /// Makes the `n`-th prefix pin from now fail right after it is taken, as a GPU error
    /// at that point would (0 turns it off): tests use it to show pins never leak.
    #[doc(hidden)]
    pub fn inject_fault_after_pin(&self, n: usize) {
        self.fault_countdown
            .store(n, std::sync::atomic::Ordering::Relaxed);
    }

    fn injected_fault(&self) -> Result<(), EngineError> {
        use std::sync::atomic::Ordering::Relaxed;
        let left = self.fault_countdown.load(Relaxed);
        if left == 0 {
            return Ok(());
        }
        self.fault_countdown.store(left - 1, Relaxed);
        if left == 1 {
            return Err(EngineError::InjectedFault);
        }
        Ok(())
    }

    /// The shared prefix store, locked.
    fn store(
        &self,
    ) -> Result<std::sync::MutexGuard<'_, PrefixStore<Arc<PrefixEntry>>>, EngineError> {
        self.prefix_store
            .lock()
            .map_err(|_| EngineError::Internal("prefix store poisoned".into()))
    }

    /// Counters of the shared prefix store.
    pub fn prefix_store_stats(&self) -> StoreStats {
        self.prefix_store
            .lock()
            .map(|s| s.stats())
            .unwrap_or_default()
    }

    /// The store's entries counted one by one, with the pins held: beside
    /// `prefix_store_stats`, a check that the running counters are true.
    pub fn prefix_store_recount(&self) -> Recount {
        self.prefix_store
            .lock()
            .map(|s| s.recount())
            .unwrap_or_default()
    }

    /// Frees every shared prefix entry not in use (their GPU buffers go with them), so a
    /// benchmark can start each cache mode cold; returns how many entries were dropped.
    pub fn clear_prefix_store(&self) -> usize {
        self.prefix_store
            .lock()
            .map(|mut s| s.clear_unpinned())
            .unwrap_or(0)
    }

    /// The shared entry of `prefix`, if stored (without counting a hit).
    pub fn prefix_entry(&self, prefix: &[u32]) -> Option<Arc<PrefixEntry>> {
        let store = self.prefix_store.lock().ok()?;
        store
            .peek(self.model_id, prefix)
            .and_then(|id| store.payload(id).cloned())
    }
}
