//! A request's shared prompt part (its system turn) and the prefix store: copied at `start`
//! when stored; otherwise encoded a piece per round by one of the runs that want it, stored,
//! and copied by the others (`settle_shared_prefixes`).

use std::sync::Mutex;

use super::{DgemmaRun, RunState};
use crate::context::GpuContext;
use crate::dgemma::prefix::check_shared;
use crate::dgemma::{DgemmaCache, DgemmaModel, DgemmaPrefixStore, PrefixUse};
use crate::model::ModelError;

/// The prompt's first `shared` tokens (a system turn many requests share) through a prefix
/// store: their K/V copied when stored, else encoded and stored. With `whole_prompt` the
/// whole prompt goes through it too (the choices of one request, which share all of it):
/// copied when stored, else encoded once (after a stored system turn, when there is one)
/// by one of the runs that want it while the others wait.
pub struct SharedPrefix<'a> {
    pub shared: usize,
    pub whole_prompt: bool,
    pub store: &'a mut DgemmaPrefixStore,
}

/// Where a round (`step_runs_async`) finds the prefix store its runs' shared parts go
/// through.
pub enum RoundStore<'a> {
    /// The caller's own, held for the whole round.
    Held(&'a mut DgemmaPrefixStore),
    /// Shared with other callers: locked for each of the round's uses alone, not across its
    /// passes.
    Locked(&'a Mutex<DgemmaPrefixStore>),
}

impl RoundStore<'_> {
    /// `settle_shared_prefixes` with the store.
    pub(super) fn settle(
        &mut self,
        model: &DgemmaModel,
        ctx: &GpuContext,
        runs: &mut [&mut DgemmaRun<'_>],
    ) -> Vec<usize> {
        match self {
            RoundStore::Held(store) => model.settle_shared_prefixes(ctx, runs, store),
            RoundStore::Locked(store) => {
                let mut store = store.lock().unwrap_or_else(|e| e.into_inner());
                model.settle_shared_prefixes(ctx, runs, &mut store)
            }
        }
    }
}

/// A run's shared prompt part that the prefix store did not hold when it started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SharedPart {
    /// Nothing to do with the store (none asked, copied from it, or stored already).
    Settled,
    /// Its first n tokens are wanted from the store, and another run is encoding them (or
    /// `settle_shared_prefixes` has not looked yet): it encodes nothing meanwhile.
    Waiting(usize),
    /// This run encodes its first n tokens (its pieces stop there) and stores them once in.
    Encoding(usize),
}

impl DgemmaModel {
    /// `start`'s use of the store: a stored shared part copied into `cache`; one the store
    /// could not hold even alone encoded as the rest of the prompt; else left waiting
    /// (`settle_shared_prefixes`). A whole prompt asked for (and small enough to store) is
    /// copied when stored; else it is the run's next part once its system turn is settled
    /// (the second value: `DgemmaRun::whole`), so a new system turn is stored on its own
    /// first, for other requests.
    pub(super) fn start_shared(
        &self,
        ctx: &GpuContext,
        cache: &mut DgemmaCache,
        prompt: &[u32],
        prefix: Option<SharedPrefix<'_>>,
    ) -> Result<(SharedPart, Option<usize>, Option<PrefixUse>), ModelError> {
        let Some(SharedPrefix {
            shared,
            whole_prompt,
            store,
        }) = prefix
        else {
            return Ok((SharedPart::Settled, None, None));
        };
        check_shared(prompt, shared)?;
        let whole = (whole_prompt && !prompt.is_empty() && store.holds(self, cache, prompt.len()))
            .then_some(prompt.len());
        if let Some(n) = whole
            && self.copy_stored(ctx, cache, prompt, store)?
        {
            return Ok((
                SharedPart::Settled,
                whole,
                Some(PrefixUse::Hit { reused: n }),
            ));
        }
        // With the system turn settled here, the whole prompt (when asked) is next.
        let next = whole.map_or(SharedPart::Settled, SharedPart::Waiting);
        if shared == 0 {
            let used = whole.is_none().then_some(PrefixUse::Uncached);
            return Ok((next, whole, used));
        }
        if self.copy_stored(ctx, cache, &prompt[..shared], store)? {
            return Ok((next, whole, Some(PrefixUse::Hit { reused: shared })));
        }
        if !store.holds(self, cache, shared) {
            store.misses += 1;
            store.rejected += 1;
            return Ok((SharedPart::Settled, None, Some(PrefixUse::Uncached)));
        }
        Ok((SharedPart::Waiting(shared), whole, None))
    }

