//! DiffusionGemma's shared prefix store: encoded prompt prefixes kept on the GPU, per layer
//! the K/V rows of their positions. The encoder is causal, so a prefix's K/V do not depend on
//! anything after it: a request whose prompt starts with a stored prefix copies its rows and
//! encodes only the rest, with the same K/V as encoding the prefix itself (no depth policy, no
//! drift). A shared system prompt then costs one encoder pass per process, not per request.
//! Entries match by their exact token ids; the least recently used go first when the token
//! budget is passed.

use unmask_core::prefix_store::StoreStats;

use super::pass_limit::is_capacity;
use super::{DgemmaCache, DgemmaModel};
use crate::context::GpuContext;
use crate::model::ModelError;
use crate::step::StepEncoder;
use crate::tensor::Tensor;

/// A stored prefix: per layer the K/V a later pass can read — every position of a full
/// layer, the last W − 1 (from position `sliding_base`) of a sliding one.
struct Entry {
    ids: Vec<u32>,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    sliding_base: usize,
    last_used: u64,
    /// A whole prompt kept for the choices of one request, not a system turn for many:
    /// evicted before any other entry.
    transient: bool,
}

/// What `encode_prompt` did with the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixUse {
    /// The shared prefix's K/V came from the store: only the rest was encoded.
    Hit { reused: usize },
    /// The prefix was encoded and stored.
    Stored { tokens: usize },
    /// The prefix was encoded but not stored (no shared part, or over the budget alone).
    Uncached,
}

pub struct DgemmaPrefixStore {
    entries: Vec<Entry>,
    /// Most tokens all entries together may hold.
    pub budget_tokens: usize,
    /// Most GPU bytes their K/V may take (a sliding layer's W − 1 rows are most of an
    /// entry's bytes at the published shapes, whatever its length).
    pub budget_bytes: u64,
    clock: u64,
    pub hits: u64,
    pub misses: u64,
    /// Prefixes stored, evicted to make room, and refused (over the budget alone).
    pub inserts: u64,
    pub evictions: u64,
    pub rejected: u64,
}

impl DgemmaPrefixStore {
    pub fn new(budget_tokens: usize, budget_bytes: u64) -> Self {
        Self {
            entries: Vec::new(),
            budget_tokens,
            budget_bytes,
            clock: 0,
            hits: 0,
            misses: 0,
            inserts: 0,
            evictions: 0,
            rejected: 0,
        }
    }

    /// Tokens held by all entries.
    pub fn tokens(&self) -> usize {
        self.entries.iter().map(|e| e.ids.len()).sum()
    }

