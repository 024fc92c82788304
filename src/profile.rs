//! BiCache's offline profiler: how deep a shared prefix's K/V stay reusable.
//!
//! For every item the prefix's K/V are computed twice — by a forward pass over the prefix
//! alone and by one over the whole request (prefix, rest of the prompt and, optionally, the
//! masked canvas) — and each layer scores the mean cosine similarity of the two, over prefix
//! tokens and over K and V. Items are grouped by the prefix ratio r; a layer is safe at r when
//! it and every layer below it score above τ. The safe depths form the `DepthTable` the
//! engine looks b up in (`bicache_depth.json` in the model folder).
//!
//! Keys are compared after RoPE: both passes rotate a prefix token's key by the same angles,
//! and a rotation keeps the cosine.

use unmask_core::depth_policy::{DepthTable, prefix_ratio};
use unmask_gpu::StepEncoder;
use unmask_gpu::model::ForwardState;

use crate::{Engine, EngineError, Message, Prompt, Request};

/// One request to profile.
#[derive(Clone, Debug)]
pub enum ProfileItem {
    /// A conversation: the prefix is every turn before the last user turn (as the engine
    /// splits it), the rest is that turn and the assistant header.
    Chat(Vec<Message>),
    /// Token ids split by hand.
    Ids { prefix: Vec<u32>, rest: Vec<u32> },
}

impl ProfileItem {
    /// A system prompt (the shared prefix) and a user turn.
    pub fn chat(system: Option<&str>, user: &str) -> Self {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(Message::system(s));
        }
        messages.push(Message::user(user));
        ProfileItem::Chat(messages)
    }
}

/// How to profile.
#[derive(Clone, Debug)]
pub struct ProfileOptions {
    /// Similarity a layer must exceed (strictly) to be reusable.
    pub tau: f64,
    /// Masked canvas tokens appended to the full pass. 0 is the official profiler (prefix and
    /// prompt only, r = P/(P+U)); G > 0 profiles what the engine runs, r = P/(P+U+G).
    pub gen_length: usize,
    /// The table's `model_id`; `None` takes the model folder's name.
    pub model_id: Option<String>,
    /// The table's `source` (how it was made, e.g. the command line).
    pub source: String,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        Self {
            tau: 0.97,
            gen_length: 0,
            model_id: None,
            source: String::new(),
        }
    }
}

/// The similarities of one profiled item.
#[derive(Clone, Debug)]
pub struct ItemProfile {
    /// Index of the item in the list given to `profile`.
    pub index: usize,
    pub prefix_len: usize,
    pub rest_len: usize,
    pub ratio: u32,
    /// s_l for every layer.
    pub similarity: Vec<f64>,
}

/// What happened to one item; passed to the progress callback.
#[derive(Clone, Debug)]
pub enum ItemOutcome {
    Profiled(ItemProfile),
    /// The item could not be profiled (no prefix, too long); the reason.
    Skipped {
        index: usize,
        reason: String,
    },
}

/// The result of profiling a list of items.
#[derive(Clone, Debug)]
pub struct Profile {
    /// r → b, ready to be written as `bicache_depth.json`.
    pub table: DepthTable,
    /// Per ratio bucket, ascending: (r, samples, mean s_l of every layer).
    pub similarity: Vec<(u32, usize, Vec<f64>)>,
    /// Items left out, with the reason: (index, reason).
    pub skipped: Vec<(usize, String)>,
}

impl Profile {
    /// n(r) of every bucket of `similarity`, in its order.
    pub fn depths(&self) -> Vec<usize> {
        self.similarity
            .iter()
            .map(|(_, _, s)| safe_depth(s, self.table.tau))
            .collect()
    }
}

/// Profiles `items` (see the module comment).
#[cfg(not(target_arch = "wasm32"))]
pub fn profile(
    engine: &Engine,
    items: &[ProfileItem],
    opts: &ProfileOptions,
) -> Result<Profile, EngineError> {
    profile_with(engine, items, opts, &mut |_| {})
}

/// `profile`, calling `progress` after every item.
#[cfg(not(target_arch = "wasm32"))]
pub fn profile_with(
    engine: &Engine,
    items: &[ProfileItem],
    opts: &ProfileOptions,
    progress: &mut dyn FnMut(&ItemOutcome),
) -> Result<Profile, EngineError> {
    pollster::block_on(profile_async(engine, items, opts, progress))
}

