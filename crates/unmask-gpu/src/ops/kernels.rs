//! The kernel choice of one model: which matmul and attention kernels its passes ask for,
//! the tuner that measures `Auto`'s candidates, and the scratch of the split-K matmul. The
//! device context holds device facts only; everything that decides *which* kernel runs
//! lives here, owned by the model.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::attention::AttentionKernel;
use super::matmul::MatmulKernel;
use crate::context::GpuContext;
use crate::error::Result;
use crate::tensor::{DType, Tensor};
use crate::tune::{KernelTuner, TunePolicy, default_tune_file};

/// What a model's kernel choice starts from.
#[derive(Clone, Debug, Default)]
pub struct KernelOptions {
    pub matmul: MatmulKernel,
    /// `Auto`: chosen per device and shape. Tests force each variant through the model.
    pub attention: AttentionKernel,
    /// When `Auto` kernels are chosen by timing the candidates.
    pub tune: TunePolicy,
    /// Where measured choices are kept across processes (`None`: `default_tune_file()`).
    pub tune_file: Option<PathBuf>,
}

/// A model's kernel choice. Cheap to clone: the tuner and the scratch are shared.
#[derive(Clone)]
pub struct Kernels {
    pub matmul: MatmulKernel,
    pub attention: AttentionKernel,
    pub tuner: Arc<KernelTuner>,
    /// Partial sums of the split-K matmul (`coop-split`), grown to the largest asked for
    /// and reused by every dispatch (the passes of one step run in order).
    split_scratch: Arc<Mutex<Option<Tensor>>>,
    /// The rows' 1 / rms that `coop` with a fused norm reads, found just before it.
    norm_scratch: Arc<Mutex<Option<Tensor>>>,
}

impl Kernels {
    pub fn new(ctx: &GpuContext, options: &KernelOptions) -> Self {
        let tune_file = options.tune_file.clone().or_else(default_tune_file);
        Self {
            matmul: options.matmul,
            attention: options.attention,
            tuner: Arc::new(KernelTuner::new(&ctx.info, options.tune, tune_file)),
            split_scratch: Arc::new(Mutex::new(None)),
            norm_scratch: Arc::new(Mutex::new(None)),
        }
    }

    /// An f32 scratch of at least `floats` elements for split-K partial sums, grown when
    /// a larger one is asked for.
    pub fn split_scratch(&self, ctx: &GpuContext, floats: usize) -> Result<Tensor> {
        grown(&self.split_scratch, ctx, floats, "split-K partial sums")
    }

    /// An f32 scratch of at least `rows` elements for the rows' 1 / rms of a fused norm.
    pub fn norm_scratch(&self, ctx: &GpuContext, rows: usize) -> Result<Tensor> {
        grown(&self.norm_scratch, ctx, rows, "rows' 1 / rms")
    }
}

/// The tensor in `slot` when it holds at least `floats`, else a new one that replaces it.
fn grown(
    slot: &Mutex<Option<Tensor>>,
    ctx: &GpuContext,
    floats: usize,
    label: &str,
) -> Result<Tensor> {
    let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(t) = slot.as_ref().filter(|t| t.numel() >= floats) {
        return Ok(t.clone());
    }
    let t = Tensor::zeros(ctx, DType::F32, &[floats], label)?;
    *slot = Some(t.clone());
    Ok(t)
}