    /// GPU bytes held by all entries.
    pub fn bytes(&self) -> u64 {
        self.entries
            .iter()
            .flat_map(|e| e.k.iter().chain(&e.v))
            .map(Tensor::size_bytes)
            .sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The counters and what the store holds, as the other families' store reports them.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            hits: self.hits,
            misses: self.misses,
            inserts: self.inserts,
            evictions: self.evictions,
            rejected: self.rejected,
            entries: self.entries.len(),
            tokens: self.tokens(),
            bytes: self.bytes(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every entry (their GPU buffers with them); returns how many there were.
    pub fn clear(&mut self) -> usize {
        let n = self.entries.len();
        self.entries.clear();
        n
    }

    /// Whether a prefix of `n` tokens fits in the budget alone (with nothing else stored).
    pub(super) fn holds(&self, model: &DgemmaModel, cache: &DgemmaCache, n: usize) -> bool {
        self.holds_entry(n, entry_size(model, cache, n).1)
    }

    /// `holds` for an entry of `n` tokens and `bytes` already measured.
    fn holds_entry(&self, n: usize, bytes: u64) -> bool {
        n > 0 && n <= self.budget_tokens && bytes <= self.budget_bytes
    }

    /// Marks entry `i` as used now (the least recently used go first).
    fn touch(&mut self, i: usize) {
        self.clock += 1;
        self.entries[i].last_used = self.clock;
    }

    fn find(&self, ids: &[u32]) -> Option<usize> {
        self.entries.iter().position(|e| e.ids == ids)
    }

    /// Keeps rows `0..ids.len()` of `cache` (which must hold exactly `ids` there) under `ids`,
    /// evicting transient entries, then the least recently used, to stay within the budget
    /// (an entry for `ids` already there is kept instead). False when the prefix alone is
    /// over the budget.
    fn insert(
        &mut self,
        ctx: &GpuContext,
        model: &DgemmaModel,
        cache: &DgemmaCache,
        ids: &[u32],
        transient: bool,
    ) -> Result<bool, ModelError> {
        // Runs stepped apart (two engines' callers) may both encode a new prefix: it is
        // kept once.
        if let Some(i) = self.find(ids) {
            self.touch(i);
            return Ok(true);
        }
        let n = ids.len();
        let (sliding_base, need) = entry_size(model, cache, n);
        if !self.holds_entry(n, need) {
            self.rejected += 1;
            return Ok(false);
        }
        while self.tokens() + n > self.budget_tokens || self.bytes() + need > self.budget_bytes {
            let oldest = (0..self.entries.len())
                .min_by_key(|&i| (!self.entries[i].transient, self.entries[i].last_used))
                .expect("a store over its budget has entries");
            self.entries.swap_remove(oldest);
            self.evictions += 1;
        }
        let mut step = StepEncoder::new(ctx, "dgemma prefix store");
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (l, a) in model.cfg.layers.iter().enumerate() {
            let w = a.kv_heads * a.head_dim;
            let first = if a.sliding { sliding_base } else { 0 };
            let rows = n - first;
            let row = cache.row_bytes(a);
            let from = cache.row(a, first) as u64 * row;
            for (src, dst) in [(&cache.k[l], &mut k), (&cache.v[l], &mut v)] {
                let shape = [rows.max(1), w];
                let t = Tensor::zeros(ctx, cache.dtype, &shape, &format!("prefix kv {l}"))?;
                step.copy(&src.buffer, from, &t.buffer, 0, rows as u64 * row);
                dst.push(t);
            }
        }
        step.submit()?;
        self.clock += 1;
        self.inserts += 1;
        self.entries.push(Entry {
            ids: ids.to_vec(),
            k,
            v,
            sliding_base,
            last_used: self.clock,
            transient,
        });
        Ok(true)
    }
}

/// A shared part of `shared` tokens must lie within the prompt.
pub(super) fn check_shared(prompt: &[u32], shared: usize) -> Result<(), ModelError> {
    if shared > prompt.len() {
        return Err(ModelError::Input(format!(
            "shared prefix: expected at most the prompt's {} tokens, found {shared}",
            prompt.len()
        )));
    }
    Ok(())
}

/// An entry of `n` tokens: the first position its sliding layers keep, and its bytes.
fn entry_size(model: &DgemmaModel, cache: &DgemmaCache, n: usize) -> (usize, u64) {
    let sliding_base = n.saturating_sub(model.cfg.sliding_window.saturating_sub(1));
    let bytes = model
        .cfg
        .layers
        .iter()
        .map(|a| {
            let rows = if a.sliding { n - sliding_base } else { n };
            2 * rows.max(1) as u64 * cache.row_bytes(a)
        })
        .sum();
    (sliding_base, bytes)
}

impl DgemmaModel {
    /// Encodes `prompt` into the empty `cache`, its first `shared` tokens (the part many
    /// requests share: a system turn) through `store` (`encode_shared`), then the rest.
    pub fn encode_prompt(
        &self,
        ctx: &GpuContext,
        cache: &mut DgemmaCache,
        prompt: &[u32],
        shared: usize,
        store: &mut DgemmaPrefixStore,
    ) -> Result<PrefixUse, ModelError> {
        let used = self.encode_shared(ctx, cache, prompt, shared, store)?;
        if cache.len < prompt.len() {
            self.append(ctx, cache, &prompt[cache.len..])?;
        }
        Ok(used)
    }

    /// Encodes the first `shared` tokens of `prompt` (the part many requests share: a
    /// system turn) into the empty `cache` through `store`: copied from it when stored, else
    /// encoded and stored. The rest of the prompt is left to the caller (from `cache.len`).
    pub fn encode_shared(
        &self,
        ctx: &GpuContext,
        cache: &mut DgemmaCache,
        prompt: &[u32],
        shared: usize,
        store: &mut DgemmaPrefixStore,
    ) -> Result<PrefixUse, ModelError> {
        if cache.len != 0 {
            return Err(ModelError::Input(format!(
                "cache: expected an empty cache for a new prompt, found {} positions",
                cache.len
            )));
        }
        if prompt.len() > cache.capacity {
            return Err(ModelError::Input(format!(
                "prompt: expected at most the cache's {} positions, found {} tokens",
                cache.capacity,
                prompt.len()
            )));
        }
        check_shared(prompt, shared)?;
        let head = &prompt[..shared];
        let used = if shared == 0 {
            PrefixUse::Uncached
        } else if self.copy_stored(ctx, cache, head, store)? {
            PrefixUse::Hit { reused: shared }
        } else {
            store.misses += 1;
            self.append(ctx, cache, head)?;
            self.store_prefix(ctx, cache, head, store, false)?
        };
        Ok(used)
    }

    /// Copies `head`'s K/V into `cache` from its first row (what it held is overwritten)
    /// when `store` holds it (a hit); false when it does not (nothing changed).
    pub(super) fn copy_stored(
        &self,
        ctx: &GpuContext,
        cache: &mut DgemmaCache,
        head: &[u32],
        store: &mut DgemmaPrefixStore,
    ) -> Result<bool, ModelError> {
        let Some(i) = store.find(head) else {
            return Ok(false);
        };
        store.hits += 1;
        store.touch(i);
        let e = &store.entries[i];
        let mut step = StepEncoder::new(ctx, "dgemma prefix reuse");
        for (l, a) in self.cfg.layers.iter().enumerate() {
            let first = if a.sliding { e.sliding_base } else { 0 };
            if e.k[l].dtype != cache.dtype {
                return Err(ModelError::Input(format!(
                    "prefix entry: stored as {:?} K/V, the cache holds {:?}",
                    e.k[l].dtype, cache.dtype
                )));
            }
            let bytes = (head.len() - first) as u64 * cache.row_bytes(a);
            step.copy(&e.k[l].buffer, 0, &cache.k[l].buffer, 0, bytes);
            step.copy(&e.v[l].buffer, 0, &cache.v[l].buffer, 0, bytes);
        }
        step.submit()?;
        cache.sliding_base = e.sliding_base;
        cache.len = head.len();
        Ok(true)
    }

    /// Keeps rows `0..head.len()` of `cache` (holding exactly `head` there) in `store`. The
    /// store saves work, it never fails a request: an entry there is no memory for (after
    /// the kept step buffers are given back) is not kept.
    pub(super) fn store_prefix(
        &self,
        ctx: &GpuContext,
        cache: &DgemmaCache,
        head: &[u32],
        store: &mut DgemmaPrefixStore,
        transient: bool,
    ) -> Result<PrefixUse, ModelError> {
        match self.retry_after_freeing(|| store.insert(ctx, self, cache, head, transient)) {
            Ok(true) => Ok(PrefixUse::Stored { tokens: head.len() }),
            Ok(false) => Ok(PrefixUse::Uncached),
            Err(e) if is_capacity(&e) => {
                store.rejected += 1;
                Ok(PrefixUse::Uncached)
            }
            Err(e) => Err(e),
        }
    }
}
