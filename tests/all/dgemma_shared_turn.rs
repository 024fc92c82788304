//! DiffusionGemma: a system turn the prefix store does not hold yet, arriving while other
//! requests denoise. It is encoded a piece per round by one of the requests that want it
//! (the others wait, encoding nothing), stored, then copied by the waiting ones, which go on
//! with their own turns and their first step in that same round; when its encoder goes
//! away, a waiting request takes over. Every generation equals its run alone.

use std::ops::ControlFlow;
use std::sync::Arc;

use unmask_core::sampler::entropy_bound::{EntropyBoundParams, SeededDraws};
use unmask_goldens::dgemma::{GenerationCase, generation_cases};
use unmask_gpu::GpuContext;
use unmask_gpu::WeightFormat;
use unmask_gpu::dgemma::{
    DgemmaModel, DgemmaPrefixStore, DgemmaRun, PrefixUse, RoundStore, SharedPrefix, StepReport,
};

use crate::common;

const PIECE: usize = 16;
/// The system turn: longer than the fixture's sliding window (8), ending mid-piece.
const SYSTEM: usize = 70;

fn system_turn() -> Vec<u32> {
    (0..SYSTEM as u32).map(|i| 2 + (i * 11) % 60).collect()
}

fn prompt(user: u32) -> Vec<u32> {
    let mut p = system_turn();
    p.extend((0..10).map(|i| 3 + (user * 13 + i * 5) % 60));
    p
}

fn quiet() -> impl FnMut(usize, StepReport<'_>) -> ControlFlow<()> {
    |_, _| ControlFlow::Continue(())
}

/// One round with `store`: the store's part, the prompt pieces, the store's part again,
/// then the step.
fn round(
    model: &DgemmaModel,
    ctx: &GpuContext,
    runs: &mut [&mut DgemmaRun<'_>],
    store: &mut DgemmaPrefixStore,
) {
    let store = Some(RoundStore::Held(store));
    pollster::block_on(model.step_runs_async(ctx, runs, store, &mut quiet())).unwrap();
}

/// `user`'s request started with the system turn through `store`.
fn start<'d>(
    model: &DgemmaModel,
    ctx: &GpuContext,
    user: u32,
    params: &EntropyBoundParams,
    store: &mut DgemmaPrefixStore,
) -> DgemmaRun<'d> {
    let prefix = SharedPrefix {
        shared: SYSTEM,
        whole_prompt: false,
        store,
    };
    let draws = Box::new(SeededDraws::new(u64::from(user)));
    model
        .start(
            ctx,
            &prompt(user),
            Some(prefix),
            params,
            draws,
            u64::from(user),
        )
        .unwrap()
}

/// `user`'s generation alone, without a store.
fn alone(
    model: &DgemmaModel,
    ctx: &GpuContext,
    user: u32,
    params: &EntropyBoundParams,
) -> Vec<u32> {
    let draws = Box::new(SeededDraws::new(u64::from(user)));
    let mut run = model
        .start(ctx, &prompt(user), None, params, draws, u64::from(user))
        .unwrap();
    while !run.is_done() {
        pollster::block_on(model.step_runs_async(ctx, &mut [&mut run], None, &mut quiet()))
            .unwrap();
    }
    run.finish().unwrap().0.sequence
}

fn finish(run: DgemmaRun<'_>) -> (Vec<u32>, Option<PrefixUse>) {
    let (g, used) = run.finish().unwrap();
    (g.sequence, used)
}

/// The fixture in passes of `PIECE` rows and its first recorded generation.
fn setup() -> (Arc<GpuContext>, DgemmaModel, GenerationCase) {
    let dir = common::fixture_dir().with_file_name("tiny-dgemma");
    let ctx = common::ctx();
    let mut model = DgemmaModel::load(&ctx, &dir, WeightFormat::F32, 256).unwrap();
    model.pass_rows = PIECE;
    let cases =
        generation_cases(&std::fs::read_to_string(dir.join("goldens/generate.json")).unwrap());
    (ctx, model, cases.into_iter().next().unwrap())
}