    /// The prefix store's part of a round (`step_runs_async` runs it before and after the
    /// round's prompt pieces): a run whose unstored shared part is now encoded stores it; a
    /// run waiting for a shared part copies it once stored, and becomes its encoder when no
    /// run of `runs` encodes it (the one that did failed, was stopped, or could not store
    /// it). So requests that arrive together with a new system turn encode it once, a piece
    /// per round, while the running requests go on denoising. A run whose copy or store
    /// fails fails alone.
    ///
    /// Returns the runs it settled (stored, copied or released) that have prompt left:
    /// after the round's pieces, `encode_settled_pieces` gives them their next piece at once.
    pub(super) fn settle_shared_prefixes(
        &self,
        ctx: &GpuContext,
        runs: &mut [&mut DgemmaRun<'_>],
        store: &mut DgemmaPrefixStore,
    ) -> Vec<usize> {
        let mut settled = Vec::new();
        // Encoders whose part is in store it and serve its waiters at once (another turn's
        // insert could evict it before a later pass over the waiters). A part that could
        // not be stored releases its waiters to encode their own prompts together, not one
        // after another.
        for e in 0..runs.len() {
            let SharedPart::Encoding(n) = runs[e].shared else {
                continue;
            };
            if runs[e].is_done() || runs[e].cache.len < n {
                continue;
            }
            let run = &mut *runs[e];
            run.settle_part(n);
            // Past the part (no settle ran after its last piece) a sliding layer may no
            // longer hold the part's own rows: it is not stored then. A whole prompt is
            // kept for its request's choices, and goes first when room is needed.
            let used = if run.cache.len == n {
                let transient = run.whole == Some(n);
                self.store_prefix(ctx, &run.cache, &run.sequence[..n], store, transient)
            } else {
                Ok(PrefixUse::Uncached)
            };
            let stored = matches!(used, Ok(PrefixUse::Stored { .. }));
            match used {
                // A system turn reused or stored before stays the run's report.
                Ok(PrefixUse::Uncached) if run.prefix_use.is_some() => {}
                Ok(used) => run.prefix_use = Some(used),
                Err(err) => run.state = RunState::Failed(err),
            }
            let head = run.sequence[..n].to_vec();
            settled.push(e);
            for (i, w) in runs.iter_mut().enumerate() {
                if w.is_done() || w.shared != SharedPart::Waiting(n) || w.sequence[..n] != head {
                    continue;
                }
                if !(stored && self.copy_waiting(ctx, w, n, store)) {
                    store.misses += 1;
                    w.settle_part(n);
                    // A system turn copied before it waited for its whole prompt stays used.
                    if w.shared == SharedPart::Settled {
                        w.prefix_use.get_or_insert(PrefixUse::Uncached);
                    }
                }
                settled.push(i);
            }
        }
        for i in 0..runs.len() {
            let SharedPart::Waiting(n) = runs[i].shared else {
                continue;
            };
            if runs[i].is_done() {
                continue;
            }
            if self.copy_waiting(ctx, runs[i], n, store) {
                settled.push(i);
                continue;
            }
            let head = &runs[i].sequence[..n];
            let encoder = runs.iter().any(|r| {
                !r.is_done() && r.shared == SharedPart::Encoding(n) && r.sequence[..n] == *head
            });
            if !encoder {
                store.misses += 1;
                runs[i].shared = SharedPart::Encoding(n);
            }
        }
        settled.retain(|&i| !runs[i].is_done() && runs[i].prompt_left > 0);
        settled
    }

    /// The next prompt piece of each run of `settled` (`settle_shared_prefixes`' answer after
    /// the round's pieces): a stored or copied system turn's request goes on with its own
    /// turn in the same round instead of the next one. A piece that fails fails its run alone.
    pub(super) fn encode_settled_pieces(
        &self,
        ctx: &GpuContext,
        runs: &mut [&mut DgemmaRun<'_>],
        settled: &[usize],
    ) {
        for &i in settled {
            let run = &mut *runs[i];
            if run.is_done() || run.prompt_left == 0 || run.shared != SharedPart::Settled {
                continue;
            }
            if let Err(e) = self.encode_prompt_piece(ctx, run) {
                run.state = RunState::Failed(e);
            }
        }
    }

    /// A waiting run's shared part copied from the store: false when the store does not
    /// hold it (the run still waits); a failed copy fails the run.
    fn copy_waiting(
        &self,
        ctx: &GpuContext,
        run: &mut DgemmaRun<'_>,
        n: usize,
        store: &mut DgemmaPrefixStore,
    ) -> bool {
        match self.copy_stored(ctx, &mut run.cache, &run.sequence[..n], store) {
            Ok(true) => {
                run.settle_part(n);
                run.prefix_use = Some(PrefixUse::Hit { reused: n });
                run.prompt_left = run.sequence.len() - n;
                true
            }
            Ok(false) => false,
            Err(e) => {
                run.state = RunState::Failed(e);
                true
            }
        }
    }
}

impl DgemmaRun<'_> {
    /// Its shared part of `n` tokens is settled (copied, stored or given up): the whole
    /// prompt is its next part when it asked for it and `n` was its system turn.
    fn settle_part(&mut self, n: usize) {
        self.shared = match self.whole {
            Some(w) if n < w && !self.is_done() => SharedPart::Waiting(w),
            _ => SharedPart::Settled,
        };
    }
}
