//! The `Engine`: loading a model, its accessors, prompt encoding and the generation entry
//! points.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use unmask_core::chat::ChatFormat;
use unmask_core::config::ModelConfig;
use unmask_core::depth_policy::DepthTable;
use unmask_core::prefix_store::{PrefixStore, SharedStore};
use unmask_core::tokenizer::{SpecialTokens, Tokenizer};
use unmask_gpu::model::{
    BodyStream, CheckpointLayout, LoadProgress, Model, ModelError, ShardIndex, WeightUpload,
};
use unmask_gpu::ops::matmul::MatmulKernel;
use unmask_gpu::{DType, GpuContext};

#[cfg(not(target_arch = "wasm32"))]
use crate::files::DirFiles;
use crate::files::{self, ModelFiles};
use crate::options::parse_depth_table;
use crate::run::Prepared;
use crate::session::PrefixKey;
use crate::{
    DEPTH_TABLE_FILE, EngineError, EngineOptions, Generation, PrefixEntry, Prompt, Request, Role,
    StepEvent, Stopwatch, TextSide,
};

/// A model loaded on a GPU, ready to generate.
pub struct Engine {
    /// The GPU the model lives on (shared with the model).
    pub(crate) ctx: Arc<GpuContext>,
    pub(crate) model: Model,
    /// The tokenizer, chat format and special tokens.
    text: TextSide,
    dir: PathBuf,
    load_s: f64,
    /// BiCache's shared prefix entries, shared by every request of this engine.
    pub(crate) prefix_store: SharedStore<Arc<PrefixEntry>>,
    /// Test hook: the number of prefix pins still to take before one fails on purpose
    /// (0: never). See `inject_fault_after_pin`.
    pub(crate) fault_countdown: std::sync::atomic::AtomicUsize,
    /// Identity of the weights in the store's keys: unique to this engine, whose weights
    /// never change, so no entry can meet other weights even in a store shared wider.
    pub(crate) model_id: u64,
    /// The model's r → b table: its folder's, else the shipped one of a published model
    /// of its shape.
    depth_table: Option<DepthTable>,
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
        let ctx = GpuContext::new(&options.context_options()?)?;
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
        let text = TextSide::read(files).await?;
        let cfg = text.config.clone();
        let depth_table = match files::read_text(files, DEPTH_TABLE_FILE).await? {
            Some(text) => Some(parse_depth_table(&text, &files.location(DEPTH_TABLE_FILE))?),
            None => shipped_depth_table(&cfg),
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
        let model = Model::from_weights(ctx, cfg, weights, &options.kernel_options())?;
        Self::assemble(model, text, depth_table, &dir, options, start)
    }

