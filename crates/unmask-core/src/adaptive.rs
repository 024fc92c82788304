//! dLLM-Cache's adaptive refresh within a request (`reference/caching.md` §4): every layer
//! keeps the response's attention and MLP outputs; the prompt is recomputed every K_p
//! forwards, the response every K_r; in between, each layer recomputes only the response
//! rows whose value vectors moved most (V-verify, the lowest ρ share by cosine), and every
//! other row takes its cached outputs.
//!
//! `AdaptiveRefresh` is the request's setting, `AdaptiveStep` what one forward of one
//! sequence does (the mode planner's answer, `cache::plan_mode`), and `AdaptivePass` the
//! layout of a step's rows for the executor: which pass rows are computed in full, which
//! are verified, and the compute list the GPU completes with the verified rows it picks.

use std::ops::Range;

use crate::step_plan::{PlanError, SeqWindow, StepPlan};

/// dLLM-Cache's reference defaults: prompt every 100 forwards, response every 7, a
/// quarter of the response recomputed in between.
pub const DEFAULT_PROMPT_INTERVAL: usize = 100;
pub const DEFAULT_RESPONSE_INTERVAL: usize = 7;
pub const DEFAULT_REFRESH_RATIO: f32 = 0.25;

/// A request's dLLM-Cache setting.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptiveRefresh {
    /// K_p: forwards between full recomputes of the prompt rows (1: every forward).
    pub prompt_interval: usize,
    /// K_r: forwards between full recomputes of the response rows.
    pub response_interval: usize,
    /// ρ: share of the response recomputed by V-verify between response refreshes (0:
    /// the response is reused whole until its next refresh).
    pub refresh_ratio: f32,
    /// Which rows V-verify recomputes: the reference's (lowest cosine), or the opposite,
    /// a deliberately wrong cache that shows what the rule is worth.
    pub pick: VerifyPick,
    /// With LLaDA's blocks (a request of several blocks), the current block's rows are
    /// computed at every forward, as Fast-dLLM's dual cache computes them, and V-verify
    /// picks among the other response rows. Off: the reference's rule over the whole
    /// response, whose masked rows then keep their outputs from the last refresh while
    /// the sampler must commit inside the block.
    pub pin_block: bool,
}

/// The rows V-verify recomputes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VerifyPick {
    /// The rows whose V moved most (lowest cosine against the cached V): the reference.
    #[default]
    LowestCosine,
    /// The rows whose V moved least: wrong on purpose (accuracy ablations, tests).
    HighestCosine,
}

impl VerifyPick {
    pub fn name(self) -> &'static str {
        match self {
            VerifyPick::LowestCosine => "lowest-cosine",
            VerifyPick::HighestCosine => "highest-cosine",
        }
    }
}

impl std::str::FromStr for VerifyPick {
    type Err = AdaptiveError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [VerifyPick::LowestCosine, VerifyPick::HighestCosine]
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| AdaptiveError {
                field: "verify_pick",
                expected: "lowest-cosine or highest-cosine",
                found: s.to_string(),
            })
    }
}

impl Default for AdaptiveRefresh {
    fn default() -> Self {
        Self {
            prompt_interval: DEFAULT_PROMPT_INTERVAL,
            response_interval: DEFAULT_RESPONSE_INTERVAL,
            refresh_ratio: DEFAULT_REFRESH_RATIO,
            pick: VerifyPick::LowestCosine,
            pin_block: true,
        }
    }
}

/// A setting out of range: the field, what it must be, what it was.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: expected {expected}, found {found}")]
pub struct AdaptiveError {
    pub field: &'static str,
    pub expected: &'static str,
    pub found: String,
}

/// What a forward does with the response rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseRefresh {
    /// Every response row is computed in full and its caches overwritten.
    Full,
    /// V of every response row is computed and stored; the `recompute` rows of lowest
    /// cosine against their cached V are computed in full, the rest take cached outputs.
    Verify { recompute: usize },
    /// Every response row takes its cached outputs (ρ = 0 between refreshes).
    Reuse,
}

/// One forward of one sequence under dLLM-Cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdaptiveStep {
    /// The response: the positions whose hidden rows are sampled, to the end of the
    /// sequence (the canvas; with shifted logits also the last prompt position).
    pub response: Range<usize>,
    /// The positions before the response are computed this forward.
    pub refresh_prompt: bool,
    pub refresh: ResponseRefresh,
    pub pick: VerifyPick,
    /// Positions of the response computed whatever V-verify picks (the current block
    /// under `pin_block`; empty otherwise or when the response refreshes).
    pub pinned: Range<usize>,
}

