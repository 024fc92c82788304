//! The JSON shapes the page and the runtime exchange: requests and options in, step events
//! and results out. Plain `serde_json` so it is tested natively; the wasm glue only turns
//! them into JavaScript objects (`JSON.parse`) and back.
//!
//! Every number a page sends is checked here before anything is sized from it: a whole
//! number must be one (no fractions, no negatives), within a stated bound that comes from
//! the loaded model where there is one. On wasm32 `usize` is 32 bits, so an unchecked
//! 2^32 would wrap to 0, and an unchecked 1e9 would ask the 4 GiB heap for gigabytes and
//! abort the instance. Each error names the field, what it expected and what it found.

use std::ops::RangeInclusive;

use serde_json::{Value, json};
use unmask::{
    Engine, EngineOptions, Generation, Message, Prompt, Request, RequestSpec, Role, Settings,
    SpecLimits, WeightFormat,
};
mod events;
pub mod score;
pub use events::{CanvasTracker, piece};

/// The largest whole number a JavaScript number holds exactly (`Number.MAX_SAFE_INTEGER`);
/// above it a page's value is already rounded before it gets here.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// Counts that become a `usize`: at most 2^32 - 1, which `usize` holds on wasm32 too.
const MAX_COUNT: u64 = u32::MAX as u64;

/// The smallest `maxBindingBytes`: below a page, tensors split into so many bindings that
/// loading crawls; the tests' smallest cap is 48 KiB.
pub const MIN_BINDING_BYTES: u64 = 4096;

/// What a request is checked against: the loaded model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Positions the model attends over, prompt and canvas together
    /// (`max_sequence_length`).
    pub context: usize,
    /// Rows of the embedding: every token id is below it.
    pub vocab: usize,
    /// Transformer layers: the most BiCache's shallow depth can be.
    pub layers: usize,
}

impl Limits {
    pub fn of(engine: &Engine) -> Self {
        let c = engine.config();
        Self {
            context: c.max_sequence_length,
            vocab: c.embedding_size,
            layers: c.n_layers,
        }
    }

    /// The longest prompt, or canvas, that leaves at least one position for the other.
    fn most_tokens(&self) -> usize {
        self.context.saturating_sub(1)
    }
}

/// Reads an optional field of a JSON object with `get`, naming the field when it is of the
/// wrong type.
pub(crate) fn field<'a, T>(
    obj: &'a Value,
    key: &str,
    what: &str,
    get: impl Fn(&'a Value) -> Option<T>,
) -> Result<Option<T>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => get(v)
            .map(Some)
            .ok_or_else(|| format!("{key}: expected {what}, found {v}")),
    }
}

/// An optional whole number within `range`; `why` (empty, or " (...)") says where the
/// bound comes from. Fractions, negatives and numbers past the bound are errors, never
/// rounded or wrapped.
pub(crate) fn whole_in(
    obj: &Value,
    key: &str,
    range: RangeInclusive<u64>,
    why: &str,
) -> Result<Option<u64>, String> {
    let what = format!(
        "a whole number from {} to {}{why}",
        range.start(),
        range.end()
    );
    field(obj, key, &what, |v| {
        v.as_u64().filter(|n| range.contains(n))
    })
}

/// `whole_in` for a count or length: the bound keeps it within a 32-bit `usize`.
pub(crate) fn count_in(
    obj: &Value,
    key: &str,
    range: RangeInclusive<usize>,
    why: &str,
) -> Result<Option<usize>, String> {
    let (lo, hi) = (*range.start() as u64, (*range.end() as u64).min(MAX_COUNT));
    // The value is at most `hi`, which came from a `usize` (or 2^32 - 1): it fits.
    Ok(whole_in(obj, key, lo..=hi, why)?.map(|n| n as usize))
}

pub(crate) fn flag(obj: &Value, key: &str) -> Result<Option<bool>, String> {
    field(obj, key, "true or false", Value::as_bool)
}

fn text<'a>(obj: &'a Value, key: &str) -> Result<Option<&'a str>, String> {
    field(obj, key, "a string", Value::as_str)
}

