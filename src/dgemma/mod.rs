//! DiffusionGemma behind one engine: the model, its tokenizer and Gemma 4's chat layout,
//! the sampler settings of `generation_config.json` and a shared prefix store, loaded from a
//! directory or any `ModelFiles` source (a page's downloads). Generation is one `async`
//! implementation; natively `generate` blocks on it.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use unmask_core::checkpoint::Checkpoint;
use unmask_core::config::{DiffusionGemmaConfig, entropy_bound_params};
use unmask_core::prefix_store::StoreStats;
use unmask_core::sampler::entropy_bound::EntropyBoundParams;
use unmask_core::tokenizer::Tokenizer;
use unmask_gpu::dgemma::{DgemmaModel, DgemmaPrefixStore, GeneratedCanvas, PrefixUse, StepReport};
use unmask_gpu::model::{ModelError, WeightFormats};
use unmask_gpu::{DType, GpuContext, WeightFormat};

use crate::clock::Stopwatch;
use crate::files::{self, ModelFiles};
use crate::{CacheBudget, EngineError, EngineOptions, Prompt};

mod tasks;
mod text_side;

pub use tasks::DgemmaTask;
pub use text_side::{DgemmaTextSide, encode_chat as encode_gemma_chat};

/// Positions a model's RoPE tables and caches cover when its config names no smaller limit:
/// the prompt and every canvas of one request.
pub const DEFAULT_POSITIONS: usize = 32_768;

/// One request: the prompt and what may differ from `generation_config.json`.
#[derive(Clone, Debug)]
pub struct DgemmaRequest {
    pub prompt: Prompt,
    /// The stream of the canvases' and the sampler's random draws.
    pub seed: u64,
    pub max_new_tokens: Option<usize>,
    pub max_denoising_steps: Option<usize>,
    /// Take a chat prompt's system turn through the shared prefix store.
    pub share_system: bool,
    /// Take the whole prompt through the store too: requests that share all of it (the
    /// choices of one request) encode it once, and the others copy its K/V.
    pub share_prompt: bool,
    /// OpenAI's `logit_bias`: (id, bias from -100 to 100) pairs added to every canvas row's
    /// logits before the sampler reads them, so its draws, argmax, entropies and
    /// self-conditioning all see the biased distribution.
    pub logit_bias: Vec<(u32, f32)>,
}

impl DgemmaRequest {
    pub fn new(prompt: Prompt) -> Self {
        Self {
            prompt,
            seed: 0,
            max_new_tokens: None,
            max_denoising_steps: None,
            share_system: true,
            share_prompt: false,
            logit_bias: Vec::new(),
        }
    }
}

/// What a generation gives back.
#[derive(Clone, Debug)]
pub struct DgemmaOutput {
    pub prompt_ids: Vec<u32>,
    /// The answer's ids: every canvas, pad after the first eos.
    pub ids: Vec<u32>,
    /// Decoded without special tokens; `None` without a tokenizer.
    pub text: Option<String>,
    pub canvases: Vec<GeneratedCanvas>,
    /// What the prefix store did with the system turn (`None`: not asked).
    pub prefix: Option<PrefixUse>,
    pub seconds: f64,
}

impl DgemmaOutput {
    /// Each answer token's log-probability under the model's untempered softmax at its
    /// canvas's last step, aligned with `ids` (pad after an eos keeps the value of the
    /// token it replaced).
    pub fn logprobs(&self) -> Vec<f32> {
        self.canvases
            .iter()
            .flat_map(|c| c.logprobs.iter().copied())
            .collect()
    }
}

/// A DiffusionGemma model on the GPU, ready for requests.
pub struct DgemmaEngine {
    ctx: Arc<GpuContext>,
    model: DgemmaModel,
    tokenizer: Option<Tokenizer>,
    params: EntropyBoundParams,
    /// The matrices' storage as resolved on this device, the token table's apart
    /// (`--embed-weights`).
    formats: WeightFormats,
    /// Locked while a system turn is copied or stored (never across an await).
    store: Mutex<DgemmaPrefixStore>,
    dir: PathBuf,
    load_s: f64,
}

/// Whether `config.json`'s text is DiffusionGemma's (text that is not a JSON object is not).
pub fn is_diffusion_gemma_config(text: &str) -> bool {
    serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| v.as_object().map(DiffusionGemmaConfig::is_diffusion_gemma))
        .unwrap_or(false)
}

