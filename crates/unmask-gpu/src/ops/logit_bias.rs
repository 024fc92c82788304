//! Logit biases on sampled rows (`shaders/logit_bias.wgsl`): OpenAI's `logit_bias`, the
//! presence / frequency penalties and the repetition penalty
//! (`unmask_core::sampler::LogitBias`), applied to each vocabulary chunk of the LM head's
//! logits before the token choice reads it. The biases
//! are sparse (a few ids per row), so they travel as a per-row list rather than a dense
//! `[rows, vocab]` tensor, and the kernel touches only the listed logits.

use bytemuck::{Pod, Zeroable};
use unmask_core::sampler::IdBias;

use super::ShaderVariant;
use super::sampling::{check_tensor, shape_error};
use crate::context::GpuContext;
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

const LOGIT_BIAS: KernelSource = kernel_source!("logit_bias");

pub fn variants() -> Vec<ShaderVariant> {
    vec![ShaderVariant {
        kernel: LOGIT_BIAS,
        entry: "main",
        spec: Spec::new(),
    }]
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
struct BiasParams {
    rows: u32,
    n: u32,
    vocab_offset: u32,
    _pad: u32,
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "logit_bias",
        "main",
        BiasParams {
            rows,
            n,
            vocab_offset
        }
    )]
}

/// Words of one entry in the table (`shaders/logit_bias.wgsl`).
const ENTRY_WORDS: usize = 5;

/// The biases of a pass's sampled rows, in row order, packed as the kernel reads them.
/// Rows of one request share one list (its biases do not depend on the position).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowBiases {
    /// Per row: (index of its list's first entry, entries).
    rows: Vec<(u32, u32)>,
    /// (id, bias, positive scale, negative scale, minus the penalty; f32 bits) of every
    /// list.
    entries: Vec<[u32; ENTRY_WORDS]>,
}

impl RowBiases {
    /// Appends `rows` rows that all take `list`; an id listed twice gets the sum of its
    /// biases and penalties and the product of its repetition penalties (the kernel
    /// applies each id once).
    pub fn push<E: Copy + Into<IdBias>>(&mut self, list: &[E], rows: usize) {
        let mut merged: Vec<IdBias> = list.iter().map(|&e| e.into()).collect();
        merged.sort_by_key(|b| b.id);
        merged.dedup_by(|later, kept| {
            let same = later.id == kept.id;
            if same {
                kept.bias += later.bias;
                kept.repetition *= later.repetition;
                kept.penalty += later.penalty;
            }
            same
        });
        let first = self.entries.len() as u32;
        self.entries.extend(merged.iter().map(|b| {
            let (positive, negative) = b.scales();
            let f = [b.bias, positive, negative, -b.penalty].map(f32::to_bits);
            [b.id, f[0], f[1], f[2], f[3]]
        }));
        let count = merged.len() as u32;
        self.rows.extend(std::iter::repeat_n((first, count), rows));
    }

    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// Whether no row has a bias (the pass then runs no bias kernel at all).
    pub fn is_empty(&self) -> bool {
        self.rows.iter().all(|&(_, count)| count == 0)
    }

    /// The table's u32 words: two per row (word of its first entry, entries), then the
    /// entries.
    pub fn words(&self) -> Vec<u32> {
        let base = 2 * self.rows.len() as u32;
        let mut w = Vec::with_capacity(2 * self.rows.len() + ENTRY_WORDS * self.entries.len());
        for &(first, count) in &self.rows {
            w.extend([base + ENTRY_WORDS as u32 * first, count]);
        }
        w.extend(self.entries.iter().flatten());
        w
    }
}

/// Writes `biases` into `table`, made (or remade larger, with room for lists that grow
/// step by step) when it is missing or too small; the table to pass to `add_logit_bias`,
/// or `None` when no row has a bias.
pub fn upload_biases<'a>(
    ctx: &GpuContext,
    biases: &RowBiases,
    table: &'a mut Option<Tensor>,
    label: &str,
) -> Result<Option<&'a Tensor>> {
    if biases.is_empty() {
        return Ok(None);
    }
    let words = biases.words();
    if table.as_ref().is_some_and(|t| t.numel() < words.len()) {
        *table = None;
    }
    let t: &Tensor = match table {
        Some(t) => t,
        slot @ None => {
            let len = words.len().next_power_of_two();
            slot.insert(Tensor::zeros(ctx, DType::U32, &[len], label)?)
        }
    };
    t.write_u32(ctx, &words)?;
    Ok(Some(t))
}

/// Adds each row's biases to `logits`, f32 `[rows, n]` holding vocabulary ids
/// `[vocab_offset, vocab_offset + n)`; ids outside the chunk are left to other chunks.
/// `table` holds `RowBiases::words` of at least `rows` rows.
pub fn add_logit_bias(
    step: &mut StepEncoder,
    logits: &Tensor,
    rows: usize,
    n: usize,
    vocab_offset: usize,
    table: &Tensor,
) -> Result<()> {
    const OP: &str = "add_logit_bias";
    let elems = rows
        .checked_mul(n)
        .filter(|&e| e <= u32::MAX as usize && vocab_offset + n <= u32::MAX as usize)
        .ok_or_else(|| {
            shape_error(
                OP,
                "rows * n and the chunk's last id below 2^32".into(),
                format!("{rows} x {n} from id {vocab_offset}"),
            )
        })?;
    check_tensor(OP, "logits", logits, DType::F32, elems)?;
    check_tensor(OP, "table", table, DType::U32, 2 * rows)?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let pipeline = step.ctx().pipeline(&LOGIT_BIAS, "main", &Spec::new())?;
    let params = BiasParams {
        rows: rows as u32,
        n: n as u32,
        vocab_offset: vocab_offset as u32,
        _pad: 0,
    };
    let groups = groups_2d(step.ctx(), rows as u32);
    step.dispatch(&pipeline, &params, &[table.into(), logits.into()], groups);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_one_list_share_its_entries_and_duplicates_combine() {
        let mut t = RowBiases::default();
        t.push(&[(7, 1.0), (2, -3.0), (7, 0.5)], 2);
        t.push::<(u32, f32)>(&[], 1);
        let repeat = |id, repetition, penalty| IdBias {
            id,
            bias: 0.0,
            repetition,
            penalty,
        };
        t.push(&[repeat(4, 2.0, 0.25), repeat(4, 1.5, 1.0)], 1);
        assert_eq!(t.rows(), 4);
        assert!(!t.is_empty());
        let w = t.words();
        let (zero, one) = (0.0f32.to_bits(), 1.0f32.to_bits());
        // 4 rows x 2 words, then 5-word entries from word 8: (2, -3), (7, 1.5), (4, x3, -1.25).
        assert_eq!(&w[..8], &[8, 2, 8, 2, 18, 0, 18, 1]);
        let minus_zero = (-0.0f32).to_bits();
        assert_eq!(&w[8..13], &[2, (-3.0f32).to_bits(), one, one, minus_zero]);
        assert_eq!(&w[13..18], &[7, 1.5f32.to_bits(), one, one, minus_zero]);
        let third = (1.0f32 / 3.0).to_bits();
        let last = [4, zero, third, 3.0f32.to_bits(), (-1.25f32).to_bits()];
        assert_eq!(&w[18..], &last);
        let mut none = RowBiases::default();
        none.push::<IdBias>(&[], 3);
        assert!(none.is_empty() && none.rows() == 3);
    }
}
