//! Logit biases (OpenAI's `logit_bias`, presence and frequency penalties, the repetition
//! penalty): the kernel applies each row's biases to exactly its listed ids in whichever
//! vocabulary chunk holds them; guidance carries a bias as it is (both passes take it); a
//! top-k cut sees it; a request's penalties follow the canvas each step saw, checked
//! against a full forward; a banned id never appears.

use crate::common::select::{assert_choices, chunk_ranges, columns, oracle_rows, pairs, positions};
use crate::common::{self, ctx, random_vec, steps};
use unmask::{CacheMode, LogitBias, Request};
use unmask_core::sampler::IdBias;
use unmask_gpu::model::{Model, TokenChoice};
use unmask_gpu::ops::logit_bias::{RowBiases, add_logit_bias};
use unmask_gpu::ops::sampling::{self as sel, SelectParams};
use unmask_gpu::{DType, GpuError, StepEncoder, Tensor};

#[test]
fn biases_land_on_their_ids_in_every_chunk() {
    let ctx = ctx();
    let (rows, n) = (5, 1000);
    let logits = random_vec(41, rows * n, 3.0);
    let argmax = |r: usize| {
        (0..n)
            .max_by(|&a, &b| logits[r * n + a].total_cmp(&logits[r * n + b]))
            .unwrap() as u32
    };
    let negative4 = (0..n).find(|&v| logits[4 * n + v] < 0.0).unwrap() as u32;
    let repeat = |id, bias, repetition, penalty| IdBias {
        id,
        bias,
        repetition,
        penalty,
    };
    // Chunk borders at 333 and 666: ids on both sides of each; 400 takes a bias, a
    // repetition penalty and a penalty.
    let shared: Vec<IdBias> = [(5, 2.5), (600, -1.25), (999, 40.0), (332, 0.5), (333, -0.5)]
        .into_iter()
        .map(IdBias::from)
        .chain([repeat(400, 0.5, 1.5, 0.25)])
        .collect();
    // Row 4: its argmax (positive) divided by 100, a negative logit multiplied by 2.
    let row4 = vec![
        repeat(argmax(4), 0.0, 100.0, 0.0),
        repeat(negative4, 0.0, 2.0, 0.0),
    ];
    let lists = [
        vec![IdBias::from((17, 100.0))],
        vec![IdBias::from((argmax(1), -100.0))],
        shared.clone(),
        shared,
        row4,
    ];
    let mut table = RowBiases::default();
    let mut want = logits.clone();
    for (r, list) in lists.iter().enumerate() {
        table.push(list, 1);
        for b in list {
            let at = r * n + b.id as usize;
            want[at] = b.apply(want[at]);
        }
    }
    let words = table.words();
    let table = Tensor::from_u32(&ctx, &[words.len()], &words, "bias table").unwrap();
    let params = SelectParams::default();
    let pos = Tensor::from_u32(&ctx, &[rows], &positions(rows), "positions").unwrap();
    let state = Tensor::zeros(&ctx, DType::U32, &[sel::state_len(rows)], "state").unwrap();
    let out = Tensor::zeros(&ctx, DType::U32, &[rows, sel::OUT_WORDS], "out").unwrap();
    let chunks = chunk_ranges(n, 3);
    let tensors: Vec<Tensor> = chunks
        .iter()
        .map(|&(lo, hi)| {
            let c = columns(&logits, n, lo, hi);
            Tensor::from_f32(&ctx, &[rows, hi - lo], &c, "logits").unwrap()
        })
        .collect();
    let mut step = StepEncoder::new(&ctx, "logit bias");
    sel::select_reset(&mut step, &state, rows).unwrap();
    for (&(lo, hi), t) in chunks.iter().zip(&tensors) {
        add_logit_bias(&mut step, t, rows, hi - lo, lo, &table).unwrap();
        sel::select_accumulate(&mut step, t, None, rows, hi - lo, lo, &pos, &state, &params)
            .unwrap();
    }
    sel::select_finalize(&mut step, &state, &out, rows, &params).unwrap();
    step.submit().unwrap();
    for (&(lo, hi), t) in chunks.iter().zip(&tensors) {
        // `IdBias::apply` on each listed logit (a multiply-add, which a GPU may fuse, so
        // within an ulp); nothing else moves.
        let got = t.read_f32(&ctx).unwrap();
        for (i, (g, w)) in got.iter().zip(columns(&want, n, lo, hi)).enumerate() {
            let ulp = f32::EPSILON * w.abs();
            assert!((g - w).abs() <= ulp, "{lo}..{hi} [{i}]: {g} against {w}");
        }
    }
    let got = pairs(&out.read_u32(&ctx).unwrap());
    let oracle = oracle_rows(&want, None, n, &positions(rows), &params);
    assert_choices("biased logits", &got, &oracle);
    assert_eq!((got[0].0, got[2].0, got[3].0), (17, 999, 999));
    assert_ne!(got[1].0, argmax(1), "a -100 bias bans the row's argmax");
    assert_ne!(
        got[4].0,
        argmax(4),
        "a repetition penalty of 100 sinks the argmax"
    );
    eprintln!(
        "[check] logit bias: 5 rows over 3 chunks, biased logits within an ulp, choices {got:?}"
    );
    // A table shorter than its rows is refused before anything runs.
    let short = Tensor::zeros(&ctx, DType::U32, &[2 * rows - 1], "short").unwrap();
    let mut step = StepEncoder::new(&ctx, "short table");
    match add_logit_bias(&mut step, &tensors[0], rows, 333, 0, &short) {
        Err(GpuError::Shape { .. }) => {}
        other => panic!("expected a shape error, got {other:?}"),
    }
}

