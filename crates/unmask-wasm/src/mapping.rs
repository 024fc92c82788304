//! The JSON shapes the page and the runtime exchange: requests and options in, step events
//! and results out. Plain `serde_json` so it is tested natively; the wasm glue only turns
//! them into JavaScript objects (`JSON.parse`) and back.

use serde_json::{Value, json};
use unmask::{
    CacheMode, DecodeMode, Engine, EngineOptions, Generation, GenerationParams, Message, Prompt,
    Remasking, Request, Role, StepEvent, WeightFormat,
};
use unmask_core::tokenizer::Tokenizer;

/// Reads an optional field of a JSON object with `get`, naming the field when it is of the
/// wrong type.
fn field<T>(
    obj: &Value,
    key: &str,
    what: &str,
    get: impl Fn(&Value) -> Option<T>,
) -> Result<Option<T>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => get(v)
            .map(Some)
            .ok_or_else(|| format!("{key} must be {what}, found {v}")),
    }
}

fn whole(obj: &Value, key: &str) -> Result<Option<usize>, String> {
    field(obj, key, "a whole number", |v| {
        v.as_u64().map(|n| n as usize)
    })
}

fn number(obj: &Value, key: &str) -> Result<Option<f32>, String> {
    field(obj, key, "a number", |v| v.as_f64().map(|n| n as f32))
}

fn flag(obj: &Value, key: &str) -> Result<Option<bool>, String> {
    field(obj, key, "true or false", Value::as_bool)
}

fn text<'a>(obj: &'a Value, key: &str) -> Result<Option<&'a str>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(format!("{key} must be a string, found {v}")),
    }
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

/// Load options: `{weights, embedWeights, cacheTokens, cacheBytes}`, all optional.
pub fn engine_options(obj: &Value) -> Result<EngineOptions, String> {
    let mut o = EngineOptions::default();
    if let Some(w) = text(obj, "weights")? {
        o.weight_format = weight_format(w)?;
    }
    if let Some(w) = text(obj, "embedWeights")? {
        o.embed_format = Some(weight_format(w)?);
    }
    if let Some(t) = whole(obj, "cacheTokens")? {
        o.cache_budget.max_tokens = t;
    }
    if let Some(b) = whole(obj, "cacheBytes")? {
        o.cache_budget.max_bytes = b as u64;
    }
    Ok(o)
}

/// A request: the prompt as `messages` ([{role, content}]), as `system` + `prompt`, or as
/// token `ids`; the fields of `GenerationParams` in camelCase; `cache`, `prefixLen`,
/// `depth`, `refreshEvery`, `recomputeAll` and `decode` ("clean" or "raw").
pub fn request(obj: &Value) -> Result<Request, String> {
    if !obj.is_object() {
        return Err(format!("a request must be an object, found {obj}"));
    }
    let prompt = if let Some(list) = obj.get("ids").filter(|v| !v.is_null()) {
        let ids = list
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| format!("ids must be an array of token ids, found {list}"))?;
        Prompt::Ids(ids)
    } else if let Some(list) = obj.get("messages").filter(|v| !v.is_null()) {
        let items = list
            .as_array()
            .ok_or_else(|| format!("messages must be an array, found {list}"))?;
        let mut messages = Vec::with_capacity(items.len());
        for m in items {
            let role = match text(m, "role")? {
                Some("system") => Role::System,
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                other => {
                    return Err(format!(
                        "a message role must be system, user or assistant, found {other:?}"
                    ));
                }
            };
            let content = text(m, "content")?.unwrap_or_default();
            messages.push(Message::new(role, content));
        }
        Prompt::Chat(messages)
    } else {
        let user = text(obj, "prompt")?.ok_or("a request needs prompt, messages or ids")?;
        let system = text(obj, "system")?.filter(|s| !s.trim().is_empty());
        Request::chat(system, user).prompt
    };
    let d = GenerationParams::default();
    let gen_length = whole(obj, "genLength")?.unwrap_or(d.gen_length);
    let params = GenerationParams {
        gen_length,
        steps: whole(obj, "steps")?.unwrap_or(gen_length),
        block_length: whole(obj, "blockLength")?.unwrap_or(d.block_length.min(gen_length)),
        temperature: number(obj, "temperature")?.unwrap_or(d.temperature),
        remasking: match text(obj, "remasking")? {
            None | Some("low_confidence") => Remasking::LowConfidence,
            Some("random") => Remasking::Random,
            Some(other) => {
                return Err(format!(
                    "remasking must be low_confidence or random, found {other:?}"
                ));
            }
        },
        cfg_scale: number(obj, "cfgScale")?.unwrap_or(d.cfg_scale),
        threshold: number(obj, "threshold")?,
        logits_eos_inf: flag(obj, "logitsEosInf")?.unwrap_or(d.logits_eos_inf),
        confidence_eos_eot_inf: flag(obj, "confidenceEosEotInf")?
            .unwrap_or(d.confidence_eos_eot_inf),
        seed: field(obj, "seed", "a whole number", Value::as_u64)?.unwrap_or(d.seed),
        round_confidence_bf16: flag(obj, "roundConfidenceBf16")?.unwrap_or(d.round_confidence_bf16),
    };
    let mut r = Request::ids(Vec::new()).with_params(params);
    r.prompt = prompt;
    if let Some(c) = text(obj, "cache")? {
        r.cache = c.parse::<CacheMode>().map_err(|e| e.to_string())?;
    }
    r.prefix_len = whole(obj, "prefixLen")?;
    r.depth = whole(obj, "depth")?;
    if let Some(n) = whole(obj, "refreshEvery")? {
        r.refresh_every = n.max(1);
    }
    r.recompute_all = flag(obj, "recomputeAll")?.unwrap_or(false);
    r.decode = match text(obj, "decode")? {
        None | Some("clean") => DecodeMode::Clean,
        Some("raw") => DecodeMode::Raw,
        Some(other) => return Err(format!("decode must be clean or raw, found {other:?}")),
    };
    Ok(r)
}

