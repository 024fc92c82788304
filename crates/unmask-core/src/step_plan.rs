//! The plan of one denoising step for a batch of N ≥ 1 sequences, whatever the cache mode
//! (DESIGN.md §2–3): which rows the layers compute, where each row's K/V go in the arena,
//! which arena rows each sequence attends to, which rows move into the deep layers, and
//! which rows are sampled. `unmask_gpu` runs any plan (`Model::encode_plan`); the cache
//! modes differ only in the `SeqStep`s they hand it (`cache::plan_mode`).
//!
//! Layers `0..depth` are the shallow pass: every sequence's computed rows, attending to
//! segment A (a shared prefix entry, when the step reads one) and to the sequence's own
//! arena window. Layers `depth..n_layers` are the deep pass: the same rows after the prefix
//! rows of the sequences that refresh (their boundary state from the entry). Without a
//! shared prefix, or at depth `n_layers`, there is no deep pass.

use std::ops::Range;

/// One sequence of a pass: its rows among the pass's rows, and the arena rows its keys and
/// values are in (segment B). A single request is one window over every row; a batch keeps
/// its sequences' rows and arenas one after the other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqWindow {
    pub rows: Range<usize>,
    pub kv_start: usize,
    pub kv_len: usize,
}

impl SeqWindow {
    /// All `rows` rows of a pass over the first `kv_len` arena rows.
    pub fn single(rows: usize, kv_len: usize) -> [SeqWindow; 1] {
        [SeqWindow {
            rows: 0..rows,
            kv_start: 0,
            kv_len,
        }]
    }
}

/// The positions a step computes: sorted, disjoint, non-empty ranges. Every mode computes
/// one range but ACache, whose refresh steps skip the span's rows other than its anchors.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowSet {
    ranges: Vec<Range<usize>>,
}

impl RowSet {
    /// The union of `ranges` (in any order, overlapping or empty).
    pub fn from_ranges(ranges: impl IntoIterator<Item = Range<usize>>) -> Self {
        let mut all: Vec<Range<usize>> = ranges.into_iter().filter(|r| !r.is_empty()).collect();
        all.sort_unstable_by_key(|r| r.start);
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(all.len());
        for r in all {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        RowSet { ranges: merged }
    }

    /// `whole` without `hole`, plus the single positions `extra`.
    pub fn without_plus(whole: Range<usize>, hole: Range<usize>, extra: &[u32]) -> Self {
        let kept = [
            whole.start..hole.start.min(whole.end),
            hole.end.max(whole.start)..whole.end,
        ];
        let singles = extra.iter().map(|&p| p as usize..p as usize + 1);
        Self::from_ranges(kept.into_iter().chain(singles))
    }

    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    pub fn contains(&self, pos: usize) -> bool {
        self.index_of(pos).is_some()
    }

    /// The first position, if any.
    pub fn first(&self) -> Option<usize> {
        self.ranges.first().map(|r| r.start)
    }

    /// One past the last position (0 when empty).
    pub fn end(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// Positions in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.ranges.iter().flat_map(|r| r.clone())
    }

    /// The rank of `pos` among the positions, if it is one of them.
    pub fn index_of(&self, pos: usize) -> Option<usize> {
        let mut before = 0;
        for r in &self.ranges {
            if r.contains(&pos) {
                return Some(before + pos - r.start);
            }
            before += r.len();
        }
        None
    }
}

impl From<Range<usize>> for RowSet {
    fn from(r: Range<usize>) -> Self {
        Self::from_ranges([r])
    }
}

/// One sequence's part of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqStep {
    /// Positions computed in every layer this step (never positions of a shared prefix).
    pub rows: RowSet,
    /// Positions `0..prefix_len` are a shared prefix entry, segment A of the shallow layers
    /// (0: the step reads no shared prefix).
    pub prefix_len: usize,
    /// The deep layers also recompute the prefix rows, from the entry's boundary state.
    pub refresh: bool,
    /// Positions of the sequence (prompt and canvas).
    pub seq_len: usize,
    /// The computed rows attend to positions `0..kv_len` (the prefix-only pass of
    /// prefix-arm sees only the prefix; every other pass sees the whole sequence).
    pub kv_len: usize,
    /// First row of the sequence's arena in the batch's arena buffers.
    pub kv_base: usize,
    /// Positions whose token choice is read back, each inside `rows`.
    pub predict: Vec<u32>,
}

