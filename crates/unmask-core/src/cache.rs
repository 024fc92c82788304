//! Cache modes and the one mode planner (DESIGN.md §3): a mode is a rule from a sequence's
//! state to the rows its step computes. A step computes one contiguous range of rows; their
//! K/V overwrite the sequence's KV arena at their positions, and every computed row attends
//! to the first `kv_len` arena rows. Rows not computed keep the K/V of the pass that last
//! computed them — that is the cache. `step_plan` lays the sequences of a step out for the
//! executor.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use crate::adaptive::{AdaptiveRefresh, AdaptiveStep};
use crate::step_plan::RowSet;

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
    /// ACache on the Fast-dLLM dual cache: a shared span anywhere in the prompt has its K/V
    /// from a span-only pass (shared across requests, placed at the request's offset);
    /// at each block start every row but the span's is computed, plus the span's anchors
    /// (the tokens the masked positions attend to most, chosen once per request); within a
    /// block only the block.
    Acache,
    /// dLLM-Cache: per layer, the response's attention and MLP outputs are cached; the
    /// prompt is recomputed every K_p forwards, the response every K_r, and in between only
    /// the response rows whose V moved most (V-verify) (`adaptive`).
    DllmCache,
    /// dLLM-Cache composed with BiCache: the shared prefix's K/V come from the store in the
    /// shallow layers (below b); the deep layers recompute the prefix rows from the stored
    /// boundary state when the prompt refreshes (every K_p forwards); the rest is
    /// `dllm-cache`.
    BicacheDllm,
}

impl CacheMode {
    pub const ALL: [CacheMode; 9] = [
        CacheMode::None,
        CacheMode::FastDllmPrefix,
        CacheMode::FastDllmDual,
        CacheMode::PrefixArm,
        CacheMode::Bicache,
        CacheMode::BicacheDual,
        CacheMode::Acache,
        CacheMode::DllmCache,
        CacheMode::BicacheDllm,
    ];

    /// Whether the mode reuses a shared prefix entry across requests.
    pub fn is_bicache(self) -> bool {
        matches!(
            self,
            CacheMode::Bicache | CacheMode::BicacheDual | CacheMode::BicacheDllm
        )
    }

    /// Whether the mode runs dLLM-Cache's adaptive steps.
    pub fn is_adaptive(self) -> bool {
        matches!(self, CacheMode::DllmCache | CacheMode::BicacheDllm)
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheMode::None => "none",
            CacheMode::FastDllmPrefix => "fast-dllm-prefix",
            CacheMode::FastDllmDual => "fast-dllm-dual",
            CacheMode::PrefixArm => "prefix-arm",
            CacheMode::Bicache => "bicache",
            CacheMode::BicacheDual => "bicache-dual",
            CacheMode::Acache => "acache",
            CacheMode::DllmCache => "dllm-cache",
            CacheMode::BicacheDllm => "bicache-dllm",
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
    "unknown cache mode {found:?}: expected one of none, fast-dllm-prefix, fast-dllm-dual, prefix-arm, bicache, bicache-dual, acache, dllm-cache, bicache-dllm"
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

/// Where a sequence stands before a step: everything the mode planner reads.
#[derive(Clone, Debug)]
pub struct SeqState<'a> {
    pub mode: CacheMode,
    /// Prompt + generated canvas.
    pub seq_len: usize,
    /// Rows of the prompt's shared prefix: segment A of the shallow layers in a BiCache
    /// session, the prefix-only pass of `prefix-arm`; ignored by the other modes.
    pub prefix_len: usize,
    /// The current block's positions.
    pub block: Range<usize>,
    /// True on the first step of the request and of every block.
    pub block_start: bool,
    /// The request has several blocks (BiCache then refreshes at block starts).
    pub several_blocks: bool,
    /// Steps the sequence has run (0 on its first).
    pub steps_done: usize,
    /// BiCache: steps between deep-prefix refreshes of a one-block request.
    pub refresh_every: usize,
    /// Recompute every row at every step whatever the mode (checks that the plumbing of a
    /// mode is exact: its tokens must then equal `none`'s).
    pub recompute_all: bool,
    /// ACache: the shared span's positions, whose K/V come from the span entry.
    pub span: Option<Range<usize>>,
    /// ACache: the span positions recomputed with the request (sorted).
    pub anchors: &'a [u32],
    /// dLLM-Cache: the first position whose hidden row is sampled (the canvas start, one
    /// before it with shifted logits): the response runs from here to the end.
    pub response_start: usize,
    /// dLLM-Cache: the request's intervals and ratio.
    pub adaptive: AdaptiveRefresh,
}

/// One sequence's step in any mode: the rows computed in every layer and the positions
/// they attend to, whether the deep layers refresh the shared prefix, and the
/// prefix-only pass that runs first (prefix-arm's first step).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModeStep {
    /// Rows `0..w` computed alone (attending only to themselves) before the step.
    pub warmup: Option<usize>,
    pub rows: RowSet,
    /// The computed rows attend to positions `0..kv_len`.
    pub kv_len: usize,
    /// BiCache: the deep layers recompute the prefix rows from the boundary state.
    pub refresh: bool,
    /// dLLM-Cache: what the step does with the prompt and the response (`rows` are the
    /// response, after the prompt when it refreshes).
    pub adaptive: Option<AdaptiveStep>,
}

