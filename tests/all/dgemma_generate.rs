//! DiffusionGemma's generations on the fixture: the recorded ones replayed step for step,
//! alone and denoised together, and the engine's requests through the prefix store.

use std::path::PathBuf;

use unmask_gpu::dgemma::DgemmaModel;
use unmask_gpu::{DType, WeightFormat};

use crate::common;

/// Asserts that `got` replays `case` step for step, each output token with a log-probability;
/// returns its canvases that stopped early.
pub(crate) fn assert_replays(
    case: &unmask_goldens::dgemma::GenerationCase,
    got: &unmask_gpu::dgemma::Generation,
) -> usize {
    for (i, c) in got.canvases.iter().enumerate() {
        assert_eq!(
            c.logprobs.len(),
            c.output.len(),
            "{}: canvas {i}",
            case.name
        );
        assert!(
            c.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0),
            "{}: canvas {i}: {:?}",
            case.name,
            c.logprobs
        );
    }
    let canvases: Vec<unmask_goldens::dgemma::RunCanvas<'_>> = got
        .canvases
        .iter()
        .map(|c| unmask_goldens::dgemma::RunCanvas {
            steps: &c.steps,
            output: &c.output,
        })
        .collect();
    case.assert_run(&canvases, &got.sequence)
}

fn fixture() -> PathBuf {
    common::fixture_dir().with_file_name("tiny-dgemma")
}

/// Every generation of the fixture with the reference's draws replayed: each step's
/// temperature, accepted positions, argmax canvas and stopping decision, each canvas's output
/// and the whole sequence equal the reference's.
#[test]
fn generations_replay_the_reference_step_by_step() {
    use unmask_goldens::dgemma::generation_cases;
    let dir = fixture();
    let ctx = common::ctx();
    let mut model = DgemmaModel::load(&ctx, &dir, WeightFormat::F32, 256).unwrap();
    let cases =
        generation_cases(&std::fs::read_to_string(dir.join("goldens/generate.json")).unwrap());
    assert_eq!(cases.len(), 7);
    let mut early_stops = 0;
    // Caches whose sliding layers never move (256 rows), then ones that keep W - 1 + 16 rows
    // (23 for the fixture's window of 8) and move them at every other commit.
    let runs = cases
        .iter()
        .map(|c| (16, c))
        .chain(cases.iter().map(|c| (512, c)));
    for (pass_rows, case) in runs.rev() {
        model.pass_rows = pass_rows;
        let mut draws = case.draws.clone();
        let got = model
            .generate(&ctx, &case.prompt, &case.params, &mut draws, 0)
            .unwrap();
        early_stops += assert_replays(case, &got);
        eprintln!(
            "[check] DiffusionGemma generation {} (passes of {pass_rows}): {} canvases, {} steps, sequence of {} equal to the reference's",
            case.name,
            got.canvases.len(),
            got.canvases.iter().map(|c| c.steps.len()).sum::<usize>(),
            got.sequence.len()
        );
    }
    assert!(early_stops > 0, "some canvas stopped early");
}

/// The 7 recorded generations denoised together, one decoder pass per step for all the
/// canvases still running (`step_runs_async`: rows of every request through each matmul and
/// the experts, attention per canvas over its own cache, each its own temperature and
/// draws): each replays the reference step for step as it does alone, while the others
/// join, stop early, commit canvases and finish around it.
#[test]
fn generations_denoised_together_replay_the_reference() {
    use unmask_goldens::dgemma::generation_cases;
    let dir = fixture();
    let ctx = common::ctx();
    let model = DgemmaModel::load(&ctx, &dir, WeightFormat::F32, 256).unwrap();
    let cases =
        generation_cases(&std::fs::read_to_string(dir.join("goldens/generate.json")).unwrap());
    let mut draws: Vec<_> = cases.iter().map(|c| c.draws.clone()).collect();
    let mut runs = start_runs(&model, &ctx, &cases, &mut draws);
    let (mut widest, mut passes) = (0, 0);
    while runs.iter().any(|r| !r.is_done()) {
        widest = widest.max(step_all(&model, &ctx, &mut runs));
        passes += 1;
    }
    let steps: usize = runs.iter().map(|r| r.steps_run()).sum();
    for (case, run) in cases.iter().zip(runs) {
        let (got, _) = run.finish().unwrap();
        assert_replays(case, &got);
    }
    assert_eq!(widest, cases.len(), "a pass denoises every canvas");
    assert!(passes < steps, "{passes} passes for {steps} steps");
    eprintln!(
        "[check] DiffusionGemma: 7 generations together, {steps} steps in {passes} rounds (the first encodes their prompts), each equal to the reference's"
    );
}