impl SeqStep {
    /// Every position of a sequence of `len`, attending to all of them, nothing sampled: an
    /// uncached pass (a prefix entry's, a profile's, a logits check's).
    pub fn whole(len: usize) -> SeqStep {
        SeqStep {
            rows: (0..len).into(),
            prefix_len: 0,
            refresh: false,
            seq_len: len,
            kv_len: len,
            kv_base: 0,
            predict: Vec::new(),
        }
    }
}

/// A copy of hidden rows into the deep pass's input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowCopy {
    /// The first `rows` rows of the entry's boundary state to deep row `dst`.
    Boundary { dst: usize, rows: usize },
    /// Rows `src..src + rows` of the shallow output to deep row `dst`.
    Shallow { src: usize, dst: usize, rows: usize },
}

/// The rows of one pass: absolute position and arena row of each, and the sequences.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassRows {
    pub positions: Vec<u32>,
    pub kv_rows: Vec<u32>,
    pub windows: Vec<SeqWindow>,
}

impl PassRows {
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }
}

/// Which pass's output the sampled rows index into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Shallow,
    Deep,
}

/// The plan of one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepPlan {
    /// Layers `0..depth` run the shallow pass (reading segment A when there is a prefix);
    /// `n_layers` without a shared prefix.
    pub depth: usize,
    pub n_layers: usize,
    /// Whether the shallow layers read a shared prefix entry as segment A.
    pub shared_prefix: bool,
    pub shallow: PassRows,
    pub copies: Vec<RowCopy>,
    /// Empty when there is no deep pass (`output` is then `Shallow`).
    pub deep: PassRows,
    pub output: Output,
    /// Per sequence, its sampled rows: (row of the output pass, position).
    pub sampled: Vec<Vec<(u32, u32)>>,
}

/// A plan that cannot run: a predicted position the step does not compute, or a window
/// past its sequence.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("step plan: {0}")]
pub struct PlanError(pub String);

impl StepPlan {
    /// The plan of a step over `seqs` (their arenas one after the other from `kv_base`)
    /// that reads no shared prefix: one pass over every layer. With `shift_logits` (Dream)
    /// the prediction for position p is read from the row of position p - 1 when the step
    /// computes it, else from p's own row, as the reference shifts the logits of the rows
    /// it computed.
    pub fn alone(seqs: &[SeqStep], n_layers: usize, shift_logits: bool) -> Result<Self, PlanError> {
        Self::build(seqs, None, n_layers, shift_logits)
    }

    /// The plan of a step over `seqs` whose shallow layers `0..depth` read one shared prefix
    /// entry (each sequence's `prefix_len` is its length); the deep layers get its rows from
    /// the boundary state on refresh.
    pub fn shared(
        seqs: &[SeqStep],
        depth: usize,
        n_layers: usize,
        shift_logits: bool,
    ) -> Result<Self, PlanError> {
        if depth > n_layers {
            return Err(PlanError(format!(
                "depth {depth} past the model's {n_layers} layers"
            )));
        }
        Self::build(seqs, Some(depth), n_layers, shift_logits)
    }