/// Select over `n` rows of random hidden states of the Dream fixture (whole and chunked LM
/// heads), with guidance's unconditional rows when `guided`, and the rows' biases.
fn choose(guided: bool, params: &SelectParams, biases: &RowBiases) -> Vec<Vec<TokenChoice>> {
    let options = unmask::EngineOptions {
        weight_format: unmask_gpu::WeightFormat::F32,
        ..unmask::EngineOptions::default()
    };
    let dir = common::dream_fixture_dir();
    let load = |ctx| unmask::Engine::load_on(ctx, &dir, &options, &mut |_| {}).unwrap();
    let engines = [load(ctx()), load(common::ctx_with_binding_limit(48 * 1024))];
    assert!(engines[1].model().weights.lm_head.chunks.len() > 1);
    engines
        .iter()
        .map(|engine| {
            let model = engine.model();
            let (n, d) = (biases.rows(), model.cfg.d_model);
            let tensor = |seed, name| {
                let v = random_vec(seed, n * d, 2.0);
                Tensor::from_f32(&model.ctx, &[n, d], &v, name).unwrap()
            };
            let (x, u) = (tensor(8, "x"), tensor(9, "uncond x"));
            let rows: Vec<u32> = (0..n as u32).collect();
            let mut s = model.new_select(n).unwrap();
            model.write_select(&s, &rows, &rows).unwrap();
            model.write_logit_bias(&mut s, biases).unwrap();
            let mut step = StepEncoder::new(&model.ctx, "biased select");
            let uncond = guided.then_some(&u);
            model
                .encode_select_from(&mut step, &x, uncond, &s, n, params)
                .unwrap();
            let slot = model.read_back_choices(&mut step, &s, n, params);
            let read = pollster::block_on(step.submit().unwrap().read_async()).unwrap();
            Model::decode_choices(&read[slot], params)
        })
        .collect()
}