/// A weight storage name as the CLI spells it.
pub fn weight_format(name: &str) -> Result<WeightFormat, String> {
    match name {
        "f16" => Ok(WeightFormat::F16Native),
        "f16-packed" => Ok(WeightFormat::F16Packed),
        "f32" => Ok(WeightFormat::F32),
        "q8" => Ok(WeightFormat::Q8),
        "q4" => Ok(WeightFormat::Q4),
        other => Err(format!(
            "unknown weight format {other:?}: expected f16, f16-packed, f32, q8 or q4"
        )),
    }
}

/// Load options: `{weights, embedWeights, kv, cacheTokens, cacheBytes}`, all optional.
pub fn engine_options(obj: &Value) -> Result<EngineOptions, String> {
    let mut o = EngineOptions::default();
    if let Some(kv) = text(obj, "kv")? {
        o.kv_dtype = match kv {
            "f32" => unmask_gpu::DType::F32,
            "f16" => unmask_gpu::DType::F16,
            other => return Err(format!("kv: expected \"f32\" or \"f16\", found {other:?}")),
        };
    }
    if let Some(w) = text(obj, "weights")? {
        o.weight_format = weight_format(w)?;
    }
    if let Some(w) = text(obj, "embedWeights")? {
        o.embed_format = Some(weight_format(w)?);
    }
    if let Some(t) = count_in(obj, "cacheTokens", 0..=usize::MAX, "")? {
        o.cache_budget.max_tokens = t;
    }
    let safe = " (the largest whole number a JavaScript number holds exactly)";
    if let Some(b) = whole_in(obj, "cacheBytes", 0..=MAX_SAFE_INTEGER, safe)? {
        o.cache_budget.max_bytes = b;
    }
    Ok(o)
}

/// The device options of a load: `{maxBindingBytes, shaderF16}`, both optional.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceOptions {
    /// Cap on one storage binding, in bytes.
    pub max_binding_bytes: Option<u64>,
    /// `false`: packed f16 even where the adapter has shader-f16.
    pub shader_f16: bool,
}

pub fn device_options(obj: &Value) -> Result<DeviceOptions, String> {
    Ok(DeviceOptions {
        max_binding_bytes: whole_in(
            obj,
            "maxBindingBytes",
            MIN_BINDING_BYTES..=MAX_SAFE_INTEGER,
            "",
        )?,
        shader_f16: flag(obj, "shaderF16")?.unwrap_or(true),
    })
}

/// The prompt of a request: token `ids`, `messages` ([{role, content}]), or `system` +
/// `prompt`.
/// `list` as token ids of the model's vocabulary, at most the context less one.
pub(crate) fn token_ids(field: &str, list: &Value, limits: &Limits) -> Result<Vec<u32>, String> {
    let items = list
        .as_array()
        .ok_or_else(|| format!("{field}: expected an array of token ids, found {list}"))?;
    let most = limits.most_tokens();
    if items.is_empty() || items.len() > most {
        return Err(format!(
            "{field}: expected 1 to {most} token ids (the model's context of {} tokens, less \
             one for the answer), found {}",
            limits.context,
            items.len()
        ));
    }
    // An id past the embedding would read outside it on the GPU.
    let top = limits.vocab.saturating_sub(1);
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .filter(|&n| n <= top as u64)
                .map(|n| n as u32)
                .ok_or_else(|| {
                    format!(
                        "{field}[{i}]: expected a token id from 0 to {top} (the model's \
                         vocabulary), found {v}"
                    )
                })
        })
        .collect()
}

/// Infilling's suffix as the page gives it: text (`suffix`, tokenized as it is) or token
/// ids (`suffixIds`).
#[derive(Clone, Debug, PartialEq)]
pub enum SuffixInput {
    Text(String),
    Ids(Vec<u32>),
}

/// The request's suffix, if it names one (an empty `suffix` text names none).
pub fn suffix(obj: &Value, limits: &Limits) -> Result<Option<SuffixInput>, String> {
    let text = obj.get("suffix").filter(|v| !v.is_null());
    let ids = obj.get("suffixIds").filter(|v| !v.is_null());
    match (text, ids) {
        (Some(_), Some(_)) => Err("suffix and suffixIds: give one of them".to_string()),
        (Some(Value::String(t)), None) if t.is_empty() => Ok(None),
        (Some(Value::String(t)), None) => Ok(Some(SuffixInput::Text(t.clone()))),
        (Some(other), None) => Err(format!("suffix: expected a string, found {other}")),
        (None, Some(list)) => Ok(Some(SuffixInput::Ids(token_ids(
            "suffixIds",
            list,
            limits,
        )?))),
        (None, None) => Ok(None),
    }
}

