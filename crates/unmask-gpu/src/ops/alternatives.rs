//! The k most likely tokens of each row beside the chosen one (OpenAI's `top_logprobs`),
//! streamed over the LM head's vocabulary chunks like the selection (`sampling`):
//! `top_reset`, `top_accumulate` per chunk of logits, then `top_finalize`, which turns each
//! kept logit into a log-probability with the model softmax `select` kept (its `logprob`
//! statistics). Hand-written: a per-row top-k merged across chunks is not a kernel any
//! crate provides for WGSL.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::sampling::{STATE_WORDS as SELECT_WORDS, check_tensor as check, shape_error};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{Binding, StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

const TOP: KernelSource = kernel_source!("top_alternatives", "rng");

/// Most alternatives per row (OpenAI's `top_logprobs` limit).
pub const MOST_ALTERNATIVES: usize = 20;

/// u32 words of state per row: `MOST_ALTERNATIVES` (logit bits, id) pairs.
pub const TOP_STATE_WORDS: usize = 2 * MOST_ALTERNATIVES;

/// The id an empty slot reads back as (a row with fewer ids than k).
pub const NO_ID: u32 = u32::MAX;

pub fn variants() -> Vec<ShaderVariant> {
    let v = |entry, spec| ShaderVariant {
        kernel: TOP,
        entry,
        spec,
    };
    vec![
        v("reset", Spec::new().flag("RESET")),
        v("accumulate", Spec::new().flag("ACCUMULATE")),
        v("accumulate", Spec::new().flag("ACCUMULATE").flag("CFG")),
        v("finalize", Spec::new().flag("FINALIZE")),
    ]
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct ResetParams {
    rows: u32,
    _pad: [u32; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct AccumulateParams {
    rows: u32,
    n: u32,
    vocab_offset: u32,
    k: u32,
    cfg_scale: f32,
    row_base: u32,
    _pad: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct FinalizeParams {
    rows: u32,
    k: u32,
    out_base: u32,
    _pad: u32,
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![
        host_params!("top_alternatives", "reset", ResetParams { rows }),
        host_params!(
            "top_alternatives",
            "accumulate",
            AccumulateParams {
                rows,
                n,
                vocab_offset,
                k,
                cfg_scale,
                row_base
            }
        ),
        host_params!(
            "top_alternatives",
            "finalize",
            FinalizeParams { rows, k, out_base }
        ),
    ]
}

fn count(op: &'static str, what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| shape_error(op, format!("{what} below 2^32"), n.to_string()))
}

fn check_k(op: &'static str, k: usize) -> Result<u32> {
    if (1..=MOST_ALTERNATIVES).contains(&k) {
        Ok(k as u32)
    } else {
        Err(shape_error(
            op,
            format!("k in 1..={MOST_ALTERNATIVES}"),
            k.to_string(),
        ))
    }
}

/// Empties the lists of `rows` rows before the first chunk.
pub fn top_reset(step: &mut StepEncoder, state: &Tensor, rows: usize) -> Result<()> {
    const OP: &str = "top_reset";
    check(OP, "state", state, DType::U32, rows * TOP_STATE_WORDS)?;
    if rows == 0 {
        return Ok(());
    }
    let rows = count(OP, "rows", rows)?;
    let pipeline = step
        .ctx()
        .pipeline(&TOP, "reset", &Spec::new().flag("RESET"))?;
    let groups = groups_2d(step.ctx(), rows.div_ceil(64));
    let params = ResetParams { rows, _pad: [0; 3] };
    step.dispatch(&pipeline, &params, &[state.into()], groups);
    Ok(())
}

/// Where a chunk of logits sits: f32 `[rows, n]` for vocabulary ids `[vocab_offset,
/// vocab_offset + n)`, its row r the state's row `row_base + r`.
#[derive(Clone, Copy, Debug)]
pub struct Chunk {
    pub rows: usize,
    pub n: usize,
    pub vocab_offset: usize,
    pub row_base: usize,
}

/// Folds one chunk of logits (CFG-combined with `uncond` at `cfg_scale`) into the best `k`
/// of each row.
pub fn top_accumulate(
    step: &mut StepEncoder,
    logits: &Tensor,
    uncond: Option<&Tensor>,
    cfg_scale: f32,
    at: Chunk,
    state: &Tensor,
    k: usize,
) -> Result<()> {
    const OP: &str = "top_accumulate";
    let k = check_k(OP, k)?;
    let elems = at.rows.saturating_mul(at.n);
    check(OP, "logits", logits, DType::F32, elems)?;
    if let Some(u) = uncond {
        check(OP, "uncond logits", u, DType::F32, elems)?;
    }
    let state_rows = at.row_base.saturating_add(at.rows);
    check(
        OP,
        "state",
        state,
        DType::U32,
        state_rows.saturating_mul(TOP_STATE_WORDS),
    )?;
    if at.n == 0 || at.vocab_offset.saturating_add(at.n) > NO_ID as usize {
        return Err(shape_error(
            OP,
            format!("a non-empty chunk ending below {NO_ID}"),
            format!("{} ids at offset {}", at.n, at.vocab_offset),
        ));
    }
    if at.rows == 0 {
        return Ok(());
    }
    let params = AccumulateParams {
        rows: count(OP, "rows", at.rows)?,
        n: count(OP, "n", at.n)?,
        vocab_offset: at.vocab_offset as u32,
        k,
        cfg_scale,
        row_base: count(OP, "row_base", at.row_base)?,
        _pad: [0; 2],
    };
    let spec = Spec::new()
        .flag("ACCUMULATE")
        .flag_if(uncond.is_some(), "CFG");
    let pipeline = step.ctx().pipeline(&TOP, "accumulate", &spec)?;
    let mut bindings: Vec<Binding> = vec![logits.into(), state.into()];
    bindings.extend(uncond.map(Binding::from));
    let groups = groups_2d(step.ctx(), params.rows);
    step.dispatch(&pipeline, &params, &bindings, groups);
    Ok(())
}

/// Writes each row's `k` alternatives into `out` from word `out_base` on: u32 `[rows, k,
/// 2]`, the id (`NO_ID` for an empty slot) and the bits of its f32 log-probability under
/// the model softmax of `select_state` (accumulated with `SelectParams::logprob`).
pub fn top_finalize(
    step: &mut StepEncoder,
    state: &Tensor,
    select_state: &Tensor,
    out: &Tensor,
    out_base: usize,
    rows: usize,
    k: usize,
) -> Result<()> {
    const OP: &str = "top_finalize";
    let k32 = check_k(OP, k)?;
    check(OP, "state", state, DType::U32, rows * TOP_STATE_WORDS)?;
    check(
        OP,
        "select state",
        select_state,
        DType::U32,
        rows * SELECT_WORDS,
    )?;
    check(OP, "out", out, DType::U32, out_base + rows * k * 2)?;
    if rows == 0 {
        return Ok(());
    }
    let params = FinalizeParams {
        rows: count(OP, "rows", rows)?,
        k: k32,
        out_base: count(OP, "out_base", out_base)?,
        _pad: 0,
    };
    let pipeline = step
        .ctx()
        .pipeline(&TOP, "finalize", &Spec::new().flag("FINALIZE"))?;
    let groups = groups_2d(step.ctx(), params.rows.div_ceil(64));
    let bindings = [state.into(), select_state.into(), out.into()];
    step.dispatch(&pipeline, &params, &bindings, groups);
    Ok(())
}

/// Decodes `top_finalize`'s words: per row its (id, log-probability) pairs, empty slots
/// left out.
pub fn parse_alternatives(words: &[u32], k: usize) -> Vec<Vec<(u32, f32)>> {
    if k == 0 {
        return Vec::new();
    }
    words
        .chunks_exact(2 * k)
        .map(|row| {
            row.chunks_exact(2)
                .filter(|w| w[0] != NO_ID)
                .map(|w| (w[0], f32::from_bits(w[1])))
                .collect()
        })
        .collect()
}