impl AdaptiveRefresh {
    pub fn check(&self) -> Result<(), AdaptiveError> {
        let interval = |field, v: usize| {
            if v == 0 {
                Err(AdaptiveError {
                    field,
                    expected: "at least 1 forward",
                    found: "0".into(),
                })
            } else {
                Ok(())
            }
        };
        interval("prompt_interval", self.prompt_interval)?;
        interval("response_interval", self.response_interval)?;
        let r = self.refresh_ratio;
        if !(r.is_finite() && (0.0..=1.0).contains(&r)) {
            return Err(AdaptiveError {
                field: "refresh_ratio",
                expected: "a number from 0 to 1",
                found: r.to_string(),
            });
        }
        Ok(())
    }

    /// Response rows V-verify recomputes: ⌊ρ·G⌋, with ρ read as the decimal it was written
    /// as (0.7 · 10 is 7, as the reference computes it in f64, not 6 as f32 0.7 would give).
    pub fn recompute_rows(&self, response_rows: usize) -> usize {
        let ratio = self
            .refresh_ratio
            .to_string()
            .parse::<f64>()
            .unwrap_or(f64::from(self.refresh_ratio));
        ((ratio * response_rows as f64).floor() as usize).min(response_rows)
    }

    /// Forward `steps_done + 1` of a sequence whose response is `response`: the prompt
    /// refreshes when `steps_done` is a multiple of K_p, the response when it is one of K_r
    /// (both on the first forward). `block` is the current block when the request has
    /// several (pinned under `pin_block`).
    pub fn step(
        &self,
        steps_done: usize,
        response: Range<usize>,
        block: Option<Range<usize>>,
    ) -> AdaptiveStep {
        let full = steps_done.is_multiple_of(self.response_interval.max(1));
        let pinned = match block {
            Some(b) if self.pin_block && !full => {
                b.start.clamp(response.start, response.end)
                    ..b.end.clamp(response.start, response.end)
            }
            _ => response.start..response.start,
        };
        let refresh = if full {
            ResponseRefresh::Full
        } else if self.refresh_ratio > 0.0 {
            ResponseRefresh::Verify {
                recompute: self
                    .recompute_rows(response.len())
                    .min(response.len() - pinned.len()),
            }
        } else {
            ResponseRefresh::Reuse
        };
        AdaptiveStep {
            refresh_prompt: steps_done.is_multiple_of(self.prompt_interval.max(1)),
            response,
            refresh,
            pick: self.pick,
            pinned,
        }
    }
}

impl AdaptiveStep {
    /// Rows per layer that run attention and the MLP, of `rows` rows in the pass.
    pub fn computed_rows(&self, rows: usize) -> usize {
        let others = rows - self.response.len() + self.pinned.len();
        match self.refresh {
            ResponseRefresh::Full => rows,
            ResponseRefresh::Verify { recompute } => others + recompute,
            ResponseRefresh::Reuse => others,
        }
    }

    /// Rows per layer whose V is computed and checked.
    pub fn verified_rows(&self) -> usize {
        match self.refresh {
            ResponseRefresh::Verify { .. } => self.response.len(),
            _ => 0,
        }
    }
}

/// One sequence's part of an adaptive pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdaptiveMember {
    /// Pass rows of its response (the tail of its rows).
    pub response: Range<usize>,
    pub refresh: ResponseRefresh,
    pub pick: VerifyPick,
    /// Rows of the response (counted from its first) V-verify never picks: the pinned
    /// block, computed anyway.
    pub skip: Range<usize>,
    /// First slot of the compute list its verified rows go to (the GPU writes them).
    pub list_base: usize,
}

/// The rows of one adaptive step: a plan's pass rows (every response row, plus the prompt
/// rows of sequences that refresh it) and the compute list, the pass rows that run
/// attention and the MLP, member after member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdaptivePass {
    /// Rows of the pass.
    pub rows: usize,
    pub members: Vec<AdaptiveMember>,
    /// Pass row of each computed row; the slots of verified rows hold 0 until the GPU
    /// writes the rows it picked.
    pub list: Vec<u32>,
    /// The computed rows of each sequence (rows of the compute list) and its arena rows.
    pub windows: Vec<SeqWindow>,
}