#[test]
fn a_new_system_turn_is_encoded_once_in_pieces_while_the_others_denoise() {
    let (ctx, model, case) = setup();
    let case = &case;
    let mut params = case.params.clone();
    params.max_new_tokens = params.max_new_tokens.min(32);
    let mut store = DgemmaPrefixStore::new(4096, 1 << 30);

    // A request denoising when the others arrive (no system turn of its own).
    let mut draws = case.draws.clone();
    let mut running = model
        .start(
            &ctx,
            &case.prompt,
            None,
            &case.params,
            Box::new(&mut draws),
            0,
        )
        .unwrap();
    while running.steps_run() < 2 {
        round(&model, &ctx, &mut [&mut running], &mut store);
    }

    // Two requests with the same new system turn: one encodes it, the other waits.
    let mut b = start(&model, &ctx, 1, &params, &mut store);
    let mut c = start(&model, &ctx, 2, &params, &mut store);
    assert_eq!(
        (b.prompt_left(), c.prompt_left()),
        (SYSTEM + 10, SYSTEM + 10),
        "nothing is encoded when a request starts"
    );
    let mut rounds = 0;
    while b.prompt_left() > 0 {
        let (before, b_left, c_left) = (running.steps_run(), b.prompt_left(), c.prompt_left());
        round(
            &model,
            &ctx,
            &mut [&mut running, &mut b, &mut c],
            &mut store,
        );
        rounds += 1;
        if SYSTEM + 10 - b.prompt_left() < SYSTEM {
            assert_eq!(b_left - b.prompt_left(), PIECE, "one piece per round");
            assert_eq!(
                c.prompt_left(),
                c_left,
                "the second request waits, encoding nothing"
            );
            assert_eq!((store.misses, store.hits, store.inserts), (1, 0, 0));
        }
        if !running.is_done() {
            assert_eq!(
                running.steps_run(),
                before + 1,
                "the running request stepped"
            );
        }
    }
    // The round of the turn's last piece (its pieces end at the turn's end: it is stored
    // only then) stored it; the waiting request copied it, and both encoded their own turns
    // and took their first step in that round.
    assert_eq!(rounds, SYSTEM.div_ceil(PIECE));
    assert_eq!((store.misses, store.hits, store.inserts), (1, 1, 1));
    assert_eq!(
        (c.prompt_left(), b.steps_run(), c.steps_run()),
        (0, 1, 1),
        "both past their turns and denoising in the round the system turn was stored"
    );
    while !running.is_done() || !b.is_done() || !c.is_done() {
        round(
            &model,
            &ctx,
            &mut [&mut running, &mut b, &mut c],
            &mut store,
        );
    }
    crate::dgemma_generate::assert_replays(case, &running.finish().unwrap().0);
    let (b_seq, b_used) = finish(b);
    let (c_seq, c_used) = finish(c);
    assert_eq!(b_used, Some(PrefixUse::Stored { tokens: SYSTEM }));
    assert_eq!(c_used, Some(PrefixUse::Hit { reused: SYSTEM }));
    assert_eq!(
        b_seq,
        alone(&model, &ctx, 1, &params),
        "the encoder's generation"
    );
    assert_eq!(
        c_seq,
        alone(&model, &ctx, 2, &params),
        "the waiting one's generation"
    );
    eprintln!(
        "[check] DiffusionGemma: a {SYSTEM}-token system turn encoded once in {rounds} pieces while a request denoised, stored, copied by the request that waited; generations equal their runs alone"
    );
}