    fn build(
        seqs: &[SeqStep],
        depth: Option<usize>,
        n_layers: usize,
        shift_logits: bool,
    ) -> Result<Self, PlanError> {
        let shared_prefix = depth.is_some();
        let depth = depth.unwrap_or(n_layers);
        let deep_pass = depth < n_layers;
        let mut plan = StepPlan {
            depth,
            n_layers,
            shared_prefix,
            shallow: PassRows::default(),
            copies: Vec::new(),
            deep: PassRows::default(),
            output: if deep_pass {
                Output::Deep
            } else {
                Output::Shallow
            },
            sampled: Vec::with_capacity(seqs.len()),
        };
        for (i, s) in seqs.iter().enumerate() {
            let p = if shared_prefix { s.prefix_len } else { 0 };
            if s.rows.first().is_some_and(|f| f < p)
                || s.rows.end() > s.seq_len
                || s.kv_len > s.seq_len
            {
                return Err(PlanError(format!(
                    "sequence {i}: rows {:?} and {} attended positions in a sequence of {} \
                     positions after a shared prefix of {p}",
                    s.rows, s.kv_len, s.seq_len
                )));
            }
            if !shared_prefix && s.refresh {
                return Err(PlanError(format!(
                    "sequence {i} refreshes a shared prefix the step does not read"
                )));
            }
            if let Some(bad) = s
                .predict
                .iter()
                .find(|&&pos| !s.rows.contains(pos as usize))
            {
                return Err(PlanError(format!(
                    "sequence {i}: position {bad} must be predicted but the step computes \
                     positions {:?}",
                    s.rows
                )));
            }
            let n = s.rows.len();
            let src = plan.shallow.len();
            // The shallow layers' arena holds no prefix rows: position pos sits at pos - p.
            plan.shallow.windows.push(SeqWindow {
                rows: src..src + n,
                kv_start: s.kv_base,
                kv_len: s.kv_len - p,
            });
            for pos in s.rows.iter() {
                plan.shallow.positions.push(pos as u32);
                plan.shallow.kv_rows.push((s.kv_base + pos - p) as u32);
            }
            // The position whose row predicts `pos`.
            let source = |pos: u32| -> usize {
                let pos = pos as usize;
                let before = pos.wrapping_sub(1);
                let computed = s.rows.contains(before) || (deep_pass && s.refresh && before < p);
                if shift_logits && pos > 0 && computed {
                    before
                } else {
                    pos
                }
            };
            if !deep_pass {
                plan.sampled.push(
                    s.predict
                        .iter()
                        .map(|&pos| {
                            // `source` is a computed row (or `pos` itself, which is one).
                            let row = s.rows.index_of(source(pos)).unwrap_or(0);
                            ((src + row) as u32, pos)
                        })
                        .collect(),
                );
                continue;
            }
            let first = plan.deep.len();
            let mut deep_rows: Vec<usize> = Vec::with_capacity(n + p);
            if s.refresh {
                plan.copies.push(RowCopy::Boundary {
                    dst: first,
                    rows: p,
                });
                deep_rows.extend(0..p);
            }
            let own = first + deep_rows.len();
            plan.copies.push(RowCopy::Shallow {
                src,
                dst: own,
                rows: n,
            });
            deep_rows.extend(s.rows.iter());
            plan.deep.windows.push(SeqWindow {
                rows: first..first + deep_rows.len(),
                kv_start: s.kv_base,
                kv_len: s.kv_len,
            });
            for pos in deep_rows {
                plan.deep.positions.push(pos as u32);
                plan.deep.kv_rows.push((s.kv_base + pos) as u32);
            }
            // Refreshed prefix rows sit at `first + position`, the sequence's own rows after.
            let row_of = |position: usize| match s.rows.index_of(position) {
                Some(i) => own + i,
                None => first + position,
            };
            plan.sampled.push(
                s.predict
                    .iter()
                    .map(|&pos| (row_of(source(pos)) as u32, pos))
                    .collect(),
            );
        }
        Ok(plan)
    }

    /// Rows × layers the step computes.
    pub fn token_layer_passes(&self) -> usize {
        self.shallow.len() * self.depth + self.deep.len() * (self.n_layers - self.depth)
    }

    /// Rows the step's state must hold: the larger pass.
    pub fn rows(&self) -> usize {
        self.shallow.len().max(self.deep.len())
    }

    /// The rows of the output pass that are sampled, in sequence order.
    pub fn sampled_rows(&self) -> (Vec<u32>, Vec<u32>) {
        self.sampled.iter().flatten().copied().unzip()
    }
}

/// Splits requests of `lengths` positions, in order, into consecutive batches of at most
/// `max_rows` positions in all (one state must fit the device); a request longer than that
/// is a batch of its own (and reports the limit when it runs).
pub fn split_by_rows(lengths: &[usize], max_rows: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut rows) = (0, 0);
    for (i, &len) in lengths.iter().enumerate() {
        if i > start && rows + len > max_rows {
            out.push(start..i);
            (start, rows) = (i, 0);
        }
        rows += len;
    }
    if start < lengths.len() {
        out.push(start..lengths.len());
    }
    out
}

/// The first row of a free window of `len` rows in an arena of `capacity` rows whose
/// occupied windows are `(start, len)`, if there is one.
pub fn first_fit(occupied: &mut [(usize, usize)], len: usize, capacity: usize) -> Option<usize> {
    occupied.sort_unstable();
    let mut free_from = 0;
    for &(start, used) in occupied.iter() {
        if start >= free_from + len {
            break;
        }
        free_from = free_from.max(start + used);
    }
    (free_from + len <= capacity).then_some(free_from)
}

#[cfg(test)]
mod tests;