impl AdaptivePass {
    /// The adaptive layout of `plan` (a plan without a shared prefix), whose sequence i
    /// computes `steps[i]`.
    pub fn new(plan: &StepPlan, steps: &[&AdaptiveStep]) -> Result<Self, PlanError> {
        let windows = &plan.shallow.windows;
        if plan.shared_prefix || windows.len() != steps.len() {
            return Err(PlanError(format!(
                "an adaptive step over {} sequences for a plan of {} sequences{}",
                steps.len(),
                windows.len(),
                if plan.shared_prefix {
                    " reading a shared prefix"
                } else {
                    ""
                }
            )));
        }
        let mut pass = AdaptivePass {
            rows: plan.shallow.len(),
            members: Vec::with_capacity(steps.len()),
            list: Vec::new(),
            windows: Vec::new(),
        };
        for (i, (w, a)) in windows.iter().zip(steps).enumerate() {
            let g = a.response.len();
            let want = if a.refresh_prompt { a.response.end } else { g };
            if w.rows.len() != want {
                return Err(PlanError(format!(
                    "sequence {i}: {} pass rows for an adaptive step of {want} (response {:?})",
                    w.rows.len(),
                    a.response
                )));
            }
            let response = w.rows.end - g..w.rows.end;
            let first = pass.list.len();
            pass.list.extend(w.rows.start as u32..response.start as u32);
            let skip = a.pinned.start - a.response.start..a.pinned.end - a.response.start;
            if a.refresh != ResponseRefresh::Full {
                let pinned = response.start + skip.start..response.start + skip.end;
                pass.list.extend(pinned.start as u32..pinned.end as u32);
            }
            let list_base = pass.list.len();
            match a.refresh {
                ResponseRefresh::Full => {
                    pass.list.extend(response.start as u32..response.end as u32)
                }
                ResponseRefresh::Verify { recompute } => {
                    pass.list.extend(std::iter::repeat_n(0, recompute))
                }
                ResponseRefresh::Reuse => {}
            }
            if pass.list.len() > first {
                pass.windows.push(SeqWindow {
                    rows: first..pass.list.len(),
                    kv_start: w.kv_start,
                    kv_len: w.kv_len,
                });
            }
            pass.members.push(AdaptiveMember {
                response,
                refresh: a.refresh,
                pick: a.pick,
                skip,
                list_base,
            });
        }
        Ok(pass)
    }

    /// The positions member `k` had picked in each layer, from the read-back of every
    /// layer's compute list (`lists`: one list after the other); none when it did not
    /// verify. `response_start` is its response's first position.
    pub fn picked(&self, k: usize, lists: &[u32], response_start: usize) -> Vec<Vec<u32>> {
        let m = &self.members[k];
        let ResponseRefresh::Verify { recompute } = m.refresh else {
            return Vec::new();
        };
        let len = self.list.len().max(1);
        lists
            .chunks_exact(len)
            .map(|layer| {
                layer[m.list_base..m.list_base + recompute]
                    .iter()
                    .map(|&row| (row as usize - m.response.start + response_start) as u32)
                    .collect()
            })
            .collect()
    }

