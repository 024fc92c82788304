//! Cache modes as plans over the same forward pass (DESIGN.md §3). A step computes one
//! contiguous range of rows; their K/V overwrite the request's KV arena at their positions,
//! and every computed row attends to the first `kv_len` arena rows. Rows not computed keep
//! the K/V of the pass that last computed them — that is the cache.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// How a request reuses K/V between its denoising steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheMode {
    /// Every step recomputes every row (the reference).
    None,
    /// Fast-dLLM prefix cache: a full pass at each block start; other steps compute the
    /// current block and everything after it, reusing the K/V of the rows before the block.
    FastDllmPrefix,
    /// Fast-dLLM dual cache: a full pass at each block start; other steps compute only the
    /// current block, reusing the K/V of the rows before and after it.
    FastDllmDual,
    /// Autoregressive-style prefix cache: the shared prefix's K/V come from a prefix-only
    /// pass and are reused in every layer, never refreshed (the baseline BiCache improves on).
    PrefixArm,
    /// BiCache: the shared prefix's K/V come from a store shared across requests in the
    /// shallow layers (below the depth b); the deep layers recompute the prefix rows from the
    /// stored boundary state every R steps (at block starts in block mode).
    Bicache,
    /// BiCache composed with the Fast-dLLM dual cache: between refreshes only the current
    /// block's rows are computed.
    BicacheDual,
}

impl CacheMode {
    pub const ALL: [CacheMode; 6] = [
        CacheMode::None,
        CacheMode::FastDllmPrefix,
        CacheMode::FastDllmDual,
        CacheMode::PrefixArm,
        CacheMode::Bicache,
        CacheMode::BicacheDual,
    ];

    /// Whether the mode reuses a shared prefix entry across requests.
    pub fn is_bicache(self) -> bool {
        matches!(self, CacheMode::Bicache | CacheMode::BicacheDual)
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheMode::None => "none",
            CacheMode::FastDllmPrefix => "fast-dllm-prefix",
            CacheMode::FastDllmDual => "fast-dllm-dual",
            CacheMode::PrefixArm => "prefix-arm",
            CacheMode::Bicache => "bicache",
            CacheMode::BicacheDual => "bicache-dual",
        }
    }
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown cache mode name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown cache mode {found:?}: expected one of none, fast-dllm-prefix, fast-dllm-dual, prefix-arm, bicache, bicache-dual"
)]
pub struct UnknownCacheMode {
    pub found: String,
}

impl FromStr for CacheMode {
    type Err = UnknownCacheMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CacheMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| UnknownCacheMode {
                found: s.to_string(),
            })
    }
}

/// One forward pass: which rows it computes and how many arena rows they attend to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassPlan {
    pub rows: Range<usize>,
    pub kv_len: usize,
}

/// The passes of one denoising step; the last pass's rows are the ones sampled from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepPlan {
    /// A pass whose outputs are only K/V (the prefix-only pass of `prefix-arm`).
    pub warmup: Option<PassPlan>,
    pub pass: PassPlan,
}

impl StepPlan {
    /// Rows × layers computed by this step's passes.
    pub fn token_layer_passes(&self, n_layers: usize) -> usize {
        let w = self.warmup.as_ref().map_or(0, |p| p.rows.len());
        (w + self.pass.rows.len()) * n_layers
    }
}

/// Everything the planner needs to know about the request and the step.
#[derive(Clone, Debug)]
pub struct PlanInput {
    pub mode: CacheMode,
    /// Prompt + generated canvas.
    pub seq_len: usize,
    /// Rows of the shared prefix (prefix-arm); at most the prompt length.
    pub prefix_len: usize,
    /// The current block's positions.
    pub block: Range<usize>,
    /// True on the first step of the request and of every block.
    pub block_start: bool,
    /// True on the request's first step.
    pub first_step: bool,
    /// Recompute every row at every step whatever the mode (checks that the plumbing of a
    /// mode is exact: its tokens must then equal `none`'s).
    pub recompute_all: bool,
}

/// The plan of one step.
pub fn plan_step(i: &PlanInput) -> StepPlan {
    let t = i.seq_len;
    let full = PassPlan {
        rows: 0..t,
        kv_len: t,
    };
    if i.recompute_all {
        return StepPlan {
            warmup: None,
            pass: full,
        };
    }
    match i.mode {
        // BiCache steps are planned by `bicache_step`; asked here, they get a full pass.
        CacheMode::None | CacheMode::Bicache | CacheMode::BicacheDual => StepPlan {
            warmup: None,
            pass: full,
        },
        CacheMode::FastDllmPrefix if i.block_start => StepPlan {
            warmup: None,
            pass: full,
        },
        CacheMode::FastDllmPrefix => StepPlan {
            warmup: None,
            pass: PassPlan {
                rows: i.block.start..t,
                kv_len: t,
            },
        },
        CacheMode::FastDllmDual if i.block_start => StepPlan {
            warmup: None,
            pass: full,
        },
        CacheMode::FastDllmDual => StepPlan {
            warmup: None,
            pass: PassPlan {
                rows: i.block.clone(),
                kv_len: t,
            },
        },
        CacheMode::PrefixArm => {
            let p = i.prefix_len.min(t);
            StepPlan {
                // The prefix sees only itself, once, like an autoregressive prompt cache.
                warmup: (i.first_step && p > 0).then_some(PassPlan {
                    rows: 0..p,
                    kv_len: p,
                }),
                pass: PassPlan {
                    rows: p..t,
                    kv_len: t,
                },
            }
        }
    }
}

