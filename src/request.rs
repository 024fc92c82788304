//! What a generation is asked for and what it gives back.

use unmask_core::adaptive::AdaptiveRefresh;
use unmask_core::cache::CacheMode;
use unmask_core::chat::Message;
use unmask_core::sampler::{GenerationParams, StepRecord};
use unmask_core::tokenizer::DecodeMode;

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
    /// ACache: the prompt's shared span; `None` looks for a stored span inside the prompt.
    pub span: Option<Span>,
    /// ACache: the share of the span recomputed with the request (its anchors), 0 to 1.
    pub anchor_ratio: f32,
    /// dLLM-Cache: prompt and response intervals and the V-verify ratio.
    pub adaptive: AdaptiveRefresh,
    /// dLLM-Cache: read back the positions V-verify picks in every layer of every step
    /// into the report (`AdaptiveReport::picks`; checks against the reference).
    pub record_picks: bool,
    /// Infilling: token ids after the generated canvas, which every step sees and none
    /// predicts (empty: the canvas ends the sequence).
    pub suffix: Vec<u32>,
    /// Run every step of the canvas (the reference). Otherwise a request whose decoded
    /// text stops at its end token ends as soon as that text is final: an end-of-text or
    /// end-of-turn token committed with every position before it committed. The text is
    /// the same; canvas positions after the end token may stay masked.
    pub full_canvas: bool,
    /// Report each generated token's log-probability under the model's softmax at the step
    /// that committed it (`Generation::logprobs`). The tokens are the same either way.
    pub logprobs: bool,
    /// With `logprobs` (which it implies when above 0): also this many most likely ids of
    /// each committed position's softmax at that step, with theirs (0 to
    /// `MOST_TOP_LOGPROBS`).
    pub top_logprobs: usize,
}

/// Most alternatives per token `Request::top_logprobs` may ask for.
pub const MOST_TOP_LOGPROBS: usize = unmask_gpu::ops::alternatives::MOST_ALTERNATIVES;

/// A committed token's log-probability under the model's softmax (CFG-combined logits of
/// the whole vocabulary at temperature 1) at the step that committed it, and the most likely
/// ids of that softmax with theirs (`Request::top_logprobs`), most likely first.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Logprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The shared span of an ACache request: a part of the prompt shared with other requests
/// at any position (a document, a few-shot block), whose K/V come from a span-only pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Span {
    /// Text that appears in the prompt as it is and tokenizes the same on its own.
    Text(String),
    /// Token positions of the prompt.
    Tokens(std::ops::Range<usize>),
}

/// An f32 as the shortest decimal that reads back as it (0.2, not 0.20000000298023224).
fn shortest_decimal<S: serde::Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(v.to_string().parse().unwrap_or(f64::from(*v)))
}

/// ACache's default share of the span recomputed per request (its reference's default).
pub const DEFAULT_ANCHOR_RATIO: f32 = 0.2;

impl Request {
    /// A request for `prompt` with default parameters: no cache, clean decoding.
    pub fn new(prompt: Prompt) -> Self {
        Self {
            prompt,
            params: GenerationParams::default(),
            decode: DecodeMode::Clean,
            cache: CacheMode::None,
            prefix_len: None,
            recompute_all: false,
            depth: None,
            refresh_every: 16,
            span: None,
            anchor_ratio: DEFAULT_ANCHOR_RATIO,
            adaptive: AdaptiveRefresh::default(),
            record_picks: false,
            suffix: Vec::new(),
            full_canvas: false,
            logprobs: false,
            top_logprobs: 0,
        }
    }

    /// A single user turn, with an optional system prompt, and default parameters.
    pub fn chat(system: Option<&str>, user: &str) -> Self {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(Message::system(s));
        }
        messages.push(Message::user(user));
        Self::new(Prompt::Chat(messages))
    }

    pub fn ids(ids: Vec<u32>) -> Self {
        Self::new(Prompt::Ids(ids))
    }

    pub fn with_params(mut self, params: GenerationParams) -> Self {
        self.params = params;
        self
    }

    pub fn with_cache(mut self, cache: CacheMode) -> Self {
        self.cache = cache;
        self
    }

    /// The canvas infilled before `suffix` (token ids).
    pub fn with_suffix(mut self, suffix: Vec<u32>) -> Self {
        self.suffix = suffix;
        self
    }

    /// The request running every step of its canvas, as the reference does.
    pub fn with_full_canvas(mut self) -> Self {
        self.full_canvas = true;
        self
    }
}

