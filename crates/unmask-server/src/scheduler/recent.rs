//! Answer tokens of the requests finished in the last 10 s: the `tokens_per_second` gauge of
//! both engine loops.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

const WINDOW: Duration = Duration::from_secs(10);

/// (when, answer tokens) of recent finishes.
#[derive(Default)]
pub(super) struct RecentTokens(VecDeque<(Instant, usize)>);

impl RecentTokens {
    pub(super) fn push(&mut self, tokens: usize) {
        self.0.push_back((Instant::now(), tokens));
    }

    /// Tokens per second over the window, the finishes older than it dropped.
    pub(super) fn per_second(&mut self) -> f64 {
        let now = Instant::now();
        while self.0.front().is_some_and(|(t, _)| now - *t > WINDOW) {
            self.0.pop_front();
        }
        let tokens: usize = self.0.iter().map(|(_, n)| n).sum();
        tokens as f64 / WINDOW.as_secs_f64()
    }
}
