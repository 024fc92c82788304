//! Additive logit biases on sampled rows (`shaders/logit_bias.wgsl`): OpenAI's `logit_bias`
//! and the presence / frequency penalties (`unmask_core::sampler::LogitBias`), added to each
//! vocabulary chunk of the LM head's logits before the token choice reads it. The biases
//! are sparse (a few ids per row), so they travel as a per-row list rather than a dense
//! `[rows, vocab]` tensor, and the kernel touches only the listed logits.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::sampling::{check_tensor, shape_error};
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

/// The biases of a pass's sampled rows, in row order, packed as the kernel reads them.
/// Rows of one request share one list (its biases do not depend on the position).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowBiases {
    /// Per row: (index of its list's first pair, pairs).
    rows: Vec<(u32, u32)>,
    /// (id, bias bits) pairs of every list.
    pairs: Vec<[u32; 2]>,
}

impl RowBiases {
    /// Appends `rows` rows that all take `list`, (id, bias) pairs; an id listed twice
    /// gets the sum of its biases (the kernel adds each pair once).
    pub fn push(&mut self, list: &[(u32, f32)], rows: usize) {
        let mut merged: Vec<(u32, f32)> = list.to_vec();
        merged.sort_by_key(|&(id, _)| id);
        merged.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 += later.1;
            }
            same
        });
        let first = self.pairs.len() as u32;
        self.pairs
            .extend(merged.iter().map(|&(id, b)| [id, b.to_bits()]));
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

    /// The table's u32 words: two per row (word of its first pair, pairs), then the pairs.
    pub fn words(&self) -> Vec<u32> {
        let base = 2 * self.rows.len() as u32;
        let mut w = Vec::with_capacity(2 * (self.rows.len() + self.pairs.len()));
        for &(first, count) in &self.rows {
            w.extend([base + 2 * first, count]);
        }
        w.extend(self.pairs.iter().flatten());
        w
    }
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
    fn rows_of_one_list_share_its_pairs_and_duplicates_add_up() {
        let mut t = RowBiases::default();
        t.push(&[(7, 1.0), (2, -3.0), (7, 0.5)], 2);
        t.push(&[], 1);
        t.push(&[(4, 2.0)], 1);
        assert_eq!(t.rows(), 4);
        assert!(!t.is_empty());
        let w = t.words();
        // 4 rows x 2 words, then pairs from word 8: (2, -3), (7, 1.5), (4, 2).
        assert_eq!(&w[..8], &[8, 2, 8, 2, 12, 0, 12, 1]);
        assert_eq!(&w[8..10], &[2, (-3.0f32).to_bits()]);
        assert_eq!(&w[10..12], &[7, 1.5f32.to_bits()]);
        assert_eq!(&w[12..], &[4, 2.0f32.to_bits()]);
        let mut none = RowBiases::default();
        none.push(&[], 3);
        assert!(none.is_empty() && none.rows() == 3);
    }
}
