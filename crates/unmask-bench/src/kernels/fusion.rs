//! The fusions the forward pass gives each layer matmul, and the same work as separate
//! dispatches (the unfused baseline a kernel case times beside the fused matmul).

use unmask_gpu::ops::elementwise as ew;
use unmask_gpu::ops::matmul::{MatmulKernel, matmul};
use unmask_gpu::ops::unfused;
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

/// The fusions the forward pass gives each layer matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LayerFusion {
    pub(super) norm: bool,
    pub(super) residual: bool,
    pub(super) swiglu: bool,
}

impl LayerFusion {
    pub(super) fn of(case: &str) -> Self {
        let (norm, residual, swiglu) = match case {
            "qkv" => (true, false, false),
            "attn_out" | "ff_out" => (false, true, false),
            "gate_up" => (true, false, true),
            _ => (false, false, false),
        };
        Self {
            norm,
            residual,
            swiglu,
        }
    }

    pub(super) fn name(self) -> &'static str {
        match (self.norm, self.residual, self.swiglu) {
            (true, _, true) => "norm+swiglu",
            (true, _, false) => "norm",
            (false, true, _) => "residual",
            (false, false, true) => "swiglu",
            (false, false, false) => "none",
        }
    }
}

/// A fused layer matmul's work as separate dispatches, with its own scratch.
pub(super) struct Unfused {
    w: Weight,
    normed: Tensor,
    wide: Tensor,
    fused: LayerFusion,
    n: usize,
    k: usize,
}

impl Unfused {
    pub(super) fn new(
        ctx: &GpuContext,
        m: usize,
        n: usize,
        k: usize,
        format: WeightFormat,
        w_data: &[f32],
        fused: LayerFusion,
    ) -> unmask_gpu::Result<Self> {
        Ok(Self {
            w: Weight::from_f32(ctx, n, k, w_data, format, "bench.w unfused")?,
            normed: Tensor::zeros(ctx, DType::F32, &[m, k], "bench.normed")?,
            wide: Tensor::zeros(ctx, DType::F32, &[m, n], "bench.wide")?,
            fused,
            n,
            k,
        })
    }

    pub(super) fn record(
        &self,
        step: &mut StepEncoder,
        x: &Tensor,
        g: &Tensor,
        y: &Tensor,
        m: usize,
    ) -> unmask_gpu::Result<()> {
        let input = if self.fused.norm {
            ew::rms_norm(step, x, g, &self.normed, m, self.k, 1e-5)?;
            &self.normed
        } else {
            x
        };
        matmul(step, input, &self.w, &self.wide, m, MatmulKernel::Auto)?;
        if self.fused.swiglu {
            unfused::swiglu(step, &self.wide, y, m, self.n / 2)?;
        } else if self.fused.residual {
            unfused::add_in_place(step, y, &self.wide, m * self.n)?;
        }
        Ok(())
    }
}
