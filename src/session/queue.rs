//! A queue of requests run with continuous batching: at most N at once, each finished
//! request's place taken by the next one at the following step, as a server's scheduler
//! fills its batches. Requests that share a prefix entry run in that prefix's session;
//! the others share a session without one.

use std::borrow::Cow;
use std::ops::ControlFlow;

use super::{PrefixKey, Session};
use crate::run::Prepared;
use crate::{Engine, EngineError, Generation, Refusal, Request, StepEvent};

/// A session of the queue and which request each of its ids is.
struct Lane<'e> {
    session: Session<'e>,
    /// (session id, request index) of the members running or waiting in it.
    members: Vec<(usize, usize)>,
}

impl<'e> Lane<'e> {
    fn index(&self, id: usize) -> Option<usize> {
        self.members.iter().find(|(s, _)| *s == id).map(|&(_, i)| i)
    }

    /// Whether a request sharing `prefix` at `depth` (or sharing none) may join: the same
    /// prefix at a depth no deeper than its own (a request may reuse fewer shallow layers
    /// than its policy allows, never more), or no prefix for either.
    fn takes(&self, shared: Option<(&[u32], usize)>) -> bool {
        match (self.session.prefix(), shared) {
            (None, None) => true,
            (Some(key), Some((tokens, depth))) => key.tokens == tokens && key.depth <= depth,
            _ => false,
        }
    }
}