/// The one mode planner: what a sequence computes this step, for every cache mode.
pub fn plan_mode(s: &SeqState) -> ModeStep {
    let t = s.seq_len;
    let step = |rows: Range<usize>| ModeStep {
        warmup: None,
        rows: rows.into(),
        kv_len: t,
        refresh: false,
        adaptive: None,
    };
    if s.recompute_all {
        return step(0..t);
    }
    match s.mode {
        CacheMode::None => step(0..t),
        CacheMode::FastDllmPrefix | CacheMode::FastDllmDual if s.block_start => step(0..t),
        CacheMode::FastDllmPrefix => step(s.block.start..t),
        CacheMode::FastDllmDual => step(s.block.clone()),
        // The span's rows other than its anchors keep the entry's K/V at every depth.
        CacheMode::Acache if s.block_start || s.steps_done == 0 => match &s.span {
            Some(span) => ModeStep {
                rows: RowSet::without_plus(0..t, span.clone(), s.anchors),
                ..step(0..0)
            },
            None => step(0..t),
        },
        CacheMode::Acache => step(s.block.clone()),
        CacheMode::DllmCache | CacheMode::BicacheDllm => {
            let block = s.several_blocks.then(|| s.block.clone());
            let a = s
                .adaptive
                .step(s.steps_done, s.response_start.min(t)..t, block);
            let first = if a.refresh_prompt {
                0
            } else {
                a.response.start
            };
            ModeStep {
                // Under BiCache a prompt refresh is the deep layers' prefix refresh.
                refresh: s.mode == CacheMode::BicacheDllm && a.refresh_prompt,
                adaptive: Some(a),
                ..step(first..t)
            }
        }
        CacheMode::PrefixArm => {
            let p = s.prefix_len.min(t);
            ModeStep {
                // The prefix sees only itself, once, like an autoregressive prompt cache.
                warmup: (s.steps_done == 0 && p > 0).then_some(p),
                ..step(p..t)
            }
        }
        CacheMode::Bicache | CacheMode::BicacheDual => {
            // Refreshes on the first step, then every R steps (at block starts when the
            // request has several blocks); the dual variant computes only the block between.
            let refresh = s.steps_done == 0
                || if s.several_blocks {
                    s.block_start
                } else {
                    s.steps_done.is_multiple_of(s.refresh_every.max(1))
                };
            let rows = if s.mode == CacheMode::BicacheDual && !refresh {
                s.block.clone()
            } else {
                s.prefix_len..t
            };
            ModeStep {
                refresh,
                ..step(rows)
            }
        }
    }
}