#[test]
fn a_waiting_request_encodes_the_system_turn_when_its_encoder_goes_away() {
    let (ctx, model, case) = setup();
    let mut params = case.params.clone();
    params.max_new_tokens = params.max_new_tokens.min(16);
    let mut store = DgemmaPrefixStore::new(4096, 1 << 30);
    let mut b = start(&model, &ctx, 3, &params, &mut store);
    let mut c = start(&model, &ctx, 4, &params, &mut store);
    for _ in 0..2 {
        round(&model, &ctx, &mut [&mut b, &mut c], &mut store);
    }
    assert_eq!(b.prompt_left(), SYSTEM + 10 - 2 * PIECE);
    assert_eq!(c.prompt_left(), SYSTEM + 10, "waiting");
    // The encoder's client is gone: the server drops its run.
    drop(b);
    round(&model, &ctx, &mut [&mut c], &mut store);
    assert_eq!(
        c.prompt_left(),
        SYSTEM + 10 - PIECE,
        "it encodes now, from the start"
    );
    assert_eq!(store.misses, 2, "a miss each time an encoder was chosen");
    while !c.is_done() {
        round(&model, &ctx, &mut [&mut c], &mut store);
    }
    let (c_seq, c_used) = finish(c);
    assert_eq!(c_used, Some(PrefixUse::Stored { tokens: SYSTEM }));
    assert_eq!(c_seq, alone(&model, &ctx, 4, &params));
    // A later request copies it at once.
    let d = start(&model, &ctx, 5, &params, &mut store);
    assert_eq!(
        d.prompt_left(),
        10,
        "the stored system turn copied when it starts"
    );
    assert_eq!(store.hits, 1);
    // A store that cannot hold the turn even alone: no waiting, the whole prompt encoded.
    let mut small = DgemmaPrefixStore::new(SYSTEM - 1, 1 << 30);
    let mut e = start(&model, &ctx, 6, &params, &mut small);
    let mut f = start(&model, &ctx, 7, &params, &mut small);
    round(&model, &ctx, &mut [&mut e, &mut f], &mut small);
    assert_eq!(
        (e.prompt_left(), f.prompt_left()),
        (SYSTEM + 10 - PIECE, SYSTEM + 10 - PIECE)
    );
    assert_eq!((small.misses, small.rejected), (2, 2));
}

/// Two new system turns whose last pieces run in the same round, with a store that holds one:
/// each turn's waiting request copies it as soon as it is stored, before the other turn's
/// entry evicts it (so neither encodes its turn again).
#[test]
fn two_new_system_turns_stored_in_one_round_each_serve_their_waiting_request() {
    let (ctx, model, case) = setup();
    let mut params = case.params.clone();
    params.max_new_tokens = params.max_new_tokens.min(16);
    let with_system = |first: u32, user: u32| {
        let mut p: Vec<u32> = (0..SYSTEM as u32)
            .map(|i| 2 + (first + i * 11) % 60)
            .collect();
        p.extend((0..10).map(|i| 3 + (user * 13 + i * 5) % 60));
        p
    };
    let mut store = DgemmaPrefixStore::new(SYSTEM, 1 << 30);
    let start = |prompt: Vec<u32>, seed: u64, store: &mut DgemmaPrefixStore| {
        let prefix = SharedPrefix {
            shared: SYSTEM,
            whole_prompt: false,
            store,
        };
        let draws = Box::new(SeededDraws::new(seed));
        model
            .start(&ctx, &prompt, Some(prefix), &params, draws, seed)
            .unwrap()
    };
    let mut runs = [
        start(with_system(0, 1), 1, &mut store),
        start(with_system(0, 2), 2, &mut store),
        start(with_system(1, 3), 3, &mut store),
        start(with_system(1, 4), 4, &mut store),
    ];
    let mut rounds = 0;
    // The first of each pair encodes its turn; the second waits.
    while (runs[0].prompt_left() > 0 || runs[2].prompt_left() > 0) && rounds < 20 {
        let mut refs: Vec<_> = runs.iter_mut().collect();
        round(&model, &ctx, &mut refs, &mut store);
        rounds += 1;
        if runs[0].prompt_left() > 10 {
            assert_eq!(
                (runs[1].prompt_left(), runs[3].prompt_left()),
                (SYSTEM + 10, SYSTEM + 10),
                "waiting"
            );
        }
    }
    assert_eq!(
        rounds,
        SYSTEM.div_ceil(PIECE),
        "both turns encoded side by side"
    );
    let left: Vec<usize> = runs.iter().map(|r| r.prompt_left()).collect();
    assert_eq!(left, [0, 0, 0, 0], "every request past its own turn");
    assert_eq!(
        (store.misses, store.inserts, store.hits, store.evictions),
        (2, 2, 2, 1),
        "two turns encoded once each, both copied, one evicted by the other"
    );
}

