//! Measured choice of the attention kernel: a call's shape class, and for `Auto` with a
//! tuner the winner of its candidates, timed the first time the class is met.

use super::*;

/// The shape class of an attention call for measured kernel choice: the kernel sources,
/// the K/V format, the heads, query rows and keys rounded up to powers of two, whether
/// there are two segments and a split scratch, and the mask's kind (causal, windowed: the
/// tiles skipped change which kernel wins).
pub fn tune_class(
    shape: AttentionShape,
    m: usize,
    n_keys: usize,
    kv: DType,
    two_segments: bool,
    split: bool,
    mask: AttentionMask,
) -> String {
    let sources = [ATTENTION, ATTENTION_WIDE, ATTENTION_COMBINE]
        .iter()
        .fold(0u32, |h, k| {
            h ^ crate::tune::source_hash(k.source).rotate_left(7)
        });
    let mask = match (mask.causal, mask.window) {
        (false, _) => "",
        (true, 0) => "/causal",
        (true, _) => "/window",
    };
    format!(
        "attention@{sources:08x}/{kv:?}/h{}/kv{}/d{}/m{}/keys{}/{}{}{mask}",
        shape.n_heads,
        shape.n_kv_heads,
        shape.head_dim,
        m.next_power_of_two(),
        n_keys.next_power_of_two(),
        if two_segments { "ab" } else { "b" },
        if split { "/split" } else { "" }
    )
}

/// For `Auto` with a tuner that measures (`AttentionOptions::tuner`): the measured kernel of this
/// shape class, timed now into a scratch output when the class is new. `None`: keep the
/// plan's fixed choice (no measuring, or nothing to choose between).
#[allow(clippy::too_many_arguments)]
// In a browser nothing is timed (no blocking waits), so the tensors go unused there.
#[cfg_attr(target_arch = "wasm32", allow(unused_variables))]
pub(super) fn measured_kernel(
    ctx: &GpuContext,
    q: &Tensor,
    q_stride: usize,
    q_col: usize,
    rows: &std::ops::Range<usize>,
    seg_a: Option<KvSegment>,
    seg_b: KvSegment,
    out: &Tensor,
    shape: AttentionShape,
    options: &AttentionOptions,
) -> Result<Option<AttentionKernel>> {
    let Some(tuner) = options.tuner.filter(|t| t.enabled()) else {
        return Ok(None);
    };
    if options.kernel != AttentionKernel::Auto || rows.is_empty() {
        return Ok(None);
    }
    let kv = seg_b.k.dtype;
    let n_keys = seg_a.map_or(0, |a| a.len) + seg_b.len;
    // The register kernel serves head dims up to 128 and reads f16 K/V only at head dims
    // that are multiples of 4; the split needs its scratch.
    let candidates: Vec<AttentionKernel> = AttentionKernel::CONCRETE
        .into_iter()
        .filter(|&k| {
            k != AttentionKernel::Register
                || (shape.head_dim <= REGISTER_MAX_HEAD_DIM
                    && (kv == DType::F32 || shape.head_dim.is_multiple_of(4)))
        })
        .filter(|&k| {
            !matches!(k, AttentionKernel::WideSplit | AttentionKernel::CoopSplit)
                || options.scratch.is_some()
        })
        .filter(|&k| {
            !matches!(k, AttentionKernel::Coop | AttentionKernel::CoopSplit)
                || coop_attention(ctx, shape.head_dim).is_some()
        })
        .collect();
    if candidates.len() < 2 {
        return Ok(None);
    }
    let class = tune_class(
        shape,
        rows.len(),
        n_keys,
        kv,
        seg_a.is_some(),
        options.scratch.is_some(),
        options.mask,
    );
    let by_name = |name: &str| candidates.iter().copied().find(|k| k.name() == name);
    if let Some(k) = tuner.winner(&class).as_deref().and_then(by_name) {
        return Ok(Some(k));
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let names: Vec<&'static str> = candidates.iter().map(|k| k.name()).collect();
        let scratch_out = Tensor::zeros(ctx, DType::F32, &[out.numel()], "tune attention out")?;
        let record = |step: &mut StepEncoder, kernel: AttentionKernel| {
            let o = AttentionOptions { kernel, ..*options };
            attention_with(
                step,
                q,
                q_stride,
                q_col,
                rows.clone(),
                seg_a,
                seg_b,
                &scratch_out,
                shape,
                &o,
            )
            .map(|_| ())
        };
        // Each candidate's output from zero, against the first candidate's (the register
        // kernel where it reads the K/V, else wide: the fixed choice off hardware GPUs).
        let run_once = |kernel: AttentionKernel| {
            crate::tune::output_from_zero(ctx, &scratch_out, |step| record(step, kernel))
        };
        let reference = run_once(candidates[0])?;
        let times = crate::tune::time_verified_candidates(
            ctx,
            &names,
            |name| {
                let kernel = by_name(name).expect("a candidate");
                let found = run_once(kernel)?;
                Ok(crate::tune::outputs_agree(
                    &reference,
                    &found,
                    kernel.tolerance(),
                ))
            },
            |step, name| record(step, by_name(name).expect("a candidate")),
        )?;
        Ok(tuner.record(&class, times).as_deref().and_then(by_name))
    }
    // In a browser nothing is timed: the plan's fixed choice.
    #[cfg(target_arch = "wasm32")]
    Ok(None)
}
