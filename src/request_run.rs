//! One request run a step at a time: for callers that interleave requests (a server's
//! scheduler) or stop one midway (a desktop app's cancel button). Dropping the run stops it
//! and frees its GPU state; a BiCache request's pin on its prefix entry goes with it.

use crate::batch::BatchSession;
use crate::run::AloneRun;
use crate::{Engine, EngineError, Generation, Request, StepEvent};

/// A request that runs when stepped. See `Engine::start`.
pub struct RequestRun<'e> {
    inner: Inner<'e>,
    steps: usize,
}

enum Inner<'e> {
    Alone(Box<AloneRun<'e, 'static>>),
    /// A BiCache request that shares its prefix entry: a batch session of one.
    Shared {
        session: Box<BatchSession<'e>>,
    },
    Done,
}

impl Engine {
    /// Prepares `request` and its GPU state; nothing runs until `RequestRun::step`. A
    /// BiCache request whose prefix entry cannot be stored runs with its fallback mode, as
    /// `generate` does.
    pub fn start(&self, request: Request) -> Result<RequestRun<'_>, EngineError> {
        let prepared = self.prepare(std::borrow::Cow::Owned(request.clone()))?;
        let inner = match prepared.shared {
            None => Inner::Alone(Box::new(AloneRun::new(self, prepared)?)),
            Some((depth, _)) => {
                let prefix = prepared.prefix().to_vec();
                let rows = prepared.sampler.tokens().len();
                match self.batch_session(&prefix, depth, rows) {
                    Ok(mut session) => {
                        session.submit(request)?;
                        Inner::Shared {
                            session: Box::new(session),
                        }
                    }
                    Err(EngineError::Refused(why)) => {
                        let mut prepared = prepared;
                        prepared.fall_back(why);
                        Inner::Alone(Box::new(AloneRun::new(self, prepared)?))
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        Ok(RequestRun { inner, steps: 0 })
    }
}

impl RequestRun<'_> {
    /// Steps run so far.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Whether the request has finished (its generation was handed back).
    pub fn is_done(&self) -> bool {
        matches!(self.inner, Inner::Done)
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
        let result = match &mut self.inner {
            Inner::Done => {
                return Err(EngineError::Invalid {
                    field: "step",
                    expected: "a request still running".into(),
                    found: "a request that has finished".into(),
                });
            }
            Inner::Alone(run) => run.step(on_step).await,
            Inner::Shared { session } => {
                let mut done = session.step_async(&mut |_, event| on_step(event)).await;
                match done.pop() {
                    None => Ok(None),
                    Some((_, generation)) => generation.map(Some),
                }
            }
        };
        self.steps += 1;
        if !matches!(result, Ok(None)) {
            self.inner = Inner::Done;
        }
        result
    }
}