impl Engine {
    /// `generate_continuous_async` without step events, blocking: the results in the order
    /// given.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate_continuous(
        &self,
        requests: &[Request],
        max_running: usize,
    ) -> Vec<Result<Generation, EngineError>> {
        let mut results: Vec<Option<Result<Generation, EngineError>>> =
            requests.iter().map(|_| None).collect();
        self.generate_continuous_with(requests, max_running, &mut |i, g| {
            results[i] = Some(g);
            ControlFlow::Continue(())
        });
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(EngineError::Internal("a request did not run".into())))
            })
            .collect()
    }

    /// `generate_continuous_async` without step events, blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate_continuous_with(
        &self,
        requests: &[Request],
        max_running: usize,
        on_done: &mut dyn FnMut(usize, Result<Generation, EngineError>) -> ControlFlow<()>,
    ) {
        pollster::block_on(self.generate_continuous_async(
            requests,
            max_running,
            &mut |_, _| {},
            on_done,
        ));
    }

    /// Runs `requests` with continuous batching: at most `max_running` at once (in the
    /// same forward passes where they may share them), the next one joining as soon as
    /// one finishes. `on_done` gets each request's index and result as it finishes (not
    /// in order) and stops the rest by breaking; `on_step` gets every step. A request that
    /// cannot run gets its error and the rest go on.
    ///
    /// Requests with the same shared prefix run in its session at the first one's depth b
    /// (a later request whose own depth is smaller gets a session of its own); a request
    /// whose entry cannot be stored runs with its mode's fallback, like `generate`.
    pub async fn generate_continuous_async(
        &self,
        requests: &[Request],
        max_running: usize,
        on_step: &mut dyn FnMut(usize, &StepEvent<'_>),
        on_done: &mut dyn FnMut(usize, Result<Generation, EngineError>) -> ControlFlow<()>,
    ) {
        let max_running = max_running.max(1);
        let mut prepared: Vec<Option<Prepared<'static>>> = Vec::with_capacity(requests.len());
        for (i, request) in requests.iter().enumerate() {
            match self.prepare(Cow::Owned(request.clone())) {
                Ok(p) => prepared.push(Some(p)),
                Err(e) => {
                    prepared.push(None);
                    if on_done(i, Err(e)).is_break() {
                        return;
                    }
                }
            }
        }
        // Members keep their arena rows from joining to finishing; each takes a slot of
        // `longest` rows, so n slots always hold the n running whatever order they finish
        // in (windows packed by length would leave gaps: (2n − 1)·longest rows). When n
        // slots are over one storage binding the windows are packed by length in what the
        // binding holds instead (a request may then wait for room, and one longer than the
        // binding gets its refusal; slots of it would leave no room for the rest).
        let longest = prepared
            .iter()
            .flatten()
            .map(|p| p.sampler.tokens().len())
            .max()
            .unwrap_or(1);
        let cap = self.model.max_state_rows();
        let slot_rows = (longest * max_running <= cap).then_some(longest);
        let rows = match slot_rows {
            Some(slot) => slot * max_running,
            None => (longest * (2 * max_running - 1)).min(cap),
        };
        let mut lanes: Vec<Lane<'_>> = Vec::new();
        let mut next = 0;
        loop {
            let mut running: usize = lanes.iter().map(|l| l.members.len()).sum();
            while running < max_running && next < prepared.len() {
                let i = next;
                next += 1;
                let Some(p) = prepared[i].take() else {
                    continue;
                };
                match self.join(&mut lanes, p, rows, slot_rows) {
                    Ok((k, id)) => {
                        lanes[k].members.push((id, i));
                        running += 1;
                    }
                    Err(e) => {
                        if on_done(i, Err(e)).is_break() {
                            return;
                        }
                    }
                }
            }
            if lanes.is_empty() {
                return;
            }
            for lane in &mut lanes {
                let members = &lane.members;
                let done = lane
                    .session
                    .step_async(&mut |id, event| {
                        if let Some(i) = members.iter().find(|(s, _)| *s == id).map(|&(_, i)| i) {
                            on_step(i, event)
                        }
                    })
                    .await;
                for (id, g) in done {
                    let Some(i) = lane.index(id) else { continue };
                    lane.members.retain(|(s, _)| *s != id);
                    if on_done(i, g).is_break() {
                        return;
                    }
                }
            }
            // A session with nothing left lets its pin go (the entry stays stored).
            lanes.retain(|l| !l.session.is_idle());
        }
    }

    /// Admits `p` to the lane that takes it, or to a new session: its prefix's (built if
    /// not stored; when it cannot be stored `p` falls back and shares none) or one without
    /// a prefix; a new session has `rows` rows, in slots of `slot_rows` when given. Returns the lane
    /// and the request's id there.
    fn join<'e>(
        &'e self,
        lanes: &mut Vec<Lane<'e>>,
        mut p: Prepared<'static>,
        rows: usize,
        slot_rows: Option<usize>,
    ) -> Result<(usize, usize), EngineError> {
        let shared =
            |p: &Prepared<'static>| p.shared.map(|(depth, _)| (p.prefix().to_vec(), depth));
        let find = |lanes: &[Lane<'e>], shared: &Option<(Vec<u32>, usize)>| {
            lanes
                .iter()
                .position(|l| l.takes(shared.as_ref().map(|(t, d)| (t.as_slice(), *d))))
        };
        let mut wanted = shared(&p);
        let mut k = find(lanes, &wanted);
        if k.is_none()
            && let Some((tokens, depth)) = wanted.clone()
        {
            match self.session(Some(&PrefixKey { tokens, depth }), rows) {
                Ok(mut session) => {
                    session.charge_setup = true;
                    session.slot_rows = slot_rows;
                    lanes.push(Lane {
                        session,
                        members: Vec::new(),
                    });
                    k = Some(lanes.len() - 1);
                }
                Err(EngineError::Refused(why @ Refusal::PrefixNotStored(_))) => {
                    p.fall_back(why.to_string());
                    wanted = None;
                    k = find(lanes, &wanted);
                }
                Err(e) => return Err(e),
            }
        }
        let k = match k {
            Some(k) => k,
            None => {
                let mut session = self.session(None, rows)?;
                session.slot_rows = slot_rows;
                lanes.push(Lane {
                    session,
                    members: Vec::new(),
                });
                lanes.len() - 1
            }
        };
        // Its timings count from joining, as each request of `generate_batch` (the queue
        // before is the caller's wait, not the request's).
        p.start = crate::Stopwatch::start();
        let id = lanes[k].session.admit(p)?;
        Ok((k, id))
    }
}