/// `profile_with` for async callers (the only way in a browser).
pub async fn profile_async(
    engine: &Engine,
    items: &[ProfileItem],
    opts: &ProfileOptions,
    progress: &mut dyn FnMut(&ItemOutcome),
) -> Result<Profile, EngineError> {
    if !(opts.tau.is_finite() && opts.tau > -1.0 && opts.tau <= 1.0) {
        return Err(EngineError::Invalid {
            field: "tau",
            expected: "a similarity threshold in (-1, 1]".into(),
            found: opts.tau.to_string(),
        });
    }
    let max_len = engine.model().cfg.max_sequence_length;
    // Split every item first, so buffers are sized once for the longest.
    let mut splits = Vec::with_capacity(items.len());
    let mut skipped = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let (prefix, rest) = split_item(engine, item)?;
        let total = prefix.len() + rest.len() + opts.gen_length;
        let why = if prefix.is_empty() {
            Some("the item has no shared prefix".to_string())
        } else if total > max_len {
            Some(format!(
                "{} prefix + {} prompt + {} canvas tokens exceed the model's {max_len} positions",
                prefix.len(),
                rest.len(),
                opts.gen_length
            ))
        } else {
            None
        };
        match why {
            Some(reason) => {
                progress(&ItemOutcome::Skipped {
                    index,
                    reason: reason.clone(),
                });
                skipped.push((index, reason));
            }
            None => splits.push((index, prefix, rest)),
        }
    }
    if splits.is_empty() {
        let reasons: Vec<String> = skipped
            .iter()
            .take(3)
            .map(|(i, r)| format!("item {i}: {r}"))
            .collect();
        return Err(EngineError::Refused(format!(
            "no item could be profiled ({})",
            if reasons.is_empty() {
                "no items given".to_string()
            } else {
                reasons.join("; ")
            }
        )));
    }
    let max_prefix = splits.iter().map(|(_, p, _)| p.len()).max().unwrap_or(1);
    let max_total = splits
        .iter()
        .map(|(_, p, r)| p.len() + r.len() + opts.gen_length)
        .max()
        .unwrap_or(1);
    let alone = engine.model().new_state(max_prefix, max_prefix)?;
    let joint = engine.model().new_state(max_total, max_total)?;
    let n_layers = engine.model().cfg.n_layers;
    // Per ratio: (samples, sum of s_l per layer).
    let mut buckets: std::collections::BTreeMap<u32, (usize, Vec<f64>)> = Default::default();
    for (index, prefix, rest) in splits {
        let mut ids = prefix.clone();
        ids.extend_from_slice(&rest);
        ids.extend(std::iter::repeat_n(engine.special().mask, opts.gen_length));
        forward(engine, &alone, &prefix)?;
        forward(engine, &joint, &ids)?;
        let similarity = layer_similarity(engine, &alone, &joint, prefix.len()).await?;
        let ratio = prefix_ratio(prefix.len(), rest.len(), opts.gen_length);
        let bucket = buckets
            .entry(ratio)
            .or_insert_with(|| (0, vec![0.0; n_layers]));
        bucket.0 += 1;
        for (sum, s) in bucket.1.iter_mut().zip(&similarity) {
            *sum += s;
        }
        progress(&ItemOutcome::Profiled(ItemProfile {
            index,
            prefix_len: prefix.len(),
            rest_len: rest.len(),
            ratio,
            similarity,
        }));
    }
    let similarity: Vec<(u32, usize, Vec<f64>)> = buckets
        .into_iter()
        .map(|(r, (n, sums))| (r, n, sums.into_iter().map(|s| s / n as f64).collect()))
        .collect();
    let samples_per_ratio = similarity.iter().map(|b| b.1).min().unwrap_or(0);
    let ratio_definition = if opts.gen_length == 0 {
        "r = round(100*P/(P+U)): P shared-prefix tokens, U tokens of the rest of the prompt; \
         no masked canvas in the profiling pass (the official profiler's definition)"
            .to_string()
    } else {
        format!(
            "r = round(100*P/(P+U+G)): P shared-prefix tokens, U tokens of the rest of the \
             prompt, G = {} masked canvas tokens in the profiling pass (the engine's lookup)",
            opts.gen_length
        )
    };
    let model_id = opts.model_id.clone().unwrap_or_else(|| {
        engine
            .dir()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| engine.dir().display().to_string())
    });
    let table = DepthTable {
        model_id,
        tau: opts.tau,
        ratio_definition,
        samples_per_ratio,
        source: opts.source.clone(),
        n_layers,
        entries: depth_entries(&similarity, opts.tau),
    };
    Ok(Profile {
        table,
        similarity,
        skipped,
    })
}

/// The prefix and the rest of an item's prompt.
fn split_item(engine: &Engine, item: &ProfileItem) -> Result<(Vec<u32>, Vec<u32>), EngineError> {
    match item {
        ProfileItem::Ids { prefix, rest } => Ok((prefix.clone(), rest.clone())),
        ProfileItem::Chat(messages) => {
            let mut request = Request::ids(Vec::new());
            request.prompt = Prompt::Chat(messages.clone());
            let (mut ids, p) = engine.encode_with_prefix(&request)?;
            let rest = ids.split_off(p);
            Ok((ids, rest))
        }
    }
}

/// One uncached forward pass of `ids` at positions 0.. in `st`, leaving their K/V in the
/// arena.
fn forward(engine: &Engine, st: &ForwardState, ids: &[u32]) -> Result<(), EngineError> {
    let positions: Vec<u32> = (0..ids.len() as u32).collect();
    engine.model().write_rows(st, ids, &positions)?;
    let mut step = StepEncoder::new(engine.ctx(), "profile pass");
    engine
        .model()
        .encode_layers(&mut step, st, ids.len(), ids.len(), None, 0)?;
    step.submit()?;
    Ok(())
}

