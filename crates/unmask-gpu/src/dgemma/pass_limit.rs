//! How many canvases one decoder pass may take. A batched step that does not fit the GPU's
//! memory (an allocation refused by the budget or the driver) is split in halves until its
//! parts fit; the largest part that ran becomes the limit, so the next steps do not try
//! (and fail) the whole batch again. Memory comes back as requests end and the prefix store
//! evicts, so after `PROBE_AFTER` steps without a failure the limit doubles again.

use crate::error::GpuError;
use crate::model::ModelError;

/// Steps without a failed allocation before the limit is raised again.
pub const PROBE_AFTER: usize = 32;

#[derive(Debug, Default)]
pub(super) struct PassLimit {
    /// Most canvases in one pass (`None`: no limit).
    canvases: Option<usize>,
    /// Steps run under the limit without a failed allocation.
    clean_steps: usize,
}

impl PassLimit {
    pub(super) fn get(&self) -> Option<usize> {
        self.canvases
    }

    /// `live` (the runs of a step, in order) cut into passes of at most the limit.
    pub(super) fn passes(&self, live: &[usize]) -> Vec<Vec<usize>> {
        let size = self.canvases.unwrap_or(usize::MAX).max(1);
        live.chunks(size).map(<[usize]>::to_vec).collect()
    }

    /// After a step: `widest` canvases ran in its largest pass, `split` when a pass had to be
    /// split for memory. A step in which nothing fit (runs that fail alone) says nothing of
    /// batches; a step of passes smaller than the limit does not test it.
    pub(super) fn after_step(&mut self, widest: usize, split: bool) {
        if split {
            if widest > 0 {
                self.canvases = Some(widest);
                self.clean_steps = 0;
            }
            return;
        }
        let Some(limit) = self.canvases.filter(|&l| widest >= l) else {
            return;
        };
        self.clean_steps += 1;
        if self.clean_steps >= PROBE_AFTER {
            self.clean_steps = 0;
            self.canvases = Some(limit.saturating_mul(2));
        }
    }
}

/// Whether `e` says a pass did not fit in memory (so a smaller one may): the budget refused
/// an allocation, the driver ran out, or one binding would be over the device's limit.
pub(super) fn is_capacity(e: &ModelError) -> bool {
    matches!(
        e,
        ModelError::Gpu(
            GpuError::OverBudget { .. } | GpuError::OutOfMemory { .. } | GpuError::TooLarge { .. }
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_sets_the_limit_and_clean_steps_raise_it() {
        let mut limit = PassLimit::default();
        assert_eq!(limit.passes(&[0, 1, 2, 3, 4]), vec![vec![0, 1, 2, 3, 4]]);
        limit.after_step(5, false);
        assert_eq!(limit.get(), None, "no limit until a pass fails");
        limit.after_step(2, true);
        assert_eq!(limit.get(), Some(2));
        assert_eq!(
            limit.passes(&[0, 1, 2, 3, 4]),
            vec![vec![0, 1], vec![2, 3], vec![4]]
        );
        for _ in 0..PROBE_AFTER - 1 {
            limit.after_step(2, false);
        }
        assert_eq!(
            limit.get(),
            Some(2),
            "raised only after PROBE_AFTER clean steps"
        );
        limit.after_step(2, false);
        assert_eq!(limit.get(), Some(4));
        limit.after_step(1, true);
        assert_eq!(limit.get(), Some(1));
        assert_eq!(limit.passes(&[3, 7]), vec![vec![3], vec![7]]);
        // Runs that fit nowhere fail alone: the limit stays.
        limit.after_step(0, true);
        assert_eq!(limit.get(), Some(1));
    }

    #[test]
    fn only_steps_at_the_limit_count_towards_raising_it() {
        let mut limit = PassLimit::default();
        limit.after_step(4, true);
        for _ in 0..PROBE_AFTER {
            limit.after_step(2, false);
        }
        assert_eq!(limit.get(), Some(4), "passes of 2 never tested 4");
        for _ in 0..PROBE_AFTER {
            limit.after_step(4, false);
        }
        assert_eq!(limit.get(), Some(8));
    }

    #[test]
    fn only_memory_errors_are_worth_a_smaller_pass() {
        let over = ModelError::Gpu(GpuError::OverBudget {
            what: "dgemma logits".into(),
            needed: 10,
            live: 5,
            budget: 12,
        });
        assert!(is_capacity(&over));
        assert!(!is_capacity(&ModelError::Gpu(GpuError::DeviceLost(
            "gone".into()
        ))));
        assert!(!is_capacity(&ModelError::Input("bad".into())));
    }
}
