//! Measured choice of the matmul kernel: a call's shape class, and for `Auto` with a tuner
//! the winner of its candidates, timed the first time the class is met.

use super::*;

/// The shape class of a matmul for measured kernel choice: the kernel source, the weight
/// format, the fusions, N, K and M rounded up to a power of two.
pub fn tune_class(
    format: WeightFormat,
    fusion: &Fusion<'_>,
    m: usize,
    n: usize,
    k: usize,
) -> String {
    let fused: String = [
        (fusion.norm.is_some(), 'n'),
        (fusion.residual, 'r'),
        (fusion.swiglu, 's'),
    ]
    .iter()
    .filter_map(|&(on, c)| on.then_some(c))
    .collect();
    format!(
        "matmul@{:08x}/{}/{}/m{}/n{n}/k{k}",
        crate::tune::source_hash(KERNEL.source),
        format.name(),
        if fused.is_empty() { "-" } else { &fused },
        m.next_power_of_two()
    )
}

/// `kernel.plan`, or for `Auto` with a tuner that measures (`Kernels::tuner`) the
/// measured winner of the shape class, timed now on scratch output when the class is new.
// In a browser nothing is timed (no blocking waits), so x goes unused there.
#[cfg_attr(target_arch = "wasm32", allow(unused_variables))]
pub(super) fn choose(
    ctx: &GpuContext,
    choice: MatmulChoice<'_>,
    x: &Tensor,
    w: &Weight,
    m: usize,
    n: usize,
    fusion: Fusion<'_>,
) -> Result<(MatmulKernel, WeightFormat)> {
    let kernel = choice.kernel;
    let planned = kernel.plan(ctx, m, w.format);
    let Some(tuner) = choice.kernels.map(|k| &*k.tuner).filter(|t| t.enabled()) else {
        return Ok(planned);
    };
    if kernel != MatmulKernel::Auto {
        return Ok(planned);
    }
    // Measured kernels read the weight as the device best can (the fixed choice may pick
    // another decoding for its own kernel).
    let format = w.format.resolve(ctx);
    let class = tune_class(format, &fusion, m, n, w.cols);
    // A winner read from the file is only taken when it is still a candidate here, for
    // this weight format (`NarrowDot` is one for quantized weights only).
    let candidates = MatmulKernel::candidates(ctx, format);
    let by_name = |name: &str| candidates.iter().copied().find(|k| k.name() == name);
    if let Some(k) = tuner.winner(&class).as_deref().and_then(by_name) {
        return Ok((k, format));
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let names: Vec<&'static str> = candidates.iter().map(|k| k.name()).collect();
        let scratch = Tensor::zeros(ctx, DType::F32, &[m, n], "tune scratch")?;
        // Each candidate's output from zero, against `Tiled`'s (f32, tested on every device).
        let run_once = |kernel: MatmulKernel| {
            crate::tune::output_from_zero(ctx, &scratch, |step| {
                matmul_fused(step, x, w, &scratch, m, kernel, fusion)
            })
        };
        let reference = run_once(MatmulKernel::Tiled)?;
        let times = crate::tune::time_verified_candidates(
            ctx,
            &names,
            |name| {
                let kernel = by_name(name).expect("a candidate is a concrete kernel");
                Ok(crate::tune::outputs_agree(
                    &reference,
                    &run_once(kernel)?,
                    kernel.tolerance(),
                ))
            },
            |step, name| {
                let k = by_name(name).expect("a candidate is a concrete kernel");
                matmul_fused(step, x, w, &scratch, m, k, fusion)
            },
        )?;
        if let Some(k) = tuner.record(&class, times).as_deref().and_then(by_name) {
            return Ok((k, format));
        }
    }
    Ok(planned)
}