    /// The engine around a loaded model and its folder's text side.
    fn assemble(
        mut model: Model,
        text: TextSide,
        depth_table: Option<DepthTable>,
        dir: &Path,
        options: &EngineOptions,
        start: Stopwatch,
    ) -> Result<Self, EngineError> {
        model.kv_dtype = match options.kv_dtype {
            DType::F32 => DType::F32,
            DType::F16 if model.cfg.head_dim().is_multiple_of(4) => DType::F16,
            other => {
                return Err(EngineError::Model(ModelError::Input(format!(
                    "K/V storage {other:?} for a head_dim of {}: expected f32, or f16 with a \
                     head_dim that is a multiple of 4",
                    model.cfg.head_dim()
                ))));
            }
        };
        use unmask_gpu::ops::attention::{AttentionKernel, REGISTER_MAX_HEAD_DIM};
        if options.attention_kernel == AttentionKernel::Register
            && model.cfg.head_dim() > REGISTER_MAX_HEAD_DIM
        {
            return Err(EngineError::Model(ModelError::Input(format!(
                "attention kernel register: expected a head_dim of at most \
                 {REGISTER_MAX_HEAD_DIM} (the wide kernels take heads up to 512), found {}",
                model.cfg.head_dim()
            ))));
        }
        Ok(Self {
            ctx: model.ctx.clone(),
            model,
            text,
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

    /// The GPU context the engine runs on.
    pub fn ctx(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    /// The model on the GPU: its weights, configuration and forward passes.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Picks the matmul kernel of every forward pass from now on (tests and benchmarks
    /// compare kernels; `MatmulKernel::Auto` is the default).
    pub fn set_matmul_kernel(&mut self, kernel: MatmulKernel) {
        self.model.set_matmul_kernel(kernel);
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    /// The model folder's tokenizer; `None` when it has no tokenizer.json (token ids only).
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.text.tokenizer.as_ref()
    }

    /// The special token ids (mask, EOS, BOS, EoT, chat headers), from the tokenizer or,
    /// without one, from the config.
    pub fn special(&self) -> &SpecialTokens {
        &self.text.special
    }

    /// Where the model was loaded from: its folder, or the location of its files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Seconds the load took (device setup included for `load` and `load_with_progress`).
    pub fn load_s(&self) -> f64 {
        self.load_s
    }

    /// The model's BiCache depth table (r → b): its folder's (`DEPTH_TABLE_FILE`), else the
    /// one shipped in `crates/unmask-core/policies/` when the model has a published model's shape
    /// (LLaDA-8B-Instruct, Dream-v0-Instruct-7B).
    pub fn depth_table(&self) -> Option<&DepthTable> {
        self.depth_table.as_ref()
    }

    /// The prompt's token ids.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        self.text.encode_prompt(prompt)
    }

    /// What a `RequestSpec` is checked against on this model.
    pub fn spec_limits(&self) -> crate::SpecLimits {
        crate::SpecLimits {
            context: self.model.cfg.max_sequence_length,
            layers: self.model.cfg.n_layers,
            vocab: self.model.cfg.embedding_size,
        }
    }

    /// The top_k a request with `params` runs with: its own, else the model's default
    /// (Dream's reference cuts to 50: `ModelConfig::default_top_k`; not with guidance,
    /// which takes no cut); `None` when nothing is cut, as with a k that keeps the whole
    /// vocabulary (how a caller asks for no cut).
    pub fn effective_top_k(&self, params: &crate::GenerationParams) -> Option<u32> {
        let cfg = &self.model.cfg;
        let k = match params.top_k {
            None if params.cfg_scale == 0.0 => cfg.default_top_k,
            k => k,
        };
        k.filter(|&k| (k as usize) < cfg.embedding_size)
    }

    /// How chat prompts are laid out (the model's template).
    pub fn chat_format(&self) -> &ChatFormat {
        &self.text.chat
    }

    /// `text`'s token ids as the tokenizer gives them: no chat template, no special token
    /// spelled in the text (an infilling suffix, a completion prompt).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        Ok(self.require_tokenizer()?.encode(text)?)
    }

    pub(crate) fn require_tokenizer(&self) -> Result<&Tokenizer, EngineError> {
        self.text.require_tokenizer()
    }

    /// Like `encode_with_prefix`, with the reason when a chat prompt yields no usable prefix.
    pub(crate) fn prompt_and_prefix(
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
                let split = self
                    .text
                    .chat
                    .prefix_split(self.require_tokenizer()?, messages)?;
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
        let prepared = self.prepare(std::borrow::Cow::Owned(request.clone()))?;
        self.run_one(prepared, on_step).await
    }

    /// Runs several requests. BiCache requests with the same shared prefix run in one
    /// session, in the same forward passes (one weight read per step for all of them; the
    /// depth b is the smallest theirs ask for); the others run one after another, each
    /// exactly as `generate` runs it. Results come in the order given, each its own: one
    /// request's bad input does not stop the rest.
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
        let mut groups: Vec<Vec<(usize, Prepared<'static>)>> = Vec::new();
        let mut alone = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            match self.prepare(std::borrow::Cow::Owned(request.clone())) {
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
        // A session's activations and arenas are single buffers: a group larger than one
        // storage binding allows runs as several sessions, one after another.
        let max_rows = self.model.max_state_rows();
        for group in groups {
            let lengths: Vec<usize> = group
                .iter()
                .map(|(_, p)| p.sampler.tokens().len())
                .collect();
            let mut rest = group.into_iter();
            for part in unmask_core::step_plan::split_by_rows(&lengths, max_rows) {
                let (index, prepared): (Vec<usize>, Vec<Prepared<'static>>) =
                    rest.by_ref().take(part.len()).unzip();
                let key = PrefixKey {
                    tokens: prepared[0].prefix().to_vec(),
                    depth: prepared
                        .iter()
                        .filter_map(|p| p.shared)
                        .map(|s| s.0)
                        .min()
                        .unwrap_or(0),
                };
                let out = self
                    .run_together(Some(key), prepared, &mut |k, event| {
                        on_step(index[k], event)
                    })
                    .await;
                for (i, r) in index.into_iter().zip(out) {
                    results[i] = Some(r);
                }
            }
        }
        for (i, p) in alone {
            results[i] = Some(self.run_one(p, &mut |event| on_step(i, event)).await);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(EngineError::Internal("a request did not run".into())))
            })
            .collect()
    }

    /// The shared prefix a BiCache request would use and its depth b: what a `Session`
    /// for it needs. The error says why the request cannot share a prefix.
    pub fn shared_prefix(&self, request: &Request) -> Result<PrefixKey, EngineError> {
        let p = self.prepare(std::borrow::Cow::Borrowed(request))?;
        match p.shared {
            Some((depth, _)) => Ok(PrefixKey {
                tokens: p.prefix().to_vec(),
                depth,
            }),
            None => Err(crate::Refusal::NotShared(p.why_not_shared()).into()),
        }
    }
}

/// The depth table shipped for the published model whose shape `cfg` has.
fn shipped_depth_table(cfg: &ModelConfig) -> Option<DepthTable> {
    cfg.family.shipped_depth_table(cfg.n_layers, cfg.d_model)
}