/// The runs of `cases` started on `model`, each replaying its case's draws.
fn start_runs<'d>(
    model: &DgemmaModel,
    ctx: &unmask_gpu::GpuContext,
    cases: &[unmask_goldens::dgemma::GenerationCase],
    draws: &'d mut [unmask_core::sampler::entropy_bound::ReplayedDraws],
) -> Vec<unmask_gpu::dgemma::DgemmaRun<'d>> {
    cases
        .iter()
        .zip(draws.iter_mut())
        .map(|(c, d)| {
            model
                .start(ctx, &c.prompt, None, &c.params, Box::new(d), 0)
                .unwrap()
        })
        .collect()
}

/// One round (`step_runs_async`) of `runs`; returns the widest pass that denoised any of them.
fn step_all(
    model: &DgemmaModel,
    ctx: &unmask_gpu::GpuContext,
    runs: &mut [unmask_gpu::dgemma::DgemmaRun<'_>],
) -> usize {
    let mut widest = 0;
    let mut refs: Vec<_> = runs.iter_mut().collect();
    pollster::block_on(model.step_runs_async(ctx, &mut refs, None, &mut |_, r| {
        widest = widest.max(r.pass_canvases);
        std::ops::ControlFlow::Continue(())
    }))
    .unwrap();
    widest
}

/// Four recorded generations stepped together under a GPU memory budget that fits one
/// canvas's decoder pass but not two: every step's batch is split until its parts fit (one
/// canvas each), the limit is remembered, and each generation still replays the reference
/// step for step. Under a budget that fits no pass at all, each run fails alone with the
/// budget's error naming what it was for.
#[test]
fn a_batch_over_the_memory_budget_runs_in_passes_that_fit() {
    use unmask_goldens::dgemma::generation_cases;
    use unmask_gpu::{ContextOptions, GpuContext};
    let dir = fixture();
    let cases =
        generation_cases(&std::fs::read_to_string(dir.join("goldens/generate.json")).unwrap());
    let cases = &cases[..4];
    // The fixture on a context with `budget`, in passes of 16 rows (a prompt's pieces then
    // need less memory than a decoder step).
    let setup = |budget: Option<u64>| {
        let ctx = GpuContext::new(&ContextOptions {
            memory_budget: budget,
            ..common::options()
        })
        .unwrap();
        let mut model = DgemmaModel::load(&ctx, &dir, WeightFormat::F32, 256).unwrap();
        model.pass_rows = 16;
        (ctx, model)
    };
    let fresh_draws = || cases.iter().map(|c| c.draws.clone()).collect::<Vec<_>>();
    // What one canvas's decoder step needs beyond the runs' own memory, measured without
    // a budget on a fresh context: its prompt's pieces, a first and a self-conditioned step.
    let (runs_bytes, start_bytes, solo_bytes) = {
        let (ctx, model) = setup(None);
        let mut draws = fresh_draws();
        let mut runs = start_runs(&model, &ctx, cases, &mut draws);
        let live = ctx.memory.live_bytes();
        let start_bytes = ctx.memory.peak_bytes() - live;
        ctx.memory.reset_peak();
        while runs[0].steps_run() < 2 {
            step_all(&model, &ctx, &mut runs[..1]);
        }
        (live, start_bytes, ctx.memory.peak_bytes() - live)
    };
    // Starting a run (its cache; its prompt is encoded by the steps) needs less than a step.
    assert!(start_bytes < solo_bytes, "{start_bytes} vs {solo_bytes}");
    let (ctx, model) = setup(Some(runs_bytes + solo_bytes + solo_bytes / 4));
    let mut draws = fresh_draws();
    let mut runs = start_runs(&model, &ctx, cases, &mut draws);
    assert_eq!(
        ctx.memory.live_bytes(),
        runs_bytes,
        "the same runs, the same memory"
    );
    let (mut widest, mut rounds) = (0, 0);
    while runs.iter().any(|r| !r.is_done()) {
        widest = widest.max(step_all(&model, &ctx, &mut runs));
        rounds += 1;
    }
    assert_eq!(widest, 1, "no pass of two canvases fits the budget");
    // Remembered: 1, or 2 when the last step was the probe after PROBE_AFTER clean ones.
    let limit = model.pass_limit();
    assert!(
        limit.is_some_and(|l| l <= 2),
        "the limit is remembered: {limit:?}"
    );
    for (case, run) in cases.iter().zip(runs) {
        let (got, _) = run.finish().unwrap();
        assert_replays(case, &got);
    }
    // A budget no decoder pass fits: each run fails alone, nothing panics.
    let (ctx, model) = setup(Some(runs_bytes + (start_bytes + solo_bytes) / 2));
    let mut draws = fresh_draws();
    let mut runs = start_runs(&model, &ctx, cases, &mut draws);
    // Their prompts' pieces, then the first steps, which fail.
    for _ in 0..8 {
        step_all(&model, &ctx, &mut runs);
    }
    for run in runs {
        assert!(run.is_done());
        assert_eq!(run.steps_run(), 0);
        let e = run.finish().unwrap_err().to_string();
        assert!(e.contains("of the budget's"), "{e}");
    }
    eprintln!(
        "[check] DiffusionGemma under a budget of one canvas's step ({solo_bytes} bytes over the runs' {runs_bytes}): 4 generations in {rounds} rounds of one-canvas passes, each equal to the reference's; under less, each run fails alone"
    );
}

/// A request whose long prompt arrives while another denoises: its prompt is encoded a
/// piece per round (16 rows here) and the running request takes a denoising step in every
/// one of those rounds instead of waiting for the whole prompt; the late request takes its
/// first step in the round of its last piece, its generation equals its run alone, and the
/// running one still replays the reference.
#[test]
fn a_long_prompt_is_encoded_between_the_running_requests_steps() {
    use unmask_core::sampler::entropy_bound::SeededDraws;
    use unmask_goldens::dgemma::generation_cases;
    let dir = fixture();
    let ctx = common::ctx();
    let mut model = DgemmaModel::load(&ctx, &dir, WeightFormat::F32, 256).unwrap();
    model.pass_rows = 16;
    let cases =
        generation_cases(&std::fs::read_to_string(dir.join("goldens/generate.json")).unwrap());
    let case = &cases[0];
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
    // One round of `runs`, without a store.
    let round = |runs: &mut [&mut unmask_gpu::dgemma::DgemmaRun<'_>]| {
        let quiet = &mut |_: usize, _: unmask_gpu::dgemma::StepReport<'_>| {
            std::ops::ControlFlow::Continue(())
        };
        pollster::block_on(model.step_runs_async(&ctx, runs, None, quiet)).unwrap();
    };
    // The running request is past its own prompt and denoising.
    while running.steps_run() < 2 {
        round(&mut [&mut running]);
    }
    let long: Vec<u32> = (0..100).map(|i| 2 + (i * 7) % 60).collect();
    let mut params = case.params.clone();
    params.max_new_tokens = params.max_new_tokens.min(32);
    let start = |model: &DgemmaModel| {
        model
            .start(&ctx, &long, None, &params, Box::new(SeededDraws::new(5)), 5)
            .unwrap()
    };
    let mut late = start(&model);
    assert_eq!(late.prompt_left(), long.len());
    let mut rounds = 0;
    while late.prompt_left() > 0 {
        let before = running.steps_run();
        let left = late.prompt_left();
        round(&mut [&mut running, &mut late]);
        assert_eq!(
            left - late.prompt_left(),
            left.min(16),
            "one piece per round"
        );
        if !running.is_done() {
            assert_eq!(
                running.steps_run(),
                before + 1,
                "the running request stepped"
            );
        }
        rounds += 1;
    }
    assert_eq!(rounds, long.len().div_ceil(16));
    assert_eq!(
        late.steps_run(),
        1,
        "its first step in the round of its last piece"
    );
    while !running.is_done() || !late.is_done() {
        round(&mut [&mut running, &mut late]);
    }
    assert_replays(case, &running.finish().unwrap().0);
    let (together, _) = late.finish().unwrap();
    let mut alone = start(&model);
    while !alone.is_done() {
        round(&mut [&mut alone]);
    }
    assert_eq!(together.sequence, alone.finish().unwrap().0.sequence);
    eprintln!(
        "[check] DiffusionGemma: a {}-token prompt encoded in {rounds} pieces, the running request stepping in each; its generation equals its run alone",
        long.len()
    );
}