/// `text_config.max_position_embeddings` (or the top level's), capped at `DEFAULT_POSITIONS`.
fn max_positions(config: &str) -> usize {
    let v: Value = serde_json::from_str(config).unwrap_or(Value::Null);
    let limit = v
        .get("text_config")
        .and_then(|t| t.get("max_position_embeddings"))
        .or_else(|| v.get("max_position_embeddings"))
        .and_then(Value::as_u64);
    limit.map_or(DEFAULT_POSITIONS, |l| (l as usize).min(DEFAULT_POSITIONS))
}

/// The small files both loaders read: config, sampler settings, tokenizer.
struct SmallFiles {
    cfg: DiffusionGemmaConfig,
    positions: usize,
    params: EntropyBoundParams,
    tokenizer: Option<Tokenizer>,
}

async fn read_small_files<F: ModelFiles>(files: &mut F) -> Result<SmallFiles, EngineError> {
    let config = files::read_text(files, "config.json")
        .await?
        .ok_or_else(|| EngineError::File {
            location: files.location("config.json"),
            message: "not found".into(),
        })?;
    let cfg = DiffusionGemmaConfig::from_json_str(&config, &files.location("config.json"))
        .map_err(ModelError::from)?;
    const GENERATION: &str = "generation_config.json";
    let params = match files::read_text(files, GENERATION).await? {
        Some(text) => {
            entropy_bound_params(&text, &files.location(GENERATION)).map_err(ModelError::from)?
        }
        None => EntropyBoundParams::default(),
    };
    let tokenizer = match files::read_small(files, "tokenizer.json").await? {
        Some(b) => Some(Tokenizer::from_bytes(&b)?),
        None => None,
    };
    Ok(SmallFiles {
        positions: max_positions(&config).max(cfg.canvas_length + 1),
        cfg,
        params,
        tokenizer,
    })
}

/// Every safetensors file whole (the index's shards, or `model.safetensors`).
async fn read_checkpoint<F: ModelFiles>(files: &mut F) -> Result<Checkpoint, EngineError> {
    const INDEX: &str = "model.safetensors.index.json";
    let index = files::read_text(files, INDEX).await?;
    let names: Vec<String> = match &index {
        Some(text) => {
            unmask_core::checkpoint::ShardIndex::parse(Path::new(&files.location(INDEX)), text)
                .map_err(ModelError::from)?
                .shards
        }
        None => vec!["model.safetensors".to_string()],
    };
    let mut whole = Vec::with_capacity(names.len());
    for name in names {
        let mut bytes = Vec::new();
        files
            .stream(&name, 0, &mut |piece| {
                bytes.extend_from_slice(piece);
                Ok(())
            })
            .await?;
        whole.push((name, bytes));
    }
    let location = files.location(INDEX);
    Ok(
        Checkpoint::from_bytes(whole, index.as_deref().map(|t| (location.as_str(), t)))
            .map_err(ModelError::from)?,
    )
}

