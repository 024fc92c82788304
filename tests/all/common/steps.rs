//! A request run one step at a time with log-probabilities asked for: what each step saw
//! and committed, and the check of each committed token's log-probability (and its most
//! likely alternatives) against a full forward over the canvas that step saw.

use unmask::{Generation, Logprob, Request, StepEvent};
use unmask_core::oracle::sampling::model_logprob;
use unmask_core::sampler::IdBias;

/// One step: the canvas it saw (the canvas after it, its commits masked again), the
/// (position, token)s it committed and what each carries.
pub struct SeenStep {
    pub before: Vec<u32>,
    pub committed: Vec<(u32, u32)>,
    pub got: Vec<Logprob>,
    /// Where the generated canvas lies in `before`.
    pub canvas: std::ops::Range<usize>,
}

/// Runs `req` step by step, recording every step.
pub fn run_recording(engine: &unmask::Engine, req: Request) -> (Generation, Vec<SeenStep>) {
    let mut run = engine.start(req).expect("starts");
    let mut seen = Vec::new();
    loop {
        let mut record = |e: &StepEvent<'_>| {
            let lps = e.logprobs.expect("log-probabilities asked for");
            let mut before = e.canvas.to_vec();
            let mut got = Vec::new();
            for &(pos, _) in &e.record.committed {
                before[pos as usize] = e.mask_id;
                got.push(lps[pos as usize - e.prompt_len].clone().expect("committed"));
            }
            let canvas = e.prompt_len..e.canvas.len() - e.suffix_len;
            let committed = e.record.committed.clone();
            seen.push(SeenStep {
                before,
                committed,
                got,
                canvas,
            });
        };
        if let Some(g) = run.step(&mut record).expect("steps") {
            return (g, seen);
        }
    }
}

/// The worst absolute error, over every committed token of `seen`, of its log-probability
/// and its alternatives' against `log_softmax` of the biased logits at its position of a
/// full forward over the canvas its step saw (`bias`: that step's biases); the
/// alternatives' ids must be the largest biased logits, highest first. Returns the error
/// and the tokens checked.
pub fn worst_logprob_error(
    engine: &unmask::Engine,
    seen: &[SeenStep],
    bias: &dyn Fn(&SeenStep) -> Vec<IdBias>,
) -> (f64, usize) {
    let vocab = engine.model().cfg.embedding_size;
    let (mut worst, mut tokens) = (0f64, 0);
    for step in seen {
        let rows: Vec<usize> = step.committed.iter().map(|&(p, _)| p as usize).collect();
        let mut logits = engine
            .model()
            .logits_at(&step.before, &rows)
            .expect("logits");
        let biases = bias(step);
        for row in logits.chunks_mut(vocab) {
            for b in &biases {
                row[b.id as usize] = b.apply(row[b.id as usize]);
            }
        }
        for ((row, &(_, token)), lp) in logits.chunks(vocab).zip(&step.committed).zip(&step.got) {
            let want = |id: u32| model_logprob(row, None, id, 0.0);
            worst = worst.max((lp.logprob as f64 - want(token)).abs());
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for (&(id, l), &v) in lp.top.iter().zip(&order) {
                assert_eq!(id as usize, v, "alternative ids");
                worst = worst.max((l as f64 - want(id)).abs());
            }
            tokens += 1;
        }
    }
    (worst, tokens)
}