/// A run started with a store that does not hold its system turn, stepped without the
/// store: it encodes the turn as its own prompt instead of waiting for ever.
#[test]
fn a_run_stepped_without_its_store_encodes_its_system_turn_itself() {
    let (ctx, model, case) = setup();
    let mut params = case.params.clone();
    params.max_new_tokens = params.max_new_tokens.min(16);
    let mut store = DgemmaPrefixStore::new(4096, 1 << 30);
    let mut run = start(&model, &ctx, 10, &params, &mut store);
    let mut rounds = 0;
    while !run.is_done() && rounds < 100 {
        let quiet = &mut quiet();
        pollster::block_on(model.step_runs_async(&ctx, &mut [&mut run], None, quiet)).unwrap();
        rounds += 1;
    }
    assert!(run.is_done(), "not done after {rounds} rounds");
    let (seq, used) = finish(run);
    assert_eq!(used, Some(PrefixUse::Uncached));
    assert_eq!(seq, alone(&model, &ctx, 10, &params));
    assert_eq!(store.inserts, 0, "nothing stored");
}

/// A whole prompt kept for the choices of one request goes first when the store needs room,
/// before an older system turn that other requests share.
#[test]
fn a_whole_prompt_entry_is_evicted_before_a_system_turn() {
    let (ctx, model, case) = setup();
    let mut params = case.params.clone();
    params.max_new_tokens = params.max_new_tokens.min(16);
    let whole = prompt(1).len();
    // Room for the system turn and the whole prompt, not for one more system turn.
    let mut store = DgemmaPrefixStore::new(SYSTEM + whole + SYSTEM - 1, 1 << 30);
    let start = |prompt: Vec<u32>, whole_prompt: bool, store: &mut DgemmaPrefixStore| {
        let prefix = SharedPrefix {
            shared: SYSTEM,
            whole_prompt,
            store,
        };
        let draws = Box::new(SeededDraws::new(1));
        model
            .start(&ctx, &prompt, Some(prefix), &params, draws, 1)
            .unwrap()
    };
    // Two choices of one prompt: its system turn and the whole prompt are stored.
    let mut choices = [
        start(prompt(1), true, &mut store),
        start(prompt(1), true, &mut store),
    ];
    let mut rounds = 0;
    while choices.iter().any(|r| r.prompt_left() > 0) && rounds < 40 {
        let mut refs: Vec<_> = choices.iter_mut().collect();
        round(&model, &ctx, &mut refs, &mut store);
        rounds += 1;
    }
    assert_eq!((store.inserts, store.tokens()), (2, SYSTEM + whole));
    // Another system turn: the store makes room by evicting the whole prompt, newer as it is.
    let other: Vec<u32> = (0..SYSTEM as u32 + 10).map(|i| 3 + (i * 7) % 60).collect();
    let mut run = start(other, false, &mut store);
    while run.prompt_left() > 0 && rounds < 80 {
        round(&model, &ctx, &mut [&mut run], &mut store);
        rounds += 1;
    }
    assert_eq!((store.inserts, store.evictions), (3, 1));
    assert_eq!(store.tokens(), 2 * SYSTEM, "both system turns kept");
    // The first system turn is still there: a request after it encodes its own turn only.
    let again = start(prompt(2), false, &mut store);
    assert_eq!(again.prompt_left(), prompt(2).len() - SYSTEM);
}
