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

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use thiserror::Error;
use unmask_core::cache::{PlanInput, plan_step};
use unmask_core::chat::{encode_chat, prefix_split};
use unmask_core::config::LladaConfig;
use unmask_core::error::{ConfigError, SamplerError, TokenizerError};
use unmask_core::sampler::Sampler;
use unmask_core::tokenizer::{SpecialTokens, Tokenizer};
use unmask_gpu::model::{LladaModel, ModelError};
use unmask_gpu::ops::sampling::SelectParams;
use unmask_gpu::{ContextOptions, GpuContext, GpuError, StepEncoder};

pub use unmask_core::cache::CacheMode;
pub use unmask_core::chat::{Message, Role};
pub use unmask_core::sampler::{GenerationParams, Remasking, StepRecord};
pub use unmask_core::tokenizer::DecodeMode;
pub use unmask_gpu::WeightFormat;
pub use unmask_gpu::model::LoadProgress;

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
    #[error("{0}")]
    Request(String),
}

/// How to load a model.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Backend name (`vulkan`, `metal`, `dx12`, `gl`); `None` honours `WGPU_BACKEND`.
    pub backend: Option<String>,
    /// Weight storage on the GPU; f16 by default (native when the device has shader-f16).
    pub weight_format: WeightFormat,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            backend: None,
            weight_format: WeightFormat::F16Native,
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
}

/// A model loaded on a GPU, ready to generate.
pub struct Engine {
    pub ctx: Arc<GpuContext>,
    pub model: LladaModel,
    pub tokenizer: Option<Tokenizer>,
    pub special: SpecialTokens,
    pub dir: PathBuf,
    pub load_s: f64,
}

impl Engine {
    /// Loads `dir` (config.json, safetensors, optional tokenizer.json).
    pub fn load(dir: impl AsRef<Path>, options: &EngineOptions) -> Result<Self, EngineError> {
        Self::load_with_progress(dir, options, &mut |_| {})
    }