/// Per-position state of the canvas shown while a request denoises.
pub struct CanvasTracker {
    /// Confidence of each generated position: of its commit once committed, else of the
    /// latest prediction (None before the first).
    confidence: Vec<Option<f32>>,
    /// Token last predicted at each still-masked position.
    predicted: Vec<Option<u32>>,
}

impl CanvasTracker {
    pub fn new(gen_length: usize) -> Self {
        Self {
            confidence: vec![None; gen_length],
            predicted: vec![None; gen_length],
        }
    }

    /// The event as JSON: `step`, `block`, `stepInBlock`, `elapsed`, `promptLength`,
    /// `canvas` (generated ids, masks included), `masked` (generated positions still
    /// masked), `committed` ([position, token] committed now), `confidence`, `predicted`
    /// (the guess at each masked position), `pieces` (each committed token's text, null
    /// for masks) and `text` (the answer so far).
    pub fn event(&mut self, e: &StepEvent<'_>, tokenizer: Option<&Tokenizer>) -> Value {
        let start = e.prompt_len;
        let canvas = &e.canvas[start..];
        for (&pos, &(token, conf)) in e.rows.iter().zip(e.predictions) {
            if let Some(i) = (pos as usize)
                .checked_sub(start)
                .filter(|&i| i < canvas.len())
            {
                self.confidence[i] = Some(conf);
                self.predicted[i] = Some(token);
            }
        }
        let masked: Vec<usize> = canvas
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == e.mask_id)
            .map(|(i, _)| i)
            .collect();
        let pieces: Vec<Value> = canvas
            .iter()
            .map(|&t| {
                if t == e.mask_id {
                    Value::Null
                } else {
                    Value::String(piece(tokenizer, t))
                }
            })
            .collect();
        let predicted: Vec<Value> = canvas
            .iter()
            .zip(&self.predicted)
            .map(|(&t, p)| match p {
                Some(p) if t == e.mask_id => Value::String(piece(tokenizer, *p)),
                _ => Value::Null,
            })
            .collect();
        let committed: Vec<[u32; 2]> = e
            .record
            .committed
            .iter()
            .map(|&(p, t)| [p - start as u32, t])
            .collect();
        let known: Vec<u32> = canvas.iter().copied().filter(|&t| t != e.mask_id).collect();
        let text = tokenizer
            .and_then(|t| t.decode(&known, DecodeMode::Clean).ok())
            .unwrap_or_default();
        json!({
            "step": e.global_step,
            "block": e.record.block,
            "stepInBlock": e.record.step,
            "elapsed": e.elapsed_s,
            "promptLength": e.prompt_len,
            "canvas": canvas,
            "masked": masked,
            "committed": committed,
            "confidence": self.confidence,
            "predicted": predicted,
            "pieces": pieces,
            "text": text,
        })
    }
}

/// The text of one token; special tokens (which decode to nothing) by their name.
pub fn piece(tokenizer: Option<&Tokenizer>, id: u32) -> String {
    let Some(t) = tokenizer else {
        return id.to_string();
    };
    match t.decode(&[id], DecodeMode::Raw) {
        Ok(s) if !s.is_empty() => s,
        _ => t.id_to_token(id).unwrap_or_else(|| id.to_string()),
    }
}