/// What happened at one step, passed to the step callback.
#[derive(Clone, Debug)]
pub struct StepEvent<'a> {
    pub record: &'a StepRecord,
    /// Steps run so far in this request, counting from 1 (the record's step restarts per block).
    pub global_step: usize,
    /// The whole sequence after the step (prompt, committed tokens, masks, then an
    /// infilling suffix).
    pub canvas: &'a [u32],
    pub prompt_len: usize,
    /// Tokens of the suffix at the end of `canvas` (0 without one).
    pub suffix_len: usize,
    pub mask_id: u32,
    pub elapsed_s: f64,
    /// The positions predicted at this step and each prediction (token, confidence), in
    /// the same order; the committed ones are in `record`.
    pub rows: &'a [u32],
    pub predictions: &'a [(u32, f32)],
    /// With `Request::logprobs`: per position of the generated canvas, the log-probability
    /// of its token at the step that committed it (`None` while masked).
    pub logprobs: Option<&'a [Option<Logprob>]>,
}

impl StepEvent<'_> {
    /// The generated canvas: after the prompt, before the suffix.
    pub fn generated(&self) -> &[u32] {
        let end = self.canvas.len().saturating_sub(self.suffix_len);
        self.canvas.get(self.prompt_len..end).unwrap_or_default()
    }
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
    /// dLLM-Cache: response rows × layers whose V was projected and checked against the
    /// cache (V-verify); the rows it recomputes are in `token_layer_passes` too.
    pub verified_row_layers: usize,
    /// The request ended when its answer was final, before the end of its schedule
    /// (`Request::full_canvas` off).
    pub finished_early: bool,
    /// Steps of the quota schedule it did not run, and their forward passes (two a step
    /// under classifier-free guidance); 0 under threshold decoding, whose steps are not
    /// fixed.
    pub steps_skipped: usize,
    pub forward_passes_skipped: usize,
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    /// Tokens of the shared prefix used by prefix caches.
    pub prefix_len: usize,
    pub cache: CacheMode,
    /// The generated canvas (gen_length ids, after the prompt and before a suffix).
    pub ids: Vec<u32>,
    /// Tokens of the infilling suffix after the canvas (0 without one).
    pub suffix_len: usize,
    /// Decoded text, when the model has a tokenizer.
    pub text: Option<String>,
    /// With `Request::logprobs`: per canvas position, the log-probability of its token
    /// under the model's softmax (CFG-combined logits of the whole vocabulary at
    /// temperature 1) at the step that committed it; `None` for a position never committed
    /// (a request that ended early leaves the canvas after its answer masked).
    pub logprobs: Option<Vec<Option<Logprob>>>,
    pub steps: Vec<StepRecord>,
    pub timings: Timings,
    /// What BiCache did, for BiCache modes.
    pub bicache: Option<BicacheReport>,
    /// What ACache did, for `acache`.
    pub acache: Option<AcacheReport>,
    /// What dLLM-Cache did, for `dllm-cache`.
    pub adaptive: Option<AdaptiveReport>,
}

/// How a dLLM-Cache request refreshed its caches.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct AdaptiveReport {
    pub prompt_interval: usize,
    pub response_interval: usize,
    #[serde(serialize_with = "shortest_decimal")]
    pub refresh_ratio: f32,
    /// With several blocks, the current block was computed at every forward.
    pub pin_block: bool,
    /// Response rows (the canvas; with shifted logits also the last prompt row).
    pub response_rows: usize,
    /// Forwards that recomputed the prompt, the response, and that V-verified it.
    pub prompt_refreshes: usize,
    pub response_refreshes: usize,
    pub verify_steps: usize,
    /// Response rows each layer recomputes on a V-verify step.
    pub recomputed_rows: usize,
    /// With `Request::record_picks`: per step, per layer, the positions V-verify picked
    /// (no layers on steps that did not verify).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub picks: Vec<Vec<Vec<u32>>>,
}

/// How an ACache request used its shared span.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct AcacheReport {
    /// The span's first position in the prompt and its tokens.
    pub span_start: usize,
    pub span_tokens: usize,
    /// The span was found in the store without being named.
    pub found_in_store: bool,
    /// The span's entry was already stored.
    pub hit: bool,
    pub entry_bytes: u64,
    #[serde(serialize_with = "shortest_decimal")]
    pub anchor_ratio: f32,
    /// The anchors, as offsets into the span (sorted).
    pub anchors: Vec<u32>,
    /// Why the request ran without ACache (and which mode it ran instead).
    pub fallback: Option<String>,
}

impl AdaptiveReport {
    /// Counts one forward of the request; `picks` are its positions V-verify picked per
    /// layer, when recorded.
    pub(crate) fn record(
        &mut self,
        step: &unmask_core::adaptive::AdaptiveStep,
        picks: Option<Vec<Vec<u32>>>,
    ) {
        use unmask_core::adaptive::ResponseRefresh;
        self.prompt_refreshes += usize::from(step.refresh_prompt);
        match step.refresh {
            ResponseRefresh::Full => self.response_refreshes += 1,
            ResponseRefresh::Verify { recompute } => {
                self.verify_steps += 1;
                self.recomputed_rows = recompute;
            }
            ResponseRefresh::Reuse => {}
        }
        if let Some(p) = picks {
            self.picks.push(p);
        }
    }
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
    pub(crate) fn fallback(mode: CacheMode, why: String) -> Self {
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