/// The engine: a chat request gives what the model's own loop gives for the same ids and
/// seed; a second request with the same system turn takes it from the prefix store and
/// answers the same; requests it cannot run are refused with the field named.
#[test]
fn the_engine_generates_through_the_prefix_store() {
    use unmask::{DgemmaEngine, DgemmaRequest, EngineOptions, Message, Prompt};
    use unmask_core::sampler::entropy_bound::SeededDraws;
    use unmask_gpu::dgemma::PrefixUse;
    let options = EngineOptions {
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    let engine = DgemmaEngine::load(fixture(), &options).unwrap();
    let chat = |user: &str| {
        Prompt::Chat(vec![
            Message::system("You answer in one word."),
            Message::user(user),
        ])
    };
    let request = |user: &str| DgemmaRequest {
        seed: 7,
        max_new_tokens: Some(32),
        ..DgemmaRequest::new(chat(user))
    };
    let first = engine.generate(&request("Name a colour.")).unwrap();
    assert!(
        matches!(first.prefix, Some(PrefixUse::Stored { tokens }) if tokens > 0 && tokens < first.prompt_ids.len()),
        "the system turn is stored: {:?}",
        first.prefix
    );
    let mut params = engine.params().clone();
    params.max_new_tokens = 32;
    let direct = engine
        .model()
        .generate(
            engine.ctx(),
            &first.prompt_ids,
            &params,
            &mut SeededDraws::new(7),
            7,
        )
        .unwrap();
    assert_eq!(
        first.ids,
        direct.sequence[first.prompt_ids.len()..],
        "engine vs model loop"
    );
    let again = engine.generate(&request("Name a colour.")).unwrap();
    assert!(
        matches!(again.prefix, Some(PrefixUse::Hit { .. })),
        "{:?}",
        again.prefix
    );
    assert_eq!(again.ids, first.ids, "a stored system turn changes nothing");
    let other = engine.generate(&request("Name an animal.")).unwrap();
    assert!(matches!(other.prefix, Some(PrefixUse::Hit { .. })));
    let s = engine.prefix_stats();
    assert_eq!((s.entries, s.hits, s.misses, s.inserts), (1, 2, 1, 1));
    let too_long = DgemmaRequest {
        max_new_tokens: Some(100_000),
        ..request("Name a colour.")
    };
    let e = engine.generate(&too_long).unwrap_err().to_string();
    assert!(e.contains("exceed the model's"), "{e}");
    let bad_id = DgemmaRequest::new(Prompt::Ids(vec![1, 1 << 30]));
    let e = engine.generate(&bad_id).unwrap_err().to_string();
    assert!(e.contains("vocabulary size"), "{e}");
    // A caller stopping after 3 steps (a client gone): the error says where, and the store
    // is back in its slot for the next request.
    let mut seen = 0;
    let mut stop_at_3 = |_: unmask::DgemmaStep<'_>| {
        seen += 1;
        if seen == 3 {
            std::ops::ControlFlow::Break(())
        } else {
            std::ops::ControlFlow::Continue(())
        }
    };
    let stopped =
        pollster::block_on(engine.generate_async(&request("Name a colour."), &mut stop_at_3));
    assert!(
        matches!(
            stopped,
            Err(unmask::EngineError::Model(unmask::ModelError::Cancelled {
                steps: 3
            }))
        ),
        "{stopped:?}"
    );
    assert_eq!(engine.prefix_stats().entries, 1);
    assert_eq!(
        engine.generate(&request("Name a colour.")).unwrap().ids,
        first.ids
    );
    eprintln!(
        "[check] DiffusionGemma engine: {} prompt ids ({:?}), answer of {} ids equal with and without the stored system turn",
        first.prompt_ids.len(),
        first.prefix,
        first.ids.len()
    );
}