/// s_l for every layer: the cosine of each of the first `p` rows of K (and of V) in the two
/// arenas, averaged over rows and over K and V.
async fn layer_similarity(
    engine: &Engine,
    alone: &ForwardState,
    joint: &ForwardState,
    p: usize,
) -> Result<Vec<f64>, EngineError> {
    let c = &engine.model().cfg;
    let width = c.n_kv_heads * c.head_dim();
    let read = async |t: &unmask_gpu::Tensor| -> Result<Vec<f32>, EngineError> {
        Ok(t.read_values_async(engine.ctx(), p * width).await?)
    };
    let mut out = Vec::with_capacity(c.n_layers);
    for (a, j) in alone.kv.iter().zip(&joint.kv) {
        let k = mean_row_cosine(&read(&a.k).await?, &read(&j.k).await?, width);
        let v = mean_row_cosine(&read(&a.v).await?, &read(&j.v).await?, width);
        out.push((k + v) / 2.0);
    }
    Ok(out)
}

/// Mean over rows of the cosine similarity of matching rows of `a` and `b` (f64).
pub fn mean_row_cosine(a: &[f32], b: &[f32], width: usize) -> f64 {
    let rows = a.len().min(b.len()) / width.max(1);
    if rows == 0 {
        return 1.0;
    }
    let sum: f64 = a
        .chunks_exact(width)
        .zip(b.chunks_exact(width))
        .map(|(x, y)| cosine(x, y))
        .sum();
    sum / rows as f64
}

/// Cosine similarity; two zero vectors count as identical, one zero vector as unrelated.
fn cosine(x: &[f32], y: &[f32]) -> f64 {
    let (mut dot, mut xx, mut yy) = (0.0f64, 0.0f64, 0.0f64);
    for (&a, &b) in x.iter().zip(y) {
        let (a, b) = (a as f64, b as f64);
        dot += a * b;
        xx += a * a;
        yy += b * b;
    }
    match (xx > 0.0, yy > 0.0) {
        (true, true) => dot / (xx.sqrt() * yy.sqrt()),
        (false, false) => 1.0,
        _ => 0.0,
    }
}

/// Leading layers whose similarity exceeds `tau` (stops at the first that does not).
pub fn safe_depth(similarity: &[f64], tau: f64) -> usize {
    similarity.iter().take_while(|&&s| s > tau).count()
}

/// The table r → b: r = 0 with the smallest depth of any bucket, then every ratio whose
/// depth exceeds the depths of all smaller ratios (a monotone step function).
pub fn depth_entries(similarity: &[(u32, usize, Vec<f64>)], tau: f64) -> Vec<(u32, usize)> {
    let depths: Vec<(u32, usize)> = similarity
        .iter()
        .map(|(r, _, s)| (*r, safe_depth(s, tau)))
        .collect();
    let floor = depths.iter().map(|d| d.1).min().unwrap_or(0);
    let mut entries = vec![(0, floor)];
    let mut running = floor;
    for (r, n) in depths {
        if n > running && r > 0 {
            entries.push((r, n));
            running = n;
        }
    }
    entries
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_counts_leading_layers_strictly_above_tau() {
        assert_eq!(safe_depth(&[0.99, 0.98, 0.97, 0.99], 0.97), 2);
        assert_eq!(safe_depth(&[0.5, 0.99], 0.97), 0);
        assert_eq!(safe_depth(&[1.0, 1.0], 0.97), 2);
    }

    #[test]
    fn entries_are_a_monotone_step_function_from_zero() {
        let b = |r: u32, s: &[f64]| (r, 1, s.to_vec());
        let sim = vec![
            b(20, &[0.99, 0.5, 0.5]),
            b(40, &[0.99, 0.99, 0.5]),
            b(50, &[0.99, 0.5, 0.5]),
            b(90, &[0.99, 0.99, 0.99]),
        ];
        assert_eq!(depth_entries(&sim, 0.97), vec![(0, 1), (40, 2), (90, 3)]);
        // The floor at r = 0 is the smallest depth seen anywhere.
        let sim = vec![b(0, &[0.99, 0.99, 0.5]), b(30, &[0.5, 0.5, 0.5])];
        assert_eq!(depth_entries(&sim, 0.97), vec![(0, 0)]);
        assert_eq!(depth_entries(&[], 0.97), vec![(0, 0)]);
    }

    #[test]
    fn cosine_of_rows() {
        let a = [1.0, 0.0, 0.0, 2.0];
        let b = [2.0, 0.0, 0.0, -1.0];
        assert!((mean_row_cosine(&a, &b, 2) - 0.0).abs() < 1e-12);
        assert!((mean_row_cosine(&a, &a, 2) - 1.0).abs() < 1e-12);
        assert_eq!(cosine(&[0.0, 0.0], &[0.0, 0.0]), 1.0);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 0.0]), 0.0);
    }
}
