//! BiCache's offline profiler: how deep a shared prefix's K/V stay reusable.
//!
//! For every item the prefix's K/V are computed twice — by a forward pass over the prefix
//! alone and by one over the whole request (prefix, rest of the prompt and, optionally, the
//! masked canvas) — and each layer l gets a score s_l from the cosine similarity of the two,
//! row by row over the prefix tokens, for K and for V. How the rows become one score is the
//! `RowStatistic`: the mean over rows and over K and V (`Mean`, the official profiler), or
//! the smallest cosine of any row in K or V (`Min`). Items are grouped by the prefix ratio r
//! and a bucket's s_l is the mean of its items' scores. The depth at r follows from the
//! bucket's scores by the `DepthRule`, and the depths, kept where they grow with r, form the
//! `DepthTable` the engine looks b up in (`bicache_depth.json` in the model folder).
//!
//! The default rule is `Boundary`, not the official `Leading`. With n the number of leading
//! layers scoring above τ, `Leading` reuses n layers. But BiCache at depth b reuses more
//! than the stored K/V of layers < b: it also starts layer b from the stored hidden state
//! after layer b - 1, computed without the request. Layer l's K/V are projections of its
//! input, the output of layer l - 1, so s_b measures how far that boundary state drifts
//! when the request is present. At b = n the boundary state feeds layer n, whose K/V failed
//! τ: `Leading` reuses a state it measured as too different. `Boundary` takes b = n - 1
//! (layers 0..=b all pass, the boundary state included), and every layer when all pass.
//!
//! Keys are compared after RoPE: both passes rotate a prefix token's key by the same angles,
//! and a rotation keeps the cosine.

use unmask_core::depth_policy::{DepthTable, prefix_ratio};
use unmask_core::step_plan::{SeqStep, StepPlan};
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

/// How a layer's per-row cosines (one per prefix row, for K and for V) become the layer's
/// score s_l for one item.
///
/// `Min` exists because the mean hides a few rows that change completely: when only a few
/// prefix rows read the request (the table row a question asks about), the other rows' K/V
/// barely move, the mean stays near 1 and the layer passes τ, while the rows that matter
/// have K/V unlike those stored. The per-row minimum sees those rows. `P1` sees them too
/// (when they are more than 1 % of the prefix: a question's table rows are) without letting
/// one odd row decide alone (a row whose shallow heads have nothing at their offset spreads
/// its attention over the whole request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowStatistic {
    /// s_l = (mean over rows of cos K + mean over rows of cos V) / 2: the official profiler.
    #[default]
    Mean,
    /// s_l = min over rows of min(cos K(row), cos V(row)).
    Min,
    /// s_l = the 1st percentile over rows of min(cos K(row), cos V(row)) (the row at rank
    /// floor(0.01 (rows - 1)) from the lowest).
    P1,
    /// s_l = the third-lowest over rows of min(cos K(row), cos V(row)): like `P1`, not one or
    /// two odd rows alone, but whatever the prefix length (`P1` ignores 1 % of the rows, which
    /// at a 500-row prefix hides the 4 rows a question reads).
    Low3,
    /// s_l = `P1` up to 300 rows, the third-lowest beyond: the rank floor(0.01 (rows - 1)),
    /// at most 2. Short prefixes keep `P1`'s sensitivity (its first rows' spreading heads
    /// count, so a short prefix's share moves the depth), long ones `Low3`'s (the few rows a
    /// question reads stay seen at any length).
    P1Low3,
}