/// The choices of one request (`share_prompt`, OpenAI's `n`): started together, one run
/// encodes the whole prompt and stores it, the others copy its K/V (nothing of the prompt
/// encoded twice), and each answers as the same seed's request does alone. On an engine
/// that holds the system turn already, the encoder starts from it; a later choice of the
/// same prompt copies all of it at its start.
#[test]
fn choices_encode_their_shared_prompt_once() {
    use unmask::{DgemmaEngine, DgemmaRequest, EngineOptions, Message, Prompt};
    use unmask_gpu::dgemma::PrefixUse;
    let options = EngineOptions {
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    let request = |seed: u64, share_prompt: bool| DgemmaRequest {
        seed,
        max_new_tokens: Some(32),
        share_prompt,
        ..DgemmaRequest::new(Prompt::Chat(vec![
            Message::system("You answer in one word."),
            Message::user("Name a colour, then an animal, then a city."),
        ]))
    };
    let seeds = [7, 8];
    // Each seed alone, the system turn through the store as usual.
    let engine = DgemmaEngine::load(fixture(), &options).unwrap();
    let alone: Vec<Vec<u32>> = seeds
        .iter()
        .map(|&s| engine.generate(&request(s, false)).unwrap().ids)
        .collect();
    let together = |engine: &DgemmaEngine| {
        let mut tasks: Vec<_> = seeds
            .iter()
            .map(|&s| engine.start(&request(s, true)).unwrap())
            .collect();
        let mut rounds = 0;
        while tasks.iter().any(|t| !t.is_done()) {
            let mut live: Vec<_> = tasks.iter_mut().filter(|t| !t.is_done()).collect();
            engine.step(&mut live).unwrap();
            rounds += 1;
            assert!(rounds < 1000, "the choices never ended");
        }
        tasks
            .into_iter()
            .map(|t| engine.finish(t).unwrap())
            .collect::<Vec<_>>()
    };
    // A fresh engine: the first choice encodes the whole prompt, the others wait and copy.
    let fresh = DgemmaEngine::load(fixture(), &options).unwrap();
    let outs = together(&fresh);
    let whole = outs[0].prompt_ids.len();
    let uses: Vec<_> = outs.iter().map(|o| o.prefix).collect();
    assert_eq!(
        uses,
        [
            Some(PrefixUse::Stored { tokens: whole }),
            Some(PrefixUse::Hit { reused: whole })
        ]
    );
    // The system turn was stored on its own first (for other requests), then the whole
    // prompt; the waiting choice copied each.
    let s = fresh.prefix_stats();
    assert_eq!((s.entries, s.hits, s.misses, s.inserts), (2, 2, 2, 2));
    for (out, ids) in outs.iter().zip(&alone) {
        assert_eq!(&out.ids, ids, "a choice answers as its seed alone");
    }
    // The first engine holds the system turn: the encoder copies it and encodes the rest.
    let before = engine.prefix_stats();
    let outs = together(&engine);
    assert_eq!(outs[0].prefix, Some(PrefixUse::Stored { tokens: whole }));
    assert_eq!(outs[1].prefix, Some(PrefixUse::Hit { reused: whole }));
    let after = engine.prefix_stats();
    assert_eq!((after.entries, after.inserts), (2, before.inserts + 1));
    // Each choice copies the system turn at its start; the waiting one then copies the
    // whole prompt once the encoder has stored it.
    assert_eq!(after.hits, before.hits + 2 + 1);
    for (out, ids) in outs.iter().zip(&alone) {
        assert_eq!(&out.ids, ids, "after a stored system turn too");
    }
    let later = engine.generate(&request(7, true)).unwrap();
    assert_eq!(later.prefix, Some(PrefixUse::Hit { reused: whole }));
    assert_eq!(later.ids, alone[0]);
    // Another user turn after the same system turn finds that turn stored by the choices.
    let other = DgemmaRequest {
        prompt: Prompt::Chat(vec![
            Message::system("You answer in one word."),
            Message::user("Name a tree."),
        ]),
        ..request(7, false)
    };
    let other = fresh.generate(&other).unwrap();
    assert!(
        matches!(other.prefix, Some(PrefixUse::Hit { reused }) if reused < whole),
        "{:?}",
        other.prefix
    );
    eprintln!(
        "[check] DiffusionGemma choices: a {whole}-token prompt encoded once for 2 choices ({uses:?}), each answer equal to its seed alone"
    );
}

/// `--kv f16` through the engine: the caches and the stored system turn are f16, and a
/// request served from the store answers as the one that stored it.
#[test]
fn an_f16_engine_reuses_a_stored_system_turn_exactly() {
    use unmask::{DgemmaEngine, DgemmaRequest, EngineOptions, Message, Prompt};
    use unmask_gpu::dgemma::PrefixUse;
    let options = EngineOptions {
        weight_format: WeightFormat::F32,
        kv_dtype: DType::F16,
        ..EngineOptions::default()
    };
    let engine = DgemmaEngine::load(fixture(), &options).unwrap();
    assert_eq!(engine.model().kv_dtype, DType::F16);
    let request = DgemmaRequest {
        seed: 3,
        max_new_tokens: Some(32),
        ..DgemmaRequest::new(Prompt::Chat(vec![
            Message::system("You answer in one word."),
            Message::user("Name a colour."),
        ]))
    };
    let first = engine.generate(&request).unwrap();
    assert!(matches!(first.prefix, Some(PrefixUse::Stored { .. })));
    let again = engine.generate(&request).unwrap();
    assert!(matches!(again.prefix, Some(PrefixUse::Hit { .. })));
    assert_eq!(again.ids, first.ids);
    let odd = EngineOptions {
        kv_dtype: DType::U32,
        ..options
    };
    let e = DgemmaEngine::load(fixture(), &odd)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("K/V storage"), "{e}");
}

