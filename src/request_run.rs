//! One request run a step at a time: for callers that interleave requests or stop one
//! midway (a desktop app's cancel button). It is a session of one; dropping the run stops
//! it and frees its GPU state, and a BiCache request's pin on its prefix entry goes with it.

use crate::session::Session;
use crate::{Engine, EngineError, Generation, Request, StepEvent};

/// A request that runs when stepped. See `Engine::start`.
pub struct RequestRun<'e> {
    /// `None` once the generation was handed back.
    session: Option<Session<'e>>,
    steps: usize,
}

impl Engine {
    /// Prepares `request` and its GPU state; nothing runs until `RequestRun::step`. A
    /// BiCache request whose prefix entry cannot be stored runs with its fallback mode, as
    /// `generate` does.
    pub fn start(&self, request: Request) -> Result<RequestRun<'_>, EngineError> {
        let prepared = self.prepare(std::borrow::Cow::Owned(request))?;
        let rows = prepared.sampler.tokens().len();
        let (session, _) = self.session_for(prepared, rows)?;
        Ok(RequestRun {
            session: Some(session),
            steps: 0,
        })
    }
}

impl RequestRun<'_> {
    /// Steps run so far.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Whether the request has finished (its generation was handed back).
    pub fn is_done(&self) -> bool {
        self.session.is_none()
    }

    /// Runs one denoising step, calling `on_step` with it; the generation once the
    /// request is done. A step after that is an error.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(
        &mut self,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<Option<Generation>, EngineError> {
        pollster::block_on(self.step_async(on_step))
    }

    /// `step`, awaiting the step's read-back.
    pub async fn step_async(
        &mut self,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<Option<Generation>, EngineError> {
        let Some(session) = self.session.as_mut() else {
            return Err(EngineError::Invalid {
                field: "step",
                expected: "a request still running".into(),
                found: "a request that has finished".into(),
            });
        };
        let mut done = session.step_async(&mut |_, event| on_step(event)).await;
        self.steps += 1;
        let result = match done.pop() {
            Some((_, generation)) => generation.map(Some),
            None if session.is_idle() => Err(EngineError::Internal(
                "a session of one ended without a result".into(),
            )),
            None => Ok(None),
        };
        if !matches!(result, Ok(None)) {
            self.session = None;
        }
        result
    }
}