    /// The shallow layers' layout when the pass's sequences share a prefix entry of
    /// `prefix_len` positions read below layer `depth` (BiCache): `plan` is the plan of the
    /// same rows without the entry (`StepPlan::alone`), whose arena rows are the deep
    /// layers'.
    pub fn shallow_layout(
        &self,
        plan: &StepPlan,
        steps: &[&AdaptiveStep],
        prefix_len: usize,
        depth: usize,
    ) -> Result<ShallowLayout, PlanError> {
        let mut out = ShallowLayout {
            depth,
            prefix_len,
            list: Vec::new(),
            list_base: Vec::with_capacity(steps.len()),
            windows: Vec::new(),
            kv_rows: Vec::with_capacity(self.rows),
            boundary: Vec::new(),
        };
        for ((w, a), m) in plan.shallow.windows.iter().zip(steps).zip(&self.members) {
            if w.kv_len < prefix_len || a.response.start < prefix_len {
                return Err(PlanError(format!(
                    "a shared prefix of {prefix_len} positions in a sequence of {} whose \
                     response starts at {}",
                    w.kv_len, a.response.start
                )));
            }
            let first = out.list.len();
            if a.refresh_prompt {
                out.boundary.push(w.rows.start);
                let user = w.rows.start + prefix_len..m.response.start;
                out.list.extend(user.start as u32..user.end as u32);
            }
            if m.refresh == ResponseRefresh::Full {
                out.list
                    .extend(m.response.start as u32..m.response.end as u32);
            } else {
                let pinned = m.response.start + m.skip.start..m.response.start + m.skip.end;
                out.list.extend(pinned.start as u32..pinned.end as u32);
            }
            out.list_base.push(out.list.len());
            if let ResponseRefresh::Verify { recompute } = m.refresh {
                out.list.extend(std::iter::repeat_n(0, recompute));
            }
            if out.list.len() > first {
                out.windows.push(SeqWindow {
                    rows: first..out.list.len(),
                    kv_start: w.kv_start,
                    kv_len: w.kv_len - prefix_len,
                });
            }
        }
        // Position p sits at arena row p - prefix_len of the shallow layers; prefix rows are
        // never computed there.
        for (&pos, &row) in plan.shallow.positions.iter().zip(&plan.shallow.kv_rows) {
            let pos = pos as usize;
            out.kv_rows.push(if pos < prefix_len {
                0
            } else {
                row - prefix_len as u32
            });
        }
        Ok(out)
    }

    /// Every pass row is computed (every response refreshes in full, so each sequence's
    /// rows are listed in order): the compute list is `0..rows`.
    pub fn is_identity(&self) -> bool {
        self.members
            .iter()
            .all(|m| m.refresh == ResponseRefresh::Full)
    }

    /// Some member verifies its response (V of its rows is projected).
    pub fn verifies(&self) -> bool {
        self.members
            .iter()
            .any(|m| matches!(m.refresh, ResponseRefresh::Verify { .. }))
    }
}