/// `logit_bias` on DiffusionGemma: added to every canvas row's logits before the sampler,
/// so +100 on one id makes every answer token that id (its draws, argmax and the
/// log-probability of the biased softmax), -100 keeps an id out, an empty list changes
/// nothing, and in a batched step each canvas takes only its own request's biases.
#[test]
fn logit_bias_steers_every_canvas_row_of_its_own_request() {
    use unmask::{DgemmaEngine, DgemmaRequest, EngineOptions, Prompt};
    let options = EngineOptions {
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    let engine = DgemmaEngine::load(fixture(), &options).unwrap();
    let request = |bias: Vec<(u32, f32)>| DgemmaRequest {
        seed: 3,
        max_new_tokens: Some(32),
        max_denoising_steps: Some(6),
        logit_bias: bias,
        ..DgemmaRequest::new(Prompt::Ids(vec![2, 105, 90, 77, 40, 41]))
    };
    let plain = engine.generate(&request(Vec::new())).unwrap();
    let eos = &engine.params().eos;
    let forced = (60u32..)
        .find(|t| !eos.contains(t) && !plain.ids.contains(t))
        .unwrap();
    let out = engine.generate(&request(vec![(forced, 100.0)])).unwrap();
    assert!(out.ids.iter().all(|&t| t == forced), "{:?}", out.ids);
    assert!(
        out.logprobs().iter().all(|&l| l > -1e-3),
        "{:?}",
        out.logprobs()
    );
    // The answer's most frequent word (not an eos or the pad after it).
    let pad = engine.params().pad;
    let words: Vec<u32> = plain
        .ids
        .iter()
        .copied()
        .filter(|t| !eos.contains(t) && Some(*t) != pad)
        .collect();
    let counts = |t: &u32| words.iter().filter(|&u| u == t).count();
    let common = *words.iter().max_by_key(|t| counts(t)).unwrap();
    let banned = engine.generate(&request(vec![(common, -100.0)])).unwrap();
    assert!(
        !banned.ids.contains(&common),
        "{common} in {:?}",
        banned.ids
    );
    assert_eq!(
        engine.generate(&request(Vec::new())).unwrap().ids,
        plain.ids
    );
    // Two requests in one decoder pass: only the biased one's rows move.
    let mut a = engine.start(&request(vec![(forced, 100.0)])).unwrap();
    let mut b = engine.start(&request(Vec::new())).unwrap();
    while !(a.is_done() && b.is_done()) {
        let mut running: Vec<&mut unmask::DgemmaTask> = [&mut a, &mut b]
            .into_iter()
            .filter(|t| !t.is_done())
            .collect();
        pollster::block_on(engine.step_async(&mut running, &mut |_, _| {
            std::ops::ControlFlow::Continue(())
        }))
        .unwrap();
    }
    let (a, b) = (engine.finish(a).unwrap(), engine.finish(b).unwrap());
    assert!(a.ids.iter().all(|&t| t == forced), "{:?}", a.ids);
    assert!(b.ids.iter().any(|&t| t != forced), "{:?}", b.ids);
    let e = engine
        .generate(&request(vec![(1 << 20, 1.0)]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("logit_bias: expected token ids below the vocabulary size"),
        "{e}"
    );
    eprintln!(
        "[check] DiffusionGemma logit_bias: +100 on {forced} gives {} of it, -100 keeps {common} out, batched rows keep their own biases",
        out.ids.len()
    );
}