impl ModeStep {
    /// Rows × layers the step computes for one sequence: layers below `depth` see only
    /// the computed rows; deep layers also the prefix rows on a refresh (`depth` is the
    /// number of layers when the step reads no shared prefix).
    pub fn token_layer_passes(&self, depth: usize, n_layers: usize, prefix_len: usize) -> usize {
        let n = self.rows.len();
        if let Some(a) = &self.adaptive {
            // Under BiCache the shallow layers read the shared prefix from its entry: its
            // rows run in the deep layers only, when the prompt refreshes.
            let c = a.computed_rows(n);
            let prefix = if self.refresh { prefix_len.min(c) } else { 0 };
            return (c - prefix) * depth + c * (n_layers - depth);
        }
        let deep_rows = if self.refresh { prefix_len + n } else { n };
        self.warmup.unwrap_or(0) * n_layers + n * depth + deep_rows * (n_layers - depth)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adaptive::ResponseRefresh;

    fn state(
        mode: CacheMode,
        block: Range<usize>,
        block_start: bool,
        steps_done: usize,
    ) -> SeqState<'static> {
        SeqState {
            mode,
            seq_len: 20,
            prefix_len: 6,
            block,
            block_start,
            several_blocks: true,
            steps_done,
            refresh_every: 4,
            recompute_all: false,
            span: None,
            anchors: &[],
            response_start: 12,
            adaptive: AdaptiveRefresh::default(),
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
        let none = plan_mode(&state(CacheMode::None, 12..16, false, 3));
        assert_eq!(
            (none.rows, none.kv_len, none.warmup),
            ((0..20).into(), 20, None)
        );
        let p0 = plan_mode(&state(CacheMode::FastDllmPrefix, 12..16, true, 3));
        assert_eq!(p0.rows, (0..20).into());
        let p1 = plan_mode(&state(CacheMode::FastDllmPrefix, 12..16, false, 3));
        assert_eq!((p1.rows, p1.kv_len), ((12..20).into(), 20));
        let d1 = plan_mode(&state(CacheMode::FastDllmDual, 12..16, false, 3));
        assert_eq!((d1.rows, d1.kv_len), ((12..16).into(), 20));
        let a0 = plan_mode(&state(CacheMode::PrefixArm, 8..12, true, 0));
        assert_eq!((a0.warmup, a0.rows.clone()), (Some(6), (6..20).into()));
        assert_eq!(a0.token_layer_passes(3, 3, 6), (6 + 14) * 3);
        let a1 = plan_mode(&state(CacheMode::PrefixArm, 8..12, true, 1));
        assert_eq!(a1.warmup, None);
        assert_eq!(a1.token_layer_passes(3, 3, 6), 14 * 3);
    }

    #[test]
    fn bicache_refreshes_every_r_steps_or_at_block_starts() {
        let s = |dual: bool, start, several, done| {
            let mode = if dual {
                CacheMode::BicacheDual
            } else {
                CacheMode::Bicache
            };
            plan_mode(&SeqState {
                mode,
                seq_len: 30,
                prefix_len: 10,
                block: 20..24,
                block_start: start,
                several_blocks: several,
                steps_done: done,
                refresh_every: 4,
                recompute_all: false,
                span: None,
                anchors: &[],
                response_start: 24,
                adaptive: AdaptiveRefresh::default(),
            })
        };
        let first = s(false, false, false, 0);
        assert_eq!((first.refresh, first.rows.clone()), (true, (10..30).into()));
        let third = s(false, false, false, 3);
        assert_eq!((third.refresh, third.rows), (false, (10..30).into()));
        assert!(s(false, false, false, 8).refresh);
        let dual = s(true, false, false, 3);
        assert_eq!((dual.refresh, dual.rows.clone()), (false, (20..24).into()));
        assert!(s(true, true, true, 5).refresh);
        assert!(
            !s(true, false, true, 4).refresh,
            "block mode refreshes only at block starts"
        );
        assert_eq!(first.token_layer_passes(2, 6, 10), 20 * 2 + 30 * 4);
        assert_eq!(dual.token_layer_passes(2, 6, 10), 4 * 6);
    }

    #[test]
    fn acache_refreshes_all_but_the_span_and_keeps_its_anchors() {
        let anchors = [7u32, 9];
        let s = |start, done| {
            plan_mode(&SeqState {
                span: Some(4..12),
                anchors: &anchors,
                ..state(CacheMode::Acache, 16..20, start, done)
            })
        };
        let first = s(true, 0);
        assert_eq!(first.rows.ranges(), &[0..4, 7..8, 9..10, 12..20]);
        assert_eq!(
            (first.kv_len, first.refresh, first.warmup),
            (20, false, None)
        );
        assert_eq!(s(false, 2).rows, (16..20).into());
        assert_eq!(s(true, 5).rows.len(), 4 + 2 + 8);
        assert_eq!(first.token_layer_passes(4, 4, 0), 14 * 4);
        // Without a span it is the dual cache.
        let plain = plan_mode(&state(CacheMode::Acache, 16..20, true, 0));
        assert_eq!(plain.rows, (0..20).into());
    }

    #[test]
    fn dllm_cache_carries_the_response_and_refreshes_the_prompt_every_k_p() {
        let s = |done| {
            let mut st = state(CacheMode::DllmCache, 12..16, false, done);
            st.adaptive = AdaptiveRefresh {
                prompt_interval: 4,
                response_interval: 3,
                refresh_ratio: 0.5,
                ..AdaptiveRefresh::default()
            };
            plan_mode(&st)
        };
        let first = s(0);
        assert_eq!(first.rows, (0..20).into());
        assert_eq!(first.token_layer_passes(3, 3, 0), 20 * 3);
        let verify = s(1);
        assert_eq!(verify.rows, (12..20).into());
        // The block 12..16 pinned, and ⌊0.5 · 8⌋ = 4 of the others verified.
        assert_eq!(verify.adaptive.as_ref().unwrap().pinned, 12..16);
        assert_eq!(verify.token_layer_passes(3, 3, 0), (4 + 4) * 3);
        let prompt_only = s(4);
        assert_eq!(prompt_only.rows, (0..20).into());
        let a = prompt_only.adaptive.as_ref().unwrap();
        assert!(a.refresh_prompt);
        assert_eq!(a.refresh, ResponseRefresh::Verify { recompute: 4 });
        assert_eq!(prompt_only.token_layer_passes(3, 3, 0), (12 + 4 + 4) * 3);
    }

    #[test]
    fn bicache_dllm_refreshes_the_deep_prefix_with_the_prompt() {
        let mut st = state(CacheMode::BicacheDllm, 12..16, false, 0);
        let first = plan_mode(&st);
        assert!(first.refresh);
        assert_eq!(first.rows, (0..20).into());
        // Depth 1 of 3: 14 non-prefix rows in layer 0, all 20 in the deep layers.
        assert_eq!(first.token_layer_passes(1, 3, 6), 14 + 20 * 2);
        st.steps_done = 1;
        let later = plan_mode(&st);
        assert!(!later.refresh && later.rows == (12..20).into());
        assert!(CacheMode::BicacheDllm.is_bicache() && CacheMode::BicacheDllm.is_adaptive());
    }

    #[test]
    fn recompute_all_is_always_a_full_pass() {
        for m in CacheMode::ALL {
            let mut s = state(m, 12..16, false, 0);
            s.recompute_all = true;
            assert_eq!(
                plan_mode(&s),
                ModeStep {
                    warmup: None,
                    rows: (0..20).into(),
                    kv_len: 20,
                    refresh: false,
                    adaptive: None,
                }
            );
        }
    }
}