impl DgemmaEngine {
    /// Loads a folder: the small files, then the tensors read from disk as they upload.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn load(dir: impl AsRef<Path>, options: &EngineOptions) -> Result<Self, EngineError> {
        let start = Stopwatch::start();
        let dir = dir.as_ref();
        let ctx = GpuContext::new(&options.context_options()?)?;
        let small = pollster::block_on(read_small_files(&mut crate::DirFiles::new(dir)))?;
        let ck = Checkpoint::open(dir).map_err(ModelError::from)?;
        Self::assemble(ctx, small, &ck, dir, options, start)
    }

    /// Loads from any file source, each safetensors file held whole in memory while its
    /// tensors upload (sizes a page can hold; a folder on disk loads with `load`).
    pub async fn load_from<F: ModelFiles>(
        ctx: Arc<GpuContext>,
        files: &mut F,
        options: &EngineOptions,
    ) -> Result<Self, EngineError> {
        let start = Stopwatch::start();
        let small = read_small_files(files).await?;
        let ck = read_checkpoint(files).await?;
        let dir = PathBuf::from(files.location(""));
        Self::assemble(ctx, small, &ck, &dir, options, start)
    }

    fn assemble(
        ctx: Arc<GpuContext>,
        small: SmallFiles,
        ck: &Checkpoint,
        dir: &Path,
        options: &EngineOptions,
        start: Stopwatch,
    ) -> Result<Self, EngineError> {
        let format = options.weight_format.resolve(&ctx);
        let formats = WeightFormats {
            layers: format,
            embed: options.embed_format.map_or(format, |f| f.resolve(&ctx)),
        };
        let mut model =
            DgemmaModel::from_checkpoint(&ctx, small.cfg, ck, formats, small.positions)?;
        // The kernels asked for, and `--tune`'s measured choice of `Auto` on a GPU.
        model.kernels = unmask_gpu::ops::Kernels::new(&ctx, &options.kernel_options());
        let dims_of_4 = model
            .cfg
            .layers
            .iter()
            .all(|a| a.head_dim.is_multiple_of(4));
        model.kv_dtype = match options.kv_dtype {
            DType::F32 => DType::F32,
            DType::F16 if dims_of_4 => DType::F16,
            other => {
                return Err(EngineError::Model(ModelError::Input(format!(
                    "K/V storage {other:?}: expected f32, or f16 with head dims that are \
                     multiples of 4 (found {:?})",
                    model
                        .cfg
                        .layers
                        .iter()
                        .map(|a| a.head_dim)
                        .collect::<Vec<_>>()
                ))));
            }
        };
        Ok(Self {
            ctx,
            model,
            tokenizer: small.tokenizer,
            params: small.params,
            formats,
            store: Mutex::new(DgemmaPrefixStore::new(
                options.cache_budget.max_tokens,
                options.cache_budget.max_bytes,
            )),
            dir: dir.to_path_buf(),
            load_s: start.elapsed_s(),
        })
    }

    pub fn ctx(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    pub fn model(&self) -> &DgemmaModel {
        &self.model
    }

    pub fn config(&self) -> &DiffusionGemmaConfig {
        &self.model.cfg
    }

    /// The sampler settings of `generation_config.json` (the published ones without it).
    pub fn params(&self) -> &EntropyBoundParams {
        &self.params
    }

    /// The matrices' storage on the GPU.
    pub fn weight_format(&self) -> WeightFormat {
        self.formats.layers
    }

    /// GPU bytes of the weights.
    pub fn weight_bytes(&self) -> u64 {
        unmask_gpu::dgemma::weight_bytes(&self.model.cfg, self.formats)
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn load_s(&self) -> f64 {
        self.load_s
    }

    /// The shared prefix store's counters and contents.
    pub fn prefix_stats(&self) -> StoreStats {
        self.store.lock().unwrap_or_else(|e| e.into_inner()).stats()
    }

    /// The shared prefix store's budget (`EngineOptions::cache_budget`).
    pub fn prefix_store_budget(&self) -> CacheBudget {
        let store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        CacheBudget {
            max_tokens: store.budget_tokens,
            max_bytes: store.budget_bytes,
        }
    }

    /// Drops every stored shared prefix; returns how many.
    pub fn clear_prefix_store(&self) -> usize {
        self.store.lock().unwrap_or_else(|e| e.into_inner()).clear()
    }

    /// The prompt's ids (Gemma 4's chat layout for messages) and how many of them the
    /// system turn takes (0 without one).
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<(Vec<u32>, usize), EngineError> {
        let location = self.dir.display().to_string();
        text_side::encode_prompt(self.tokenizer.as_ref(), &location, prompt)
    }

    /// Generates for `request`, telling `on_step` of every denoising step; `on_step`
    /// breaking stops it there (`ModelError::Cancelled`), the prefix store kept.
    pub async fn generate_async(
        &self,
        request: &DgemmaRequest,
        on_step: &mut dyn FnMut(StepReport<'_>) -> ControlFlow<()>,
    ) -> Result<DgemmaOutput, EngineError> {
        let mut task = self.start(request)?;
        while !task.is_done() {
            self.step_async(&mut [&mut task], &mut |_, r| on_step(r))
                .await?;
        }
        self.finish(task)
    }

    /// `generate_async`, blocking (natively).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate(&self, request: &DgemmaRequest) -> Result<DgemmaOutput, EngineError> {
        pollster::block_on(self.generate_async(request, &mut |_| ControlFlow::Continue(())))
    }
}

pub(crate) fn refused(message: &str) -> EngineError {
    EngineError::Model(ModelError::Input(message.to_string()))
}
