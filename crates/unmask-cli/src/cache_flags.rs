//! The caches' flags shared by the commands that run requests: BiCache's depth, refresh
//! and store budget, ACache's anchor ratio, dLLM-Cache's intervals and ratio, and
//! `--full-canvas`; and the per-request settings they give.

use clap::Args;
use unmask::{AdaptiveRefresh, CacheBudget, CacheMode, EngineOptions};

use crate::values;

/// Used when `--refresh` is not given (the paper's R).
const DEFAULT_REFRESH: usize = 16;

/// The caches' flags: BiCache's depth and refresh interval, ACache's anchor ratio, and the
/// shared store's budget.
#[derive(Args, Clone, Debug)]
pub struct CacheFlags {
    /// BiCache: shallow layers that reuse the shared prefix (default: the model's
    /// bicache_depth.json; without one BiCache falls back and says why)
    #[arg(long, value_name = "B", value_parser = values::whole, allow_negative_numbers = true)]
    pub depth: Option<usize>,
    /// BiCache: steps between deep-prefix refreshes in one-block requests (default 16)
    #[arg(long, value_name = "R", value_parser = values::positive, allow_negative_numbers = true)]
    pub refresh: Option<usize>,
    /// BiCache: what the shared prefix store may hold, e.g. 5000 or 5000,2G (BYTES takes K,
    /// M, G; default 65536 tokens, 1G)
    #[arg(long, value_name = "TOKENS[,BYTES]", value_parser = values::cache_budget)]
    pub cache_budget: Option<CacheBudget>,
    /// ACache: the share of the shared span recomputed with each request, its anchors, from
    /// 0 (the span reused as it is) to 1 (default 0.2)
    #[arg(long, value_name = "R", value_parser = values::share)]
    pub anchor_ratio: Option<f32>,
    /// dLLM-Cache: forwards between full recomputes of the prompt, K_p (default 100)
    #[arg(long, value_name = "K_P", value_parser = values::positive, allow_negative_numbers = true)]
    pub prompt_interval: Option<usize>,
    /// dLLM-Cache: forwards between full recomputes of the response, K_r (default 7)
    #[arg(long, value_name = "K_R", value_parser = values::positive, allow_negative_numbers = true)]
    pub response_interval: Option<usize>,
    /// dLLM-Cache: share of the response recomputed in between, the rows whose V moved
    /// most, ρ from 0 to 1 (default 0.25)
    #[arg(long, value_name = "RHO", value_parser = values::share)]
    pub refresh_ratio: Option<f32>,
    /// dLLM-Cache: which rows V-verify recomputes: lowest-cosine (the rule) or
    /// highest-cosine (a deliberately wrong cache, for accuracy ablations)
    #[arg(long, value_name = "RULE", value_parser = values::verify_pick)]
    pub verify_pick: Option<unmask_core::adaptive::VerifyPick>,
    /// dLLM-Cache with several blocks: compute the current block's rows at every step and
    /// V-verify the rest (true, the default), or V-verify the whole response (false: the
    /// reference's rule)
    #[arg(long, value_name = "BOOL")]
    pub pin_block: Option<bool>,
    /// run every step of the canvas, as the reference does (by default a request ends as
    /// soon as its answer is final: an end token committed with every position before it;
    /// the text is the same)
    #[arg(long)]
    pub full_canvas: bool,
}

/// `--depth`, `--refresh`, `--anchor-ratio` and dLLM-Cache's settings for a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheSettings {
    pub depth: Option<usize>,
    pub refresh_every: usize,
    pub anchor_ratio: f32,
    pub adaptive: AdaptiveRefresh,
    pub full_canvas: bool,
}

impl CacheSettings {
    /// Sets the request's cache parameters.
    pub fn apply(&self, request: &mut unmask::Request) {
        request.depth = self.depth;
        request.refresh_every = self.refresh_every;
        request.anchor_ratio = self.anchor_ratio;
        request.adaptive = self.adaptive;
        request.full_canvas = self.full_canvas;
    }
}

impl CacheFlags {
    /// `--depth B`, `--refresh R` and `--anchor-ratio R`; a note on stderr when no mode in
    /// `modes` uses them.
    pub fn settings(&self, modes: &[CacheMode]) -> CacheSettings {
        if self.anchor_ratio.is_some() && !modes.contains(&CacheMode::Acache) {
            eprintln!("note: --anchor-ratio is used only by --cache acache");
        }
        let adaptive_flags = [
            self.prompt_interval.is_some(),
            self.response_interval.is_some(),
            self.refresh_ratio.is_some(),
            self.verify_pick.is_some(),
            self.pin_block.is_some(),
        ];
        if adaptive_flags.contains(&true) && !modes.iter().any(|m| m.is_adaptive()) {
            eprintln!(
                "note: --prompt-interval, --response-interval, --refresh-ratio, \
                 --verify-pick and --pin-block are used only by --cache dllm-cache and bicache-dllm"
            );
        }
        let defaults = AdaptiveRefresh::default();
        if !modes.iter().any(|c| c.is_bicache()) {
            let given: Vec<&str> = [
                ("depth", self.depth.is_some()),
                ("refresh", self.refresh.is_some()),
                ("cache-budget", self.cache_budget.is_some()),
            ]
            .into_iter()
            .filter_map(|(flag, given)| given.then_some(flag))
            .collect();
            if !given.is_empty() {
                eprintln!(
                    "note: --{} {} used only by --cache bicache and bicache-dual",
                    given.join(", --"),
                    if given.len() == 1 { "is" } else { "are" }
                );
            }
        }
        CacheSettings {
            depth: self.depth,
            refresh_every: self.refresh.unwrap_or(DEFAULT_REFRESH),
            anchor_ratio: self.anchor_ratio.unwrap_or(unmask::DEFAULT_ANCHOR_RATIO),
            adaptive: AdaptiveRefresh {
                prompt_interval: self.prompt_interval.unwrap_or(defaults.prompt_interval),
                response_interval: self.response_interval.unwrap_or(defaults.response_interval),
                refresh_ratio: self.refresh_ratio.unwrap_or(defaults.refresh_ratio),
                pick: self.verify_pick.unwrap_or(defaults.pick),
                pin_block: self.pin_block.unwrap_or(defaults.pin_block),
            },
            full_canvas: self.full_canvas,
        }
    }

    /// What the prefix store may hold: `--cache-budget`, else the engine's default.
    pub fn budget(&self) -> CacheBudget {
        self.cache_budget
            .unwrap_or(EngineOptions::default().cache_budget)
    }
}
