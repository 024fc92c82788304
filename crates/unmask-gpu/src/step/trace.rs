//! The dispatch list of recorded steps, with the time of each dispatch when asked: GPU
//! timestamps where the adapter has `TIMESTAMP_QUERY`, else CPU wall clock around each
//! dispatch submitted and waited for alone (which adds the submit and wake-up latency).

use std::sync::Mutex;

/// How dispatch times were measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceClock {
    /// Only the list: nothing was timed.
    None,
    /// Timestamps written by the GPU at the start and end of each dispatch's pass.
    GpuTimestamps,
    /// Host wall clock around a submit-and-wait of each dispatch alone.
    CpuWallClock,
}

impl TraceClock {
    pub fn name(self) -> &'static str {
        match self {
            TraceClock::None => "none",
            TraceClock::GpuTimestamps => "gpu-timestamps",
            TraceClock::CpuWallClock => "cpu-wall-clock",
        }
    }
}

/// One dispatch of a traced step.
#[derive(Clone, Debug, PartialEq)]
pub struct TracedDispatch {
    /// `file:entry` of the kernel.
    pub kernel: String,
    /// Its specialisation (flags and constants).
    pub variant: String,
    /// The transformer layer it belongs to (`None`: embedding, LM head, selection).
    pub layer: Option<u32>,
    pub workgroups: [u32; 3],
    /// Milliseconds, when timed.
    pub ms: Option<f64>,
}

/// The dispatches and copies of one submitted step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTrace {
    pub label: &'static str,
    pub clock: TraceClock,
    pub dispatches: Vec<TracedDispatch>,
    /// Buffer-to-buffer copies recorded in the step (read-back copies included).
    pub copies: usize,
    /// Host milliseconds spent in `submit` recording and submitting the step (bind group
    /// lookups, encoding, queue submit), untimed runs only; `None` in a browser.
    pub encode_ms: Option<f64>,
    /// The context's host counters right after this step was submitted: the difference
    /// from the previous step's is what the host did for this one (submits, bind groups
    /// and buffers created).
    pub host: crate::step::HostCounts,
}

impl StepTrace {
    /// Dispatches per layer, for layers `0..n_layers`.
    pub fn per_layer(&self, n_layers: usize) -> Vec<usize> {
        let mut out = vec![0; n_layers];
        for d in &self.dispatches {
            if let Some(l) = d.layer.filter(|&l| (l as usize) < n_layers) {
                out[l as usize] += 1;
            }
        }
        out
    }
}

/// What to trace: set on the context, read by every `StepEncoder::submit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceOptions {
    /// Time every dispatch (GPU timestamps where possible). Timing changes how the step is
    /// submitted; the list alone does not.
    pub timing: bool,
}

#[derive(Default)]
pub(crate) struct TraceState {
    pub(crate) options: Mutex<Option<TraceOptions>>,
    pub(crate) steps: Mutex<Vec<StepTrace>>,
}

impl crate::context::GpuContext {
    /// Starts recording the dispatch list (and, with `timing`, the time) of every step
    /// submitted from now on, until `finish_trace`.
    pub fn start_trace(&self, options: TraceOptions) {
        *self.trace.options.lock().unwrap_or_else(|e| e.into_inner()) = Some(options);
        self.trace
            .steps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Stops tracing and returns the steps recorded since `start_trace`.
    pub fn finish_trace(&self) -> Vec<StepTrace> {
        *self.trace.options.lock().unwrap_or_else(|e| e.into_inner()) = None;
        std::mem::take(&mut *self.trace.steps.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(crate) fn trace_options(&self) -> Option<TraceOptions> {
        *self.trace.options.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn push_trace(&self, step: StepTrace) {
        self.trace
            .steps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(step);
    }

    /// Whether dispatches can be timed on the GPU.
    pub fn has_timestamps(&self) -> bool {
        self.device
            .features()
            .contains(wgpu::Features::TIMESTAMP_QUERY)
    }
}