/// Guidance combines `u + (w + 1)(c - u)`: with the bias on both passes a biased id's
/// log-probability gap to another id grows by the bias itself (on one pass it would grow
/// by `(w + 1)` times it), over a whole and a chunked LM head. A top-k cut sees the bias.
#[test]
fn guidance_and_cuts_carry_a_bias_as_it_is() {
    const ROWS: usize = 4;
    let delta = 0.75f32;
    let guided = SelectParams {
        cfg_scale: 1.5,
        logprob: true,
        top_logprobs: 5,
        ..SelectParams::default()
    };
    let mut none = RowBiases::default();
    none.push::<IdBias>(&[], ROWS);
    let plain = choose(true, &guided, &none);
    let rows = &plain[0];
    // Each row's second alternative gets +delta; its third is the reference.
    let mut lifted = RowBiases::default();
    for c in rows {
        lifted.push(&[(c.alternatives[1].0, delta)], 1);
    }
    for (head, biased) in choose(true, &guided, &lifted).iter().enumerate() {
        for (r, (before, after)) in rows.iter().zip(biased).enumerate() {
            let (a, b) = (before.alternatives[1].0, before.alternatives[2].0);
            let lp = |c: &TokenChoice, id| c.alternatives.iter().find(|x| x.0 == id).unwrap().1;
            let grew = (lp(after, a) - lp(after, b)) - (lp(before, a) - lp(before, b));
            assert!(
                (grew - delta).abs() < 1e-4,
                "head {head} row {r}: the gap grew by {grew}, not {delta}"
            );
        }
    }
    // Under a top-3 cut, banning each row's argmax chooses its second id.
    let cut = SelectParams {
        top_k: Some(3),
        logprob: true,
        top_logprobs: 3,
        ..SelectParams::default()
    };
    let open = choose(false, &cut, &none);
    let mut ban = RowBiases::default();
    for c in &open[0] {
        ban.push(&[(c.token, -100.0)], 1);
    }
    for (head, banned) in choose(false, &cut, &ban).iter().enumerate() {
        for (r, (o, b)) in open[0].iter().zip(banned).enumerate() {
            assert_eq!(b.token, o.alternatives[1].0, "head {head} row {r}");
            assert!(b.alternatives.iter().all(|a| a.0 != o.token));
        }
    }
    eprintln!("[check] guided select: a bias of {delta} widens the gap by itself on both heads");
}

/// A request's fixed biases and penalties: each step's committed tokens carry the
/// log-probabilities of `log_softmax` of the biased logits of a full forward over the
/// canvas it saw, the penalties counted from that canvas (the repetition penalty also from
/// the prompt); the banned id never appears, in any mode.
#[test]
fn penalties_follow_the_canvas_each_step_saw() {
    let engine = common::tiny_engine();
    let request = |bias: LogitBias, mode| {
        let mut r = Request::ids(common::shared_prefix_prompt(5))
            .with_params(unmask::GenerationParams {
                bias,
                ..common::params(16, 8, 8)
            })
            .with_cache(mode);
        r.top_logprobs = 3;
        r
    };
    let plain = engine
        .generate(&request(LogitBias::default(), CacheMode::None))
        .unwrap();
    let special = engine.special();
    let ends: Vec<u32> = [Some(special.eos), special.eot]
        .into_iter()
        .flatten()
        .collect();
    let mask = engine.model().cfg.mask_token_id;
    // The plain canvas's most repeated word (not a mask or an end token) is banned.
    let words: Vec<u32> = plain
        .ids
        .iter()
        .copied()
        .filter(|t| *t != mask && !ends.contains(t))
        .collect();
    let count = |id| words.iter().filter(|&&t| t == id).count();
    let banned = *words
        .iter()
        .max_by_key(|&&t| count(t))
        .expect("plain words");
    let mut bias = LogitBias::with_ids(vec![(banned, -100.0), (77, 2.0)]).unwrap();
    bias.presence_penalty = 1.5;
    bias.frequency_penalty = 0.75;
    bias.repetition_penalty = 1.3;
    let (generation, seen) = steps::run_recording(&engine, request(bias.clone(), CacheMode::None));
    assert!(!generation.ids.contains(&banned), "{:?}", generation.ids);
    assert_ne!(generation.ids, plain.ids);
    let step_bias =
        |s: &steps::SeenStep| bias.step_biases(&s.before, s.canvas.clone(), mask, &ends);
    let (worst, tokens) = steps::worst_logprob_error(&engine, &seen, &step_bias);
    eprintln!(
        "[check] penalties: {tokens} tokens over {} steps against the biased forward, worst error {worst:.2e}",
        seen.len()
    );
    let committed = generation.ids.iter().filter(|&&t| t != mask).count();
    assert!(tokens == committed && worst < 1e-3, "off by {worst}");
    for mode in [CacheMode::BicacheDual, CacheMode::DllmCache] {
        let g = engine.generate(&request(bias.clone(), mode)).unwrap();
        assert!(!g.ids.contains(&banned), "{mode}: {:?}", g.ids);
    }
    // A committed mask would leave its position masked (threshold decoding would never
    // end); ids past the embedding are no ids. Both are refused before any GPU work.
    for (id, needle) in [
        (mask, "ids other than the mask token"),
        (320, "vocabulary size 320"),
    ] {
        let bias = LogitBias::with_ids(vec![(id, 100.0)]).unwrap();
        let e = engine
            .generate(&request(bias, CacheMode::None))
            .unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
    }
}
