//! BiCache's shared prefix entries: the depth a request shares, the pinned entry it runs
//! with, and the engine's store of them.

use std::sync::{Arc, MutexGuard};

use unmask_core::depth_policy::prefix_ratio;
use unmask_core::prefix_store::{Pin, PrefixStore, Recount, StoreStats};
use unmask_gpu::model::ForwardState;

use crate::bicache::{self, PrefixEntry};
use crate::{DEPTH_TABLE_FILE, Engine, EngineError, Request, Timings};

/// A pinned shared entry in use by one request; the pin goes when this is dropped.
pub(crate) struct PrefixRun {
    _pin: Pin<Arc<PrefixEntry>>,
    pub(crate) entry: Arc<PrefixEntry>,
    /// The boundary state of the run's depth: the entry's, or the run's own when the store
    /// could not take its bytes.
    pub(crate) boundary: Arc<unmask_gpu::Tensor>,
    pub(crate) hit: bool,
}

/// A shared entry pinned for one request, and whether it was already stored.
pub(crate) struct HeldEntry {
    pub(crate) pin: Pin<Arc<PrefixEntry>>,
    pub(crate) entry: Arc<PrefixEntry>,
    pub(crate) hit: bool,
}

impl Engine {
    /// b for a request: the request's own, else the model's depth table at
    /// r = round(100·P/(P+U+G)); an error message when neither exists.
    pub(crate) fn bicache_depth(
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
        match self.depth_table() {
            Some(t) => Ok((t.depth(ratio).min(n_layers), ratio)),
            None => Err(format!(
                "{} has no {DEPTH_TABLE_FILE}: profile the model (unmask profile) or give the depth explicitly",
                self.dir().display()
            )),
        }
    }

    /// The shared entry for `prefix` (pinned) with the boundary state of `depth`, built on
    /// a miss; Ok(Err(why)) when it cannot be stored and the request must run uncached.
    pub(crate) fn acquire_prefix(
        &self,
        st: &ForwardState,
        prefix: &[u32],
        depth: usize,
        timings: &mut Timings,
    ) -> Result<Result<PrefixRun, String>, EngineError> {
        let HeldEntry { pin, entry, hit } =
            match self.acquire_entry(st, prefix, Some(depth), timings)? {
                Ok(found) => found,
                Err(why) => return Ok(Err(why)),
            };
        // From here every return, `?` included, drops `pin` and so releases it.
        let boundary = match entry.boundary(depth) {
            Some(b) => b,
            None => {
                timings.token_layer_passes += prefix.len() * depth;
                let b = bicache::compute_boundary(&self.model, st, prefix, depth)?;
                // Kept in the entry only when the store can charge its bytes; else this
                // request uses it alone.
                let mut store = self.store()?;
                if entry.boundary(depth).is_none() && store.charge(pin.id(), b.size_bytes()).is_ok()
                {
                    entry.add_boundary(depth, b.clone());
                }
                b
            }
        };
        Ok(Ok(PrefixRun {
            _pin: pin,
            entry,
            boundary,
            hit,
        }))
    }

    /// The shared entry of `tokens` (a BiCache prefix or an ACache span), pinned, with
    /// whether it was stored; built on a miss (with the boundary state of `depth` when
    /// given); Ok(Err(why)) when it cannot be stored.
    pub(crate) fn acquire_entry(
        &self,
        st: &ForwardState,
        tokens: &[u32],
        depth: Option<usize>,
        timings: &mut Timings,
    ) -> Result<Result<HeldEntry, String>, EngineError> {
        let n_layers = self.model.cfg.n_layers;
        let found = {
            let mut store = self.store()?;
            store.acquire(self.model_id, tokens).map(|id| {
                let entry = store.payload(id).cloned();
                (Pin::adopt(&self.prefix_store, id), entry)
            })
        };
        if let Some((pin, Some(entry))) = found {
            self.injected_fault()?;
            return Ok(Ok(HeldEntry {
                pin,
                entry,
                hit: true,
            }));
        }
        // Checked before building, so an entry that can never fit costs no GPU work.
        let budget = self.store()?.budget();
        let bytes = bicache::entry_bytes(&self.model, tokens.len(), depth.is_some());
        if tokens.len() > budget.max_tokens || bytes > budget.max_bytes {
            return Ok(Err(format!(
                "the shared tokens ({} tokens, {bytes} bytes) exceed the cache budget ({} tokens, {} bytes)",
                tokens.len(),
                budget.max_tokens,
                budget.max_bytes
            )));
        }
        let entry = Arc::new(bicache::build_entry(&self.model, st, tokens, depth)?);
        timings.token_layer_passes += tokens.len() * n_layers;
        timings.forward_passes += 1;
        let mut store = self.store()?;
        match store.insert(self.model_id, tokens.to_vec(), bytes, entry.clone()) {
            Ok(id) => {
                let pin = Pin::adopt(&self.prefix_store, id);
                drop(store);
                self.injected_fault()?;
                Ok(Ok(HeldEntry {
                    pin,
                    entry,
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
    pub(crate) fn store(
        &self,
    ) -> Result<MutexGuard<'_, PrefixStore<Arc<PrefixEntry>>>, EngineError> {
        self.prefix_store
            .lock()
            .map_err(|_| EngineError::Internal("prefix store poisoned".into()))
    }

    /// Starts (or stops) recording what the shared prefix store stores and removes, for
    /// `take_store_events` (a publisher of KV-cache events).
    pub fn record_store_events(&self, on: bool) {
        if let Ok(mut s) = self.prefix_store.lock() {
            s.record_events(on);
        }
    }

    /// The store's changes since the last call (with `record_store_events` on).
    pub fn take_store_events(&self) -> Vec<unmask_core::prefix_store::StoreEvent> {
        self.prefix_store
            .lock()
            .map(|mut s| s.take_events())
            .unwrap_or_default()
    }

    /// What the shared prefix store may hold.
    pub fn prefix_store_budget(&self) -> unmask_core::prefix_store::StoreBudget {
        let store = self
            .prefix_store
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        store.budget()
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