/// A finished generation as JSON: ids, text, the cache mode, timings, what BiCache did
/// and how much layer work the cache saved, and the prefix store's counters.
pub fn generation(engine: &Engine, g: &Generation, uncond: bool) -> Value {
    let n_layers = engine.config().n_layers;
    let seq_len = g.prompt_ids.len() + g.ids.len();
    // Work of the reference (no cache): every row through every layer at every step.
    let full = g.timings.steps * seq_len * n_layers * if uncond { 2 } else { 1 };
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
    json!({
        "ids": g.ids,
        "text": g.text,
        "promptIds": g.prompt_ids,
        "prefixLength": g.prefix_len,
        "cache": g.cache.name(),
        "steps": g.steps.len(),
        "timings": serde_json::to_value(&g.timings).unwrap_or(Value::Null),
        "tokenLayersComputed": computed,
        "tokenLayersFull": full,
        "bicache": bicache,
        "store": store_stats(engine),
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
    let ctx = &engine.ctx;
    let formats = engine.model.weights.formats();
    json!({
        "adapter": ctx.describe(),
        "adapterName": ctx.info.name,
        "deviceType": format!("{:?}", ctx.info.device_type),
        "shaderF16": ctx.features.shader_f16,
        "subgroups": ctx.features.subgroups,
        "maxBindingBytes": ctx.features.max_binding_bytes,
        "layers": c.n_layers,
        "dModel": c.d_model,
        "vocab": c.embedding_size,
        "maxSequenceLength": c.max_sequence_length,
        "parameters": c.parameter_count(),
        "weights": formats.layers.name(),
        "embedWeights": formats.embed.name(),
        "weightBytes": engine.model.weights.size_bytes(),
        "hasTokenizer": engine.tokenizer.is_some(),
        "hasDepthTable": engine.depth_table.is_some(),
        "loadSeconds": engine.load_s,
        "maskId": engine.special.mask,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_request_maps_every_field() {
        let r = request(&json!({
            "system": "Be terse.", "prompt": "Hi", "genLength": 32, "steps": 16,
            "blockLength": 16, "temperature": 0.5, "remasking": "random", "cfgScale": 1.5,
            "threshold": 0.9, "logitsEosInf": true, "confidenceEosEotInf": true, "seed": 7,
            "cache": "bicache-dual", "prefixLen": 5, "depth": 1, "refreshEvery": 4,
            "decode": "raw"
        }))
        .unwrap();
        let Prompt::Chat(m) = &r.prompt else {
            panic!("a chat")
        };
        assert_eq!(
            (m.len(), m[0].role, m[1].content.as_str()),
            (2, Role::System, "Hi")
        );
        let p = &r.params;
        assert_eq!(
            (p.gen_length, p.steps, p.block_length, p.seed),
            (32, 16, 16, 7)
        );
        assert_eq!(
            (p.temperature, p.cfg_scale, p.threshold),
            (0.5, 1.5, Some(0.9))
        );
        assert!(p.logits_eos_inf && p.confidence_eos_eot_inf);
        assert_eq!(p.remasking, Remasking::Random);
        assert_eq!(r.cache, CacheMode::BicacheDual);
        assert_eq!(
            (r.prefix_len, r.depth, r.refresh_every),
            (Some(5), Some(1), 4)
        );
        assert_eq!(r.decode, DecodeMode::Raw);
    }

    #[test]
    fn defaults_and_errors() {
        let r = request(&json!({"ids": [1, 2, 3], "genLength": 8})).unwrap();
        assert!(matches!(r.prompt, Prompt::Ids(ref v) if v == &[1, 2, 3]));
        assert_eq!((r.params.steps, r.params.block_length), (8, 8));
        assert_eq!(r.cache, CacheMode::None);
        let err = |v: Value| request(&v).err().unwrap();
        assert!(err(json!({"prompt": "x", "cache": "lru"})).contains("unknown cache mode"));
        assert!(err(json!({"prompt": "x", "steps": "many"})).contains("steps"));
        assert!(err(json!({})).contains("prompt"));
        assert!(engine_options(&json!({"weights": "q3"})).is_err());
        let o = engine_options(&json!({"weights": "q4", "embedWeights": "f16"})).unwrap();
        assert_eq!(
            (o.weight_format, o.embed_format),
            (WeightFormat::Q4, Some(WeightFormat::F16Native))
        );
    }
}