/// One BiCache step: the non-prefix rows computed in every layer, and whether the deep
/// layers also recompute the prefix rows (a refresh).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BicacheStep {
    pub refresh: bool,
    pub rows: Range<usize>,
}

/// Plans a BiCache step. Refreshes happen on the first step and then every `refresh_every`
/// steps, or at every block start when the request has several blocks; the dual variant
/// computes only the current block between refreshes.
#[allow(clippy::too_many_arguments)] // the step's whole situation, each a plain number
pub fn bicache_step(
    dual: bool,
    prefix_len: usize,
    seq_len: usize,
    block: Range<usize>,
    block_start: bool,
    several_blocks: bool,
    steps_done: usize,
    refresh_every: usize,
) -> BicacheStep {
    let refresh = steps_done == 0
        || if several_blocks {
            block_start
        } else {
            steps_done.is_multiple_of(refresh_every.max(1))
        };
    let rows = if dual && !refresh {
        block
    } else {
        prefix_len..seq_len
    };
    BicacheStep { refresh, rows }
}

impl BicacheStep {
    /// Rows × layers: shallow layers see only the computed rows; deep layers see the prefix
    /// rows too on a refresh.
    pub fn token_layer_passes(&self, depth: usize, n_layers: usize, prefix_len: usize) -> usize {
        let n = self.rows.len();
        let deep_rows = if self.refresh { prefix_len + n } else { n };
        n * depth + deep_rows * (n_layers - depth)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(mode: CacheMode, block: Range<usize>, block_start: bool, first: bool) -> PlanInput {
        PlanInput {
            mode,
            seq_len: 20,
            prefix_len: 6,
            block,
            block_start,
            first_step: first,
            recompute_all: false,
        }
    }

    #[test]
    fn names_round_trip() {
        for m in CacheMode::ALL {
            assert_eq!(m.name().parse::<CacheMode>().unwrap(), m);
        }
        let err = "bicache2".parse::<CacheMode>().unwrap_err();
        assert!(err.to_string().contains("bicache2"));
    }

    #[test]
    fn plans_follow_the_modes() {
        let none = plan_step(&input(CacheMode::None, 12..16, false, false));
        assert_eq!(
            none.pass,
            PassPlan {
                rows: 0..20,
                kv_len: 20
            }
        );
        let p0 = plan_step(&input(CacheMode::FastDllmPrefix, 12..16, true, false));
        assert_eq!(p0.pass.rows, 0..20);
        let p1 = plan_step(&input(CacheMode::FastDllmPrefix, 12..16, false, false));
        assert_eq!(
            p1.pass,
            PassPlan {
                rows: 12..20,
                kv_len: 20
            }
        );
        let d1 = plan_step(&input(CacheMode::FastDllmDual, 12..16, false, false));
        assert_eq!(
            d1.pass,
            PassPlan {
                rows: 12..16,
                kv_len: 20
            }
        );
        let a0 = plan_step(&input(CacheMode::PrefixArm, 8..12, true, true));
        assert_eq!(
            a0.warmup,
            Some(PassPlan {
                rows: 0..6,
                kv_len: 6
            })
        );
        assert_eq!(
            a0.pass,
            PassPlan {
                rows: 6..20,
                kv_len: 20
            }
        );
        let a1 = plan_step(&input(CacheMode::PrefixArm, 8..12, true, false));
        assert_eq!(a1.warmup, None);
        assert_eq!(a1.token_layer_passes(3), 14 * 3);
    }

    #[test]
    fn bicache_refreshes_every_r_steps_or_at_block_starts() {
        let s = |dual, start, several, done| {
            bicache_step(dual, 10, 30, 20..24, start, several, done, 4)
        };
        assert_eq!(
            s(false, false, false, 0),
            BicacheStep {
                refresh: true,
                rows: 10..30
            }
        );
        assert_eq!(
            s(false, false, false, 3),
            BicacheStep {
                refresh: false,
                rows: 10..30
            }
        );
        assert!(s(false, false, false, 8).refresh);
        assert_eq!(
            s(true, false, false, 3),
            BicacheStep {
                refresh: false,
                rows: 20..24
            }
        );
        assert!(s(true, true, true, 5).refresh);
        assert!(
            !s(true, false, true, 4).refresh,
            "block mode refreshes only at block starts"
        );
        let refresh = s(false, false, false, 0);
        assert_eq!(refresh.token_layer_passes(2, 6, 10), 20 * 2 + 30 * 4);
        assert_eq!(s(true, false, false, 3).token_layer_passes(2, 6, 10), 4 * 6);
    }

    #[test]
    fn recompute_all_is_always_a_full_pass() {
        for m in CacheMode::ALL {
            let mut i = input(m, 12..16, false, true);
            i.recompute_all = true;
            assert_eq!(
                plan_step(&i),
                StepPlan {
                    warmup: None,
                    pass: PassPlan {
                        rows: 0..20,
                        kv_len: 20
                    }
                }
            );
        }
    }
}