impl RowStatistic {
    /// The name written into tables and used by the CLI (`mean`, `min`).
    pub fn name(self) -> &'static str {
        match self {
            RowStatistic::Mean => "mean",
            RowStatistic::Min => "min",
            RowStatistic::P1 => "p1",
            RowStatistic::Low3 => "low3",
            RowStatistic::P1Low3 => "p1-low3",
        }
    }

    /// What s_l is, for a table's `source`.
    pub fn describe(self) -> &'static str {
        match self {
            RowStatistic::Mean => "s_l = mean over prefix rows of the K and V cosines",
            RowStatistic::Min => "s_l = min over prefix rows of min(cos K, cos V)",
            RowStatistic::P1 => "s_l = 1st percentile over prefix rows of min(cos K, cos V)",
            RowStatistic::Low3 => "s_l = third-lowest over prefix rows of min(cos K, cos V)",
            RowStatistic::P1Low3 => {
                "s_l = 1st percentile over prefix rows of min(cos K, cos V), at most the \
                 third-lowest"
            }
        }
    }

    /// s_l of one layer from the per-row cosines of its K (`k`) and V (`v`); 1 without rows.
    /// A NaN cosine makes the score NaN (so the layer fails τ) under either statistic.
    pub fn score(self, k: &[f64], v: &[f64]) -> f64 {
        match self {
            RowStatistic::Mean => (mean(k) + mean(v)) / 2.0,
            RowStatistic::Min => {
                let m =
                    k.iter().chain(v).fold(
                        f64::INFINITY,
                        |m, &x| if x.is_nan() || x < m { x } else { m },
                    );
                if m == f64::INFINITY { 1.0 } else { m }
            }
            RowStatistic::P1 | RowStatistic::Low3 | RowStatistic::P1Low3 => {
                let mut rows: Vec<f64> = k.iter().zip(v).map(|(&a, &b)| a.min(b)).collect();
                if k.iter().chain(v).any(|x| x.is_nan()) {
                    return f64::NAN;
                }
                if rows.is_empty() {
                    return 1.0;
                }
                rows.sort_by(f64::total_cmp);
                let p1 = (rows.len() - 1) / 100;
                let rank = match self {
                    RowStatistic::P1 => p1,
                    RowStatistic::P1Low3 => p1.min(2),
                    _ => 2.min(rows.len() - 1),
                };
                rows[rank]
            }
        }
    }
}

/// How a bucket's layer scores give the depth b at its ratio. With n the number of leading
/// layers whose score exceeds τ (`safe_depth`):
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DepthRule {
    /// b = n: the official profiler.
    Leading,
    /// b = n - 1 when n < n_layers (0 when n = 0), else n_layers: the hidden state BiCache
    /// starts layer b from must be stable too, and s_b measures its drift (see the module
    /// comment). Layers 0..=b all pass.
    #[default]
    Boundary,
}

