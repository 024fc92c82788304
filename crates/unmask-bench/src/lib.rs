//! Benchmarks shared by `unmask bench` and `cargo bench -p unmask-bench`: the kernels at a
//! model's real shapes, and whole requests through every cache mode on a workload of shared
//! system prompts.
//!
//! Every figure is one JSON object (a "record") carrying the environment it was measured in
//! (adapter, backend, driver, commit, model), so files from several machines can be merged
//! by `unmask bench-report`. Timings are medians after a warm-up run; variants of one
//! measurement run back to back in the same process, so their ratios are meaningful even on
//! a noisy machine.
//!
//! A native tool (timing loops over blocking generations): the browser build never
//! depends on it.
//!
//! Modules (everything is re-exported here): `timing` (repeats, medians, deterministic
//! inputs), `env` (the environment a record carries: adapter peaks, commit), `kernels`
//! (matmul and attention cases at a model's shapes), `requests` (whole requests per cache
//! mode and decoding, served one at a time or in batches), `scoring` (likelihood estimates
//! at several pass sizes), `work` (a request's rows × layers and FLOPs per cache mode,
//! counted from the mode planner without a GPU).

mod dgemma;
mod env;
mod kernels;
mod requests;
mod scoring;
mod timing;
mod work;

pub use dgemma::{DgemmaBenchOptions, dgemma_envelope, run_dgemma_kernels};
pub use env::{Peak, commit, envelope, known_peak, with_envelope};
pub use kernels::{
    KernelBenchOptions, KernelCase, MAX_CASE_HOST_BYTES, model_kernel_cases, run_kernel_case,
};
pub use requests::{
    Decoding, RequestBenchOptions, Workload, WorkloadRequest, run_request_bench, serve_continuously,
};
pub use scoring::{ScoringBenchOptions, run_scoring_bench};
pub use timing::{Repeats, Sample, pseudo_random, time_step};
pub use work::{WorkMode, WorkRequest, request_work, with_ratios};