    pub fn load_with_progress(
        dir: impl AsRef<Path>,
        options: &EngineOptions,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, EngineError> {
        let dir = dir.as_ref();
        let start = Instant::now();
        let backends = options
            .backend
            .as_deref()
            .map(unmask_gpu::parse_backend)
            .transpose()?;
        let ctx = GpuContext::new(&ContextOptions {
            backends,
            ..ContextOptions::default()
        })?;
        Self::load_on(ctx, dir, options, progress).map(|mut e| {
            e.load_s = start.elapsed().as_secs_f64();
            e
        })
    }

    /// Loads onto an existing context (several models, or tests sharing one device).
    pub fn load_on(
        ctx: Arc<GpuContext>,
        dir: &Path,
        options: &EngineOptions,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, EngineError> {
        let start = Instant::now();
        let cfg = LladaConfig::from_file(dir.join("config.json"))?;
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer = if tokenizer_path.exists() {
            Some(Tokenizer::from_file(&tokenizer_path)?)
        } else {
            None
        };
        let special = match &tokenizer {
            Some(t) => t.special_tokens(&cfg)?,
            None => SpecialTokens {
                mask: cfg.mask_token_id,
                eos: cfg.eos_token_id,
                bos: cfg.bos_token_id.unwrap_or(cfg.eos_token_id),
                eot: None,
                start_header: None,
                end_header: None,
            },
        };
        let model = LladaModel::load(ctx.clone(), dir, options.weight_format, progress)?;
        Ok(Self {
            ctx,
            model,
            tokenizer,
            special,
            dir: dir.to_path_buf(),
            load_s: start.elapsed().as_secs_f64(),
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
        self.tokenizer.as_ref().ok_or_else(|| {
            EngineError::Request(format!(
                "{} has no tokenizer.json: give token ids instead of text",
                self.dir.display()
            ))
        })
    }

    /// The prompt's ids and the length of its shared prefix: an explicit `prefix_len`, else
    /// everything before the last user turn of a chat (when that split tokenizes exactly),
    /// else the whole prompt.
    pub fn encode_with_prefix(&self, request: &Request) -> Result<(Vec<u32>, usize), EngineError> {
        let ids = self.encode_prompt(&request.prompt)?;
        if let Some(p) = request.prefix_len {
            if p > ids.len() {
                return Err(EngineError::Request(format!(
                    "prefix_len {p} exceeds the prompt's {} tokens",
                    ids.len()
                )));
            }
            return Ok((ids, p));
        }
        let prefix = match &request.prompt {
            Prompt::Chat(messages) => {
                let split = prefix_split(self.require_tokenizer()?, messages)?;
                if split.exact && split.whole == ids { split.split_at() } else { 0 }
            }
            Prompt::Ids(ids) => ids.len(),
        };
        Ok((ids, prefix))
    }

    pub fn generate(&self, request: &Request) -> Result<Generation, EngineError> {
        self.generate_with(request, &mut |_| {})
    }

    /// Generates, calling `on_step` with the canvas after every step.
    pub fn generate_with(
        &self,
        request: &Request,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<Generation, EngineError> {
        let start = Instant::now();
        let (prompt, prefix_len) = self.encode_with_prefix(request)?;
        let p = &request.params;
        let cfg = &self.model.cfg;
        let mut sampler = Sampler::new(&prompt, p.clone(), self.special.mask, cfg.max_sequence_length)?;
        let cached = request.cache != CacheMode::None && !request.recompute_all;
        if cached && prompt.contains(&self.special.mask) {
            return Err(EngineError::Request(format!(
                "cache mode {} predicts only the current block: masks inside the prompt (infilling) need --cache none",
                request.cache
            )));
        }
        let seq_len = sampler.tokens().len();
        let positions: Vec<u32> = (0..seq_len as u32).collect();
        let cond = self.model.new_state(seq_len, seq_len)?;
        let uncond = if p.cfg_scale > 0.0 {
            Some(self.model.new_state(seq_len, seq_len)?)
        } else {
            None
        };
        let sel = self.model.new_select(seq_len)?;
        let conf_exclude = match (p.confidence_eos_eot_inf, p.temperature == 0.0) {
            // The reference's chained assignment: at T = 0 both EOS and EoT drop out of the
            // confidence softmax; at T > 0 only EoT does (see llada.md §3.1).
            (true, true) => [Some(self.special.eos), self.special.eot],
            (true, false) => [self.special.eot, None],
            (false, _) => [None, None],
        };
        let mut timings = Timings {
            setup_s: start.elapsed().as_secs_f64(),
            ..Timings::default()
        };
        let n_layers = cfg.n_layers;
        let mut records = Vec::new();
        let mut last_block = None;
        while !sampler.is_done() {
            let rows = sampler.rows_to_predict();
            let plan = plan_step(&PlanInput {
                mode: request.cache,
                seq_len,
                prefix_len,
                block: sampler.block(),
                block_start: last_block != Some(sampler.block_index()),
                first_step: last_block.is_none(),
                recompute_all: request.recompute_all,
            });
            last_block = Some(sampler.block_index());
            let states: Vec<(&unmask_gpu::model::ForwardState, Vec<u32>)> = std::iter::once((&cond, sampler.tokens().to_vec()))
                .chain(uncond.iter().map(|u| (u, sampler.unconditional_tokens())))
                .collect();
            if let Some(w) = &plan.warmup {
                // Its own submit: the main pass rewrites the same ids buffer.
                let mut step = StepEncoder::new(&self.ctx, "prefix pass");
                for (st, tokens) in &states {
                    self.model.write_rows(st, &tokens[w.rows.clone()], &positions[w.rows.clone()])?;
                    self.model.encode_layers(&mut step, st, w.rows.len(), w.kv_len, None, 0)?;
                    timings.forward_passes += 1;
                }
                step.submit()?;
            }
            let r = plan.pass.rows.clone();
            if let Some(bad) = rows.iter().find(|&&pos| !r.contains(&(pos as usize))) {
                return Err(EngineError::Request(format!(
                    "position {bad} must be predicted but cache mode {} computes rows {}..{} this step",
                    request.cache, r.start, r.end
                )));
            }
            let mut step = StepEncoder::new(&self.ctx, "denoise step");
            for (st, tokens) in &states {
                self.model.write_rows(st, &tokens[r.clone()], &positions[r.clone()])?;
                self.model.encode_layers(&mut step, st, r.len(), plan.pass.kv_len, None, 0)?;
                timings.forward_passes += 1;
            }
            timings.token_layer_passes += plan.token_layer_passes(n_layers) * states.len();
            let row_index: Vec<u32> = rows.iter().map(|&pos| pos - r.start as u32).collect();
            self.model.write_select(&sel, &row_index, &rows)?;
            let params = SelectParams {
                temperature: p.temperature,
                cfg_scale: p.cfg_scale,
                seed: p.seed,
                step: sampler.global_step() as u32,
                suppress_token: p.logits_eos_inf.then_some(self.special.eos),
                conf_exclude,
            };
            self.model.encode_select(&mut step, &cond, uncond.as_ref(), &sel, rows.len(), &params)?;
            step.submit()?;
            let choices = self.model.read_choices(&sel, rows.len())?;
            let predictions: Vec<(u32, f32)> = choices.iter().map(|c| (c.token, c.confidence)).collect();
            let record = sampler.commit(&predictions)?;
            timings.steps += 1;
            if timings.steps == 1 {
                timings.first_step_s = start.elapsed().as_secs_f64();
            }
            on_step(&StepEvent {
                record: &record,
                global_step: timings.steps,
                canvas: sampler.tokens(),
                prompt_len: prompt.len(),
                mask_id: self.special.mask,
                elapsed_s: start.elapsed().as_secs_f64(),
            });
            records.push(record);
        }
        timings.total_s = start.elapsed().as_secs_f64();
        let ids = sampler.generated().to_vec();
        let stop = |t: &u32| *t == self.special.eos || Some(*t) == self.special.eot;
        timings.answer_tokens = ids.iter().position(stop).unwrap_or(ids.len());
        if timings.total_s > 0.0 {
            timings.throughput_canvas = ids.len() as f64 / timings.total_s;
            timings.throughput_answer = timings.answer_tokens as f64 / timings.total_s;
        }
        let text = match &self.tokenizer {
            Some(t) => Some(t.decode(&ids, request.decode)?),
            None => None,
        };
        Ok(Generation {
            prompt_ids: prompt,
            prefix_len,
            cache: request.cache,
            ids,
            text,
            steps: records,
            timings,
        })
    }
}