/// The shallow layers of an adaptive pass over sequences sharing a prefix entry: their
/// compute list (the deep one without the prefix rows), arena rows and windows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShallowLayout {
    /// Layers below it read the prefix from the entry.
    pub depth: usize,
    pub prefix_len: usize,
    pub list: Vec<u32>,
    /// Per sequence, the first slot of its verified rows in `list`.
    pub list_base: Vec<usize>,
    pub windows: Vec<SeqWindow>,
    /// Arena row of each pass row in these layers (0 for prefix rows, never computed).
    pub kv_rows: Vec<u32>,
    /// First pass row of each sequence that refreshes its prompt: its prefix rows enter
    /// layer `depth` from the entry's boundary state.
    pub boundary: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step_plan::SeqStep;

    #[test]
    fn intervals_follow_the_reference_forward_count() {
        let a = AdaptiveRefresh {
            prompt_interval: 5,
            response_interval: 3,
            refresh_ratio: 0.5,
            pick: VerifyPick::LowestCosine,
            pin_block: true,
        };
        // Forward n refreshes the response iff (n - 1) % K_r == 0.
        let kinds: Vec<_> = (0..7).map(|d| a.step(d, 20..36, None)).collect();
        assert_eq!(kinds[0].refresh, ResponseRefresh::Full);
        assert!(kinds[0].refresh_prompt);
        assert_eq!(kinds[1].refresh, ResponseRefresh::Verify { recompute: 8 });
        assert!(!kinds[1].refresh_prompt);
        assert_eq!(kinds[3].refresh, ResponseRefresh::Full);
        assert!(kinds[5].refresh_prompt && kinds[5].refresh != ResponseRefresh::Full);
        let reuse = AdaptiveRefresh {
            refresh_ratio: 0.0,
            ..a
        };
        assert_eq!(reuse.step(1, 20..36, None).refresh, ResponseRefresh::Reuse);
        // The current block is computed at every forward and V-verify picks among the rest.
        let pinned = a.step(1, 20..36, Some(24..28));
        assert_eq!(pinned.pinned, 24..28);
        assert_eq!(pinned.computed_rows(16), 4 + 8);
        assert_eq!(
            a.step(3, 20..36, Some(24..28)).pinned.len(),
            0,
            "a refresh pins nothing"
        );
        let unpinned = AdaptiveRefresh {
            pin_block: false,
            ..a
        };
        assert_eq!(unpinned.step(1, 20..36, Some(24..28)).pinned.len(), 0);
        let all = AdaptiveRefresh {
            refresh_ratio: 1.0,
            ..a
        };
        assert_eq!(
            all.step(1, 20..36, Some(24..28)).refresh,
            ResponseRefresh::Verify { recompute: 12 },
            "the picks leave out the pinned rows"
        );
    }

    #[test]
    fn recomputed_rows_read_the_ratio_as_written() {
        let r = |refresh_ratio| AdaptiveRefresh {
            refresh_ratio,
            ..AdaptiveRefresh::default()
        };
        assert_eq!(r(0.7).recompute_rows(10), 7);
        assert_eq!(r(0.25).recompute_rows(16), 4);
        assert_eq!(r(0.1).recompute_rows(9), 0);
        assert_eq!(r(1.0).recompute_rows(32), 32);
    }

    #[test]
    fn bad_settings_name_their_field() {
        let bad = AdaptiveRefresh {
            response_interval: 0,
            ..AdaptiveRefresh::default()
        };
        assert_eq!(bad.check().unwrap_err().field, "response_interval");
        let bad = AdaptiveRefresh {
            refresh_ratio: 1.5,
            ..AdaptiveRefresh::default()
        };
        let e = bad.check().unwrap_err();
        assert_eq!((e.field, e.found.as_str()), ("refresh_ratio", "1.5"));
        assert!(AdaptiveRefresh::default().check().is_ok());
    }

    #[test]
    fn the_compute_list_lays_members_out_in_pass_order() {
        // Sequence 0 refreshes its prompt (rows 0..10 of 14) and verifies 2 of its 4
        // response rows; sequence 1 reuses its response of 4.
        let a0 = AdaptiveStep {
            response: 10..14,
            refresh_prompt: true,
            refresh: ResponseRefresh::Verify { recompute: 2 },
            pick: VerifyPick::LowestCosine,
            pinned: 12..13,
        };
        let a1 = AdaptiveStep {
            response: 6..10,
            refresh_prompt: false,
            refresh: ResponseRefresh::Reuse,
            pick: VerifyPick::LowestCosine,
            pinned: 6..6,
        };
        let seq = |rows: Range<usize>, len, base| SeqStep {
            rows: rows.into(),
            kv_base: base,
            predict: Vec::new(),
            ..SeqStep::whole(len)
        };
        let plan = StepPlan::alone(&[seq(0..14, 14, 0), seq(6..10, 10, 14)], 2, false).unwrap();
        let pass = AdaptivePass::new(&plan, &[&a0, &a1]).unwrap();
        assert_eq!(pass.rows, 18);
        assert_eq!(pass.list.len(), 13);
        assert_eq!(&pass.list[..10], &(0..10).collect::<Vec<u32>>()[..]);
        assert_eq!(pass.list[10], 12, "the pinned row, then the verified slots");
        assert_eq!(pass.members[0].response, 10..14);
        assert_eq!(
            pass.members[0].skip,
            2..3,
            "position 12 is the response's third row"
        );
        assert_eq!(pass.members[0].list_base, 11);
        assert_eq!(pass.members[1].response, 14..18);
        assert_eq!(pass.windows.len(), 1, "sequence 1 computes nothing");
        assert_eq!(pass.windows[0].rows, 0..13);
        assert!(pass.verifies() && !pass.is_identity());
        assert_eq!(a0.computed_rows(14), 13);
        assert_eq!(a1.computed_rows(4), 0);
        // A plan whose rows do not match the steps is refused.
        assert!(AdaptivePass::new(&plan, &[&a1, &a0]).is_err());
        // Under a shared prefix of 6 the shallow layers leave out sequence 0's prefix rows.
        let shallow = pass.shallow_layout(&plan, &[&a0, &a1], 6, 1).unwrap();
        assert_eq!(shallow.list[..5], [6, 7, 8, 9, 12]);
        assert_eq!(shallow.list_base, vec![5, 7]);
        assert_eq!(shallow.windows[0].kv_len, 14 - 6);
        assert_eq!(shallow.boundary, vec![0]);
        assert_eq!(shallow.kv_rows[6], 0, "position 6 at shallow arena row 0");
        assert_eq!(shallow.kv_rows[14], 14 + 6 - 6, "sequence 1's position 6");
    }
}
