//! `unmask selfcheck`: describes the adapter and checks the matmul kernels against the CPU
//! oracle on a small problem, for every kernel and weight format the device supports.

use clap::Args;
use unmask_core::oracle::matmul::matmul_xwt;
use unmask_core::rng::SplitMix64;
use unmask_gpu::ops::matmul::{MatmulKernel, matmul};
use unmask_gpu::{GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

use crate::error::CliError;
use crate::info::context;
use crate::options::BackendArgs;
use crate::output;

/// Sizes that divide none of the kernels' tiles, so the edge paths run too.
const M: usize = 7;
const N: usize = 45;
const K: usize = 37;

#[derive(Args, Debug)]
#[command(
    about = "Check that the GPU kernels compute correct results on this device.",
    override_usage = "unmask selfcheck [--backend <B>]",
    after_help = "Exits with code 1 when a check fails."
)]
pub struct SelfcheckArgs {
    #[command(flatten)]
    backend: BackendArgs,
}

fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
        .collect()
}

/// Largest absolute error relative to the largest reference value (at least 1); infinite
/// when a result is missing or not finite.
fn max_error(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() || got.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let scale = want.iter().fold(1.0f64, |m, v| m.max(f64::from(v.abs())));
    got.iter()
        .zip(want)
        .map(|(g, w)| f64::from((g - w).abs()))
        .fold(0.0, f64::max)
        / scale
}

fn run_matmul(
    ctx: &GpuContext,
    x: &[f32],
    w: &[f32],
    format: WeightFormat,
    kernel: MatmulKernel,
) -> Result<Vec<f32>, CliError> {
    let xt = Tensor::from_f32(ctx, &[M, K], x, "selfcheck x")?;
    let wt = Weight::from_f32(ctx, N, K, w, format, "selfcheck w")?;
    let yt = Tensor::from_f32(ctx, &[M, N], &vec![f32::NAN; M * N], "selfcheck y")?;
    let mut step = StepEncoder::new(ctx, "selfcheck matmul");
    matmul(&mut step, &xt, &wt, &yt, M, kernel)?;
    step.submit()?;
    Ok(yt.read_f32(ctx)?)
}

pub fn run(args: &SelfcheckArgs) -> Result<(), CliError> {
    let ctx = context(args.backend.backend.as_deref())?;
    output::line(&format!("adapter: {}", ctx.describe()))?;
    let x = random(1, M * K);
    let w = random(2, N * K);
    let want = matmul_xwt(&x, &w, M, N, K);
    let mut formats = vec![WeightFormat::F32, WeightFormat::F16Packed];
    if ctx.features.shader_f16 {
        formats.push(WeightFormat::F16Native);
    } else {
        output::line("matmul f16-native: skipped (the device has no shader-f16)")?;
    }
    let mut failed = 0;
    let mut total = 0;
    for format in formats {
        for kernel in MatmulKernel::CONCRETE {
            // f16 storage of the weights (or f16 arithmetic) alone costs about this much
            // against exact f32 weights.
            let tolerance = match format {
                WeightFormat::F32 if kernel != MatmulKernel::GemmF16 => 1e-4,
                _ => 1e-2,
            };
            total += 1;
            let label = format!(
                "matmul {} {} [{M}x{K}]·[{N}x{K}]ᵀ",
                format.name(),
                kernel.name()
            );
            let line = match run_matmul(&ctx, &x, &w, format, kernel) {
                Ok(got) => {
                    let err = max_error(&got, &want);
                    let ok = err <= tolerance;
                    if !ok {
                        failed += 1;
                    }
                    format!(
                        "{label}: max relative error {err:.2e} (tolerance {tolerance:.0e}) {}",
                        if ok { "pass" } else { "FAIL" }
                    )
                }
                Err(e) => {
                    failed += 1;
                    format!(
                        "{label}: FAIL ({})",
                        e.report().trim_start_matches("error: ")
                    )
                }
            };
            output::line(&line)?;
        }
    }
    if failed > 0 {
        return Err(CliError::runtime(format!(
            "selfcheck failed: {failed} of {total} checks"
        )));
    }
    output::line(&format!("selfcheck passed: {total} checks"))
}