impl DepthRule {
    /// The name written into tables and used by the CLI (`leading`, `boundary`).
    pub fn name(self) -> &'static str {
        match self {
            DepthRule::Leading => "leading",
            DepthRule::Boundary => "boundary",
        }
    }

    /// How b follows from the scores, for a table's `source`.
    pub fn describe(self) -> &'static str {
        match self {
            DepthRule::Leading => "b = n, the number of leading layers above tau",
            DepthRule::Boundary => {
                "b = n - 1 when layer n fails tau (layers 0..=b pass), all layers when none fails"
            }
        }
    }

    /// b for the layer scores `similarity` (one per layer) under `tau`.
    pub fn depth(self, similarity: &[f64], tau: f64) -> usize {
        match self {
            DepthRule::Leading => safe_depth(similarity, tau),
            DepthRule::Boundary => boundary_depth(similarity, tau),
        }
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
    /// The table's `source` (how it was made, e.g. the command line); the statistic and the
    /// rule are appended to it.
    pub source: String,
    /// How a layer's per-row cosines become its score (default `Mean`, the official one).
    pub statistic: RowStatistic,
    /// How the scores give the depth (default `Boundary`; `Leading` is the official one).
    pub rule: DepthRule,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        Self {
            tau: 0.97,
            gen_length: 0,
            model_id: None,
            source: String::new(),
            statistic: RowStatistic::default(),
            rule: DepthRule::default(),
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
    /// s_l for every layer (under the options' statistic).
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
    /// Per ratio bucket, ascending: (r, samples, mean over the items of s_l, every layer).
    pub similarity: Vec<(u32, usize, Vec<f64>)>,
    /// Items left out, with the reason: (index, reason).
    pub skipped: Vec<(usize, String)>,
    /// The statistic the scores were made with.
    pub statistic: RowStatistic,
    /// The rule the depths were taken by.
    pub rule: DepthRule,
}

impl Profile {
    /// The depth of every bucket of `similarity` under the profile's rule, in its order.
    pub fn depths(&self) -> Vec<usize> {
        self.similarity
            .iter()
            .map(|(_, _, s)| self.rule.depth(s, self.table.tau))
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
        let reasons = if reasons.is_empty() {
            "no items given".to_string()
        } else {
            reasons.join("; ")
        };
        return Err(crate::Refusal::NothingToProfile(reasons).into());
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
        let similarity =
            layer_similarity(engine, &alone, &joint, prefix.len(), opts.statistic).await?;
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
        source: table_source(&opts.source, opts.statistic, opts.rule),
        n_layers,
        entries: depth_entries(&similarity, opts.tau, opts.rule),
    };
    Ok(Profile {
        table,
        similarity,
        skipped,
        statistic: opts.statistic,
        rule: opts.rule,
    })
}

/// A table's `source`: how it was made (`source`), then the statistic and the rule, so a
/// reader of the table knows which made it (`DepthTable` has no fields of its own for them).
pub fn table_source(source: &str, statistic: RowStatistic, rule: DepthRule) -> String {
    let method = format!(
        "row statistic: {} ({}); depth rule: {} ({})",
        statistic.name(),
        statistic.describe(),
        rule.name(),
        rule.describe()
    );
    if source.is_empty() {
        method
    } else {
        format!("{source}; {method}")
    }
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
    let model = engine.model();
    let plan = StepPlan::alone(&[SeqStep::whole(ids.len())], model.cfg.n_layers, false)
        .map_err(|e| EngineError::Internal(e.to_string()))?;
    let mut step = StepEncoder::new(engine.ctx(), "profile pass");
    model.encode_plan(&mut step, st, None, &plan, ids, Default::default())?;
    step.submit()?;
    Ok(())
}

/// s_l for every layer: the cosine of each of the first `p` rows of K (and of V) in the two
/// arenas, made one score by `statistic`.
async fn layer_similarity(
    engine: &Engine,
    alone: &ForwardState,
    joint: &ForwardState,
    p: usize,
    statistic: RowStatistic,
) -> Result<Vec<f64>, EngineError> {
    let c = &engine.model().cfg;
    let width = c.n_kv_heads * c.head_dim();
    let read = async |t: &unmask_gpu::Tensor| -> Result<Vec<f32>, EngineError> {
        Ok(t.read_values_async(engine.ctx(), p * width).await?)
    };
    let mut out = Vec::with_capacity(c.n_layers);
    for (a, j) in alone.kv.iter().zip(&joint.kv) {
        let k = row_cosines(&read(&a.k).await?, &read(&j.k).await?, width);
        let v = row_cosines(&read(&a.v).await?, &read(&j.v).await?, width);
        out.push(statistic.score(&k, &v));
    }
    Ok(out)
}

/// The cosine similarity of every pair of matching rows of `a` and `b` (f64).
pub fn row_cosines(a: &[f32], b: &[f32], width: usize) -> Vec<f64> {
    if width == 0 {
        return Vec::new();
    }
    a.chunks_exact(width)
        .zip(b.chunks_exact(width))
        .map(|(x, y)| cosine(x, y))
        .collect()
}

/// The mean of `values`; 1 (identical) when there are none.
fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        1.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
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

/// Leading layers whose similarity exceeds `tau` (stops at the first that does not): n, the
/// depth of `DepthRule::Leading`.
pub fn safe_depth(similarity: &[f64], tau: f64) -> usize {
    similarity.iter().take_while(|&&s| s > tau).count()
}

/// The depth of `DepthRule::Boundary`: with n = `safe_depth`, n - 1 when a layer fails (the
/// layer whose K/V failed is fed by the boundary state, so that state is not reused; 0 when
/// the first layer fails), every layer when none fails.
pub fn boundary_depth(similarity: &[f64], tau: f64) -> usize {
    let n = safe_depth(similarity, tau);
    if n < similarity.len() {
        n.saturating_sub(1)
    } else {
        n
    }
}

/// The table r → b: r = 0 with the smallest depth of any bucket, then every ratio whose
/// depth (under `rule`) exceeds the depths of all smaller ratios (a monotone step function).
pub fn depth_entries(
    similarity: &[(u32, usize, Vec<f64>)],
    tau: f64,
    rule: DepthRule,
) -> Vec<(u32, usize)> {
    let depths: Vec<(u32, usize)> = similarity
        .iter()
        .map(|(r, _, s)| (*r, rule.depth(s, tau)))
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
mod tests;