pub(crate) fn prompt(obj: &Value, limits: &Limits) -> Result<Prompt, String> {
    if let Some(list) = obj.get("ids").filter(|v| !v.is_null()) {
        return Ok(Prompt::Ids(token_ids("ids", list, limits)?));
    }
    if let Some(list) = obj.get("messages").filter(|v| !v.is_null()) {
        let items = list.as_array().ok_or_else(|| {
            format!("messages: expected an array of {{role, content}}, found {list}")
        })?;
        let mut messages = Vec::with_capacity(items.len());
        for (i, m) in items.iter().enumerate() {
            let role = match m.get("role") {
                Some(Value::String(r)) if r == "system" => Role::System,
                Some(Value::String(r)) if r == "user" => Role::User,
                Some(Value::String(r)) if r == "assistant" => Role::Assistant,
                other => {
                    let found = other.map_or("nothing".to_string(), Value::to_string);
                    return Err(format!(
                        "messages[{i}].role: expected \"system\", \"user\" or \"assistant\", \
                         found {found}"
                    ));
                }
            };
            let content = match m.get("content") {
                None | Some(Value::Null) => "",
                Some(Value::String(s)) => s,
                Some(v) => {
                    return Err(format!(
                        "messages[{i}].content: expected a string, found {v}"
                    ));
                }
            };
            messages.push(Message::new(role, content));
        }
        return Ok(Prompt::Chat(messages));
    }
    let user = text(obj, "prompt")?.ok_or("a request needs prompt, messages or ids")?;
    let system = text(obj, "system")?.filter(|s| !s.trim().is_empty());
    Ok(Request::chat(system, user).prompt)
}

/// A spec field as the page spells it: `gen_length` is `genLength`.
fn camel(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut upper = false;
    for c in field.chars() {
        match (c, upper) {
            ('_', _) => upper = true,
            (c, true) => {
                out.extend(c.to_uppercase());
                upper = false;
            }
            (c, false) => out.push(c),
        }
    }
    out
}

/// A page's key as the spec spells it: `genLength` is `gen_length`.
fn snake_case(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 4);
    for c in key.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// What a spec field of this JSON type was expected to be, from serde's message.
fn expected_kind(message: &str) -> &'static str {
    match message {
        m if m.contains("expected u64") => "a whole number >= 0",
        m if m.contains("expected i64") => "a whole number",
        m if m.contains("expected f64") => "a number",
        m if m.contains("expected a boolean") => "true or false",
        m if m.contains("expected a string") => "a string",
        _ => "a value of another kind",
    }
}

/// The request's settings by the rules the library and the server share
/// (`unmask::RequestSpec`), each error naming the field as the page spells it and showing
/// the value as the page sent it.
fn settings(obj: &Value, limits: &Limits) -> Result<Settings, String> {
    // The page's numbers are JavaScript numbers: past 2^53 the seed is already rounded.
    if let Some(seed) = obj
        .get("seed")
        .filter(|v| v.as_u64().is_some_and(|s| s > MAX_SAFE_INTEGER))
    {
        return Err(format!(
            "seed: expected a whole number from 0 to {MAX_SAFE_INTEGER} (the largest whole              number a JavaScript number holds exactly), found {seed}"
        ));
    }
    let sent = |field: &str| obj.get(camel(field)).map(Value::to_string);
    // The spec's fields are snake_case: `genLength` is read as `gen_length`.
    let snake: serde_json::Map<String, Value> = obj
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (snake_case(k), v.clone()))
        .collect();
    let spec: RequestSpec =
        serde_path_to_error::deserialize(Value::Object(snake)).map_err(|e| {
            let field = camel(&e.path().to_string());
            let found = obj.get(&field).map_or("nothing".into(), Value::to_string);
            format!(
                "{field}: expected {}, found {found}",
                expected_kind(&e.inner().to_string())
            )
        })?;
    let limits = SpecLimits {
        context: limits.context,
        layers: limits.layers,
        vocab: limits.vocab,
    };
    spec.check(&limits).map_err(|e| {
        let found = sent(e.field).unwrap_or(e.found);
        format!("{}: expected {}, found {found}", camel(e.field), e.expected)
    })
}

