//! Element-wise activations of DiffusionGemma (`docs/models/diffusion-gemma.md` §4.5, §4.7):
//! the dense MLP's `gelu_tanh(gate) ⊙ up`, the final logit soft-cap and the layer scalar.
//! Hand-written (`shaders/activation.wgsl`): one element per invocation.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::elementwise::{check, check_f32, u32_of};
use crate::error::{GpuError, Result};
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::Tensor;

const ACTIVATION: KernelSource = kernel_source!("activation", "gelu");
const FLAGS: [&str; 3] = ["GELU_GATE", "SOFTCAP", "SCALE"];

pub fn variants() -> Vec<ShaderVariant> {
    FLAGS
        .into_iter()
        .map(|flag| ShaderVariant {
            kernel: ACTIVATION,
            entry: "main",
            spec: Spec::new().flag(flag),
        })
        .collect()
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct ActivationParams {
    n: u32,
    cols: u32,
    value: f32,
    _pad: u32,
}

/// Elements past what the kernel's u32 indices reach.
fn count(op: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| GpuError::TooLarge {
        what: format!("{op} elements"),
        needed: n as u64,
        limit: u64::from(u32::MAX),
    })
}

fn dispatch(
    step: &mut StepEncoder,
    flag: &'static str,
    bindings: &[&Tensor],
    params: ActivationParams,
) -> Result<()> {
    if params.n == 0 {
        return Ok(());
    }
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&ACTIVATION, "main", &Spec::new().flag(flag))?;
    let bindings: Vec<_> = bindings.iter().map(|t| (*t).into()).collect();
    let groups = groups_2d(ctx, params.n.div_ceil(256));
    step.dispatch(&pipeline, &params, &bindings, groups);
    Ok(())
}

/// `out[r, c] = gelu_tanh(gu[r, c]) · gu[r, inter + c]` for `rows` rows: `gu` f32
/// `[rows, 2 · inter]` (gate columns first, then up: the output of one matmul over gate and
/// up weights stacked), `out` f32 `[rows, inter]`.
pub fn gelu_tanh_gate(
    step: &mut StepEncoder,
    gu: &Tensor,
    out: &Tensor,
    rows: usize,
    inter: usize,
) -> Result<()> {
    check_f32("gelu_tanh_gate gu", gu, rows * 2 * inter)?;
    check_f32("gelu_tanh_gate out", out, rows * inter)?;
    let n = count("gelu_tanh_gate", rows * 2 * inter)?;
    let params = ActivationParams {
        n: n / 2,
        cols: u32_of(inter),
        value: 0.0,
        _pad: 0,
    };
    dispatch(step, "GELU_GATE", &[gu, out], params)
}

/// `x = cap · tanh(x / cap)` in place over the first `n` values (the final logits, cap 30);
/// finite for any finite x.
pub fn softcap(step: &mut StepEncoder, x: &Tensor, n: usize, cap: f32) -> Result<()> {
    check(
        "softcap",
        cap.is_finite() && cap > 0.0,
        || "a finite cap above 0".into(),
        || format!("cap {cap}"),
    )?;
    check_f32("softcap x", x, n)?;
    let params = ActivationParams {
        n: count("softcap", n)?,
        cols: 0,
        value: cap,
        _pad: 0,
    };
    dispatch(step, "SOFTCAP", &[x], params)
}

/// `x = x · s` in place over the first `n` values (the layer scalar on the residual stream).
pub fn scale_in_place(step: &mut StepEncoder, x: &Tensor, n: usize, s: f32) -> Result<()> {
    check_f32("scale_in_place x", x, n)?;
    let params = ActivationParams {
        n: count("scale_in_place", n)?,
        cols: 0,
        value: s,
        _pad: 0,
    };
    dispatch(step, "SCALE", &[x], params)
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "activation",
        "main",
        ActivationParams { n, cols, value }
    )]
}