/// A request: the prompt as `messages` ([{role, content}]), as `system` + `prompt`, or as
/// token `ids`; the fields of `unmask::RequestSpec` in camelCase (`genLength`, `steps`,
/// `blockLength`, ..., `cache`, `prefixLen`, `depth`, `refreshEvery`, `recomputeAll`,
/// `decode`, ACache's `affix` and `anchorRatio`, dLLM-Cache's `promptInterval`,
/// `responseInterval`, `refreshRatio`, `verifyPick` and `pinBlock`, `logprobs`,
/// `topLogprobs`, `topP`, `topK`, `minP`, `logitBias`, `presencePenalty`,
/// `frequencyPenalty` and `repetitionPenalty`); an infilling suffix is
/// read apart (`suffix`), since text needs the tokenizer. Checked against the model's `limits`; what depends on the prompt's length is
/// checked by `fit_prompt` once it is encoded.
pub fn request(obj: &Value, limits: &Limits) -> Result<Request, String> {
    if !obj.is_object() {
        return Err(format!("a request must be an object, found {obj}"));
    }
    let prompt = prompt(obj, limits)?;
    let settings = settings(obj, limits)?;
    let mut r = Request::ids(Vec::new()).with_settings(settings);
    r.prompt = prompt;
    Ok(r)
}

/// Checks what a request asks of its prompt once the prompt is encoded (`prompt_len`
/// tokens): the prompt and the canvas must fit the model's context together, and a
/// shared prefix must lie inside the prompt.
pub fn fit_prompt(r: &Request, prompt_len: usize, limits: &Limits) -> Result<(), String> {
    let context = limits.context;
    if prompt_len == 0 {
        return Err("prompt: expected at least one token, found none".to_string());
    }
    if prompt_len >= context {
        return Err(format!(
            "prompt: expected fewer than {context} tokens (the model's context, less one for \
             the answer), found {prompt_len}"
        ));
    }
    let suffix_len = r.suffix.len();
    let room = context.saturating_sub(prompt_len + suffix_len);
    let gen_length = r.params.gen_length;
    if gen_length > room {
        let suffix = if suffix_len > 0 {
            format!(" and the suffix's {suffix_len}")
        } else {
            String::new()
        };
        return Err(format!(
            "genLength: expected at most {room} (the model's context of {context} tokens less \
             the prompt's {prompt_len}{suffix}), found {gen_length}"
        ));
    }
    if let Some(p) = r.prefix_len.filter(|&p| p > prompt_len) {
        return Err(format!(
            "prefixLen: expected at most the prompt's {prompt_len} tokens, found {p}"
        ));
    }
    Ok(())
}

/// A finished generation as JSON: ids, text, the cache mode, timings, what BiCache did
/// and how much layer work the cache saved, the prefix store's counters, and the tokens'
/// log-probabilities when asked for (`top_logprobs`: how many alternatives were).
pub fn generation(engine: &Engine, g: &Generation, uncond: bool, top_logprobs: usize) -> Value {
    let n_layers = engine.config().n_layers;
    let seq_len = g.prompt_ids.len() + g.ids.len() + g.suffix_len;
    // Work of the reference (no cache): every row through every layer at every step. In
    // u64: steps x rows x layers passes 2^32 (a 32-bit usize) for long contexts.
    let passes = if uncond { 2 } else { 1 };
    let full = [g.timings.steps, seq_len, n_layers]
        .iter()
        .fold(passes, |acc: u64, &n| acc.saturating_mul(n as u64));
    let computed = g.timings.token_layer_passes;
    let bicache = g.bicache.as_ref().map(|b| {
        json!({
            "hit": b.hit,
            "depth": b.depth,
            "ratio": b.ratio,
            "entryTokens": b.entry_tokens,
            "entryBytes": b.entry_bytes,
            "fallback": b.fallback,
            // Prefix rows each step reads from the shared entry instead of computing,
            // in every one of the b shallow layers.
            "rowsReused": if b.fallback.is_none() { b.entry_tokens } else { 0 },
        })
    });
    let acache = g.acache.as_ref().map(|a| {
        json!({
            "hit": a.hit,
            "spanStart": a.span_start,
            "spanTokens": a.span_tokens,
            "foundInStore": a.found_in_store,
            "anchorRatio": a.anchor_ratio,
            "anchors": a.anchors,
            "entryBytes": a.entry_bytes,
            "fallback": a.fallback,
        })
    });
    let adaptive = g.adaptive.as_ref().map(|a| {
        json!({
            "promptInterval": a.prompt_interval,
            "responseInterval": a.response_interval,
            "refreshRatio": a.refresh_ratio.to_string().parse::<f64>().ok(),
            "pinBlock": a.pin_block,
            "responseRows": a.response_rows,
            "promptRefreshes": a.prompt_refreshes,
            "responseRefreshes": a.response_refreshes,
            "verifySteps": a.verify_steps,
            "recomputedRows": a.recomputed_rows,
        })
    });
    json!({
        "ids": g.ids,
        "suffixLength": g.suffix_len,
        "text": g.text,
        "promptIds": g.prompt_ids,
        "prefixLength": g.prefix_len,
        "cache": g.cache.name(),
        "steps": g.steps.len(),
        "timings": serde_json::to_value(&g.timings).unwrap_or(Value::Null),
        "tokenLayersComputed": computed,
        "tokenLayersFull": full,
        "bicache": bicache,
        "acache": acache,
        "dllmCache": adaptive,
        "store": store_stats(engine),
        // Per canvas position: its token's log-probability at the step that committed it
        // (null where never committed), and with `topLogprobs` the most likely
        // [id, log-probability] pairs of that step, most likely first.
        "logprobs": g.logprobs.as_ref().map(|l| {
            l.iter().map(|t| t.as_ref().map(|t| t.logprob)).collect::<Vec<_>>()
        }),
        "topLogprobs": g.logprobs.as_ref().filter(|_| top_logprobs > 0).map(|l| {
            l.iter().map(|t| t.as_ref().map(|t| &t.top)).collect::<Vec<_>>()
        }),
    })
}

/// The BiCache prefix store's counters.
pub fn store_stats(engine: &Engine) -> Value {
    let s = engine.prefix_store_stats();
    json!({
        "hits": s.hits,
        "misses": s.misses,
        "inserts": s.inserts,
        "evictions": s.evictions,
        "rejected": s.rejected,
        "entries": s.entries,
        "tokens": s.tokens,
        "bytes": s.bytes,
    })
}

/// What was loaded and on which adapter.
pub fn engine_info(engine: &Engine) -> Value {
    let c = engine.config();
    let ctx = engine.ctx();
    let formats = engine.model().weights.formats();
    let mut info = adapter_info(ctx);
    info.extend(json_object(json!({
        "layers": c.n_layers,
        "dModel": c.d_model,
        "vocab": c.embedding_size,
        "maxSequenceLength": c.max_sequence_length,
        "parameters": c.parameter_count(),
        "weights": formats.layers.name(),
        "embedWeights": formats.embed.name(),
        "weightBytes": engine.model().weights.size_bytes(),
        "hasTokenizer": engine.tokenizer().is_some(),
        "hasDepthTable": engine.depth_table().is_some(),
        "loadSeconds": engine.load_s(),
        "maskId": engine.special().mask,
    })));
    Value::Object(info)
}

/// The adapter's part of `info`: its name and the features the kernels use.
pub fn adapter_info(ctx: &unmask_gpu::GpuContext) -> serde_json::Map<String, Value> {
    json_object(json!({
        "adapter": ctx.describe(),
        "adapterName": ctx.info.name,
        "deviceType": format!("{:?}", ctx.info.device_type),
        "shaderF16": ctx.features.shader_f16,
        "subgroups": ctx.features.subgroups,
        "maxBindingBytes": ctx.features.max_binding_bytes,
    }))
}

/// The fields of a JSON object (`json!` of an object literal always is one).
pub fn json_object(v: Value) -> serde_json::Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => serde_json::Map::new(),
    }
}

#[cfg(test)]
mod tests;
