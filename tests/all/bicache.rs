//! BiCache on the tiny fixture: exactness at depth 0 with a refresh every step, the shared
//! entry's K/V and boundary state against fresh prefix-only passes, reuse across requests
//! without writes, the token-layer accounting, and the fallbacks.

use crate::common;

use common::{
    fixture_dir, params, same_tokens, shared_prefix as prefix, shared_prefix_prompt as prompt,
};

use unmask::{CacheBudget, CacheMode, Engine, EngineOptions, GenerationParams, Request};
use unmask_gpu::model::{LayerPass, Model, SeqWindow};
use unmask_gpu::ops::matmul::MatmulKernel;
use unmask_gpu::{StepEncoder, WeightFormat};

pub(crate) fn engine_with(budget: CacheBudget) -> Engine {
    let options = EngineOptions {
        backend: None,
        weight_format: WeightFormat::F32,
        cache_budget: budget,
        ..EngineOptions::default()
    };
    Engine::load_on(common::ctx(), &fixture_dir(), &options, &mut |_| {}).expect("tiny model loads")
}

pub(crate) fn engine() -> Engine {
    engine_with(EngineOptions::default().cache_budget)
}

pub(crate) fn bicache_request(
    q: u32,
    mode: CacheMode,
    depth: usize,
    refresh: usize,
    p: GenerationParams,
) -> Request {
    let mut req = Request::ids(prompt(q)).with_params(p).with_cache(mode);
    req.prefix_len = Some(prefix().len());
    req.depth = Some(depth);
    req.refresh_every = refresh;
    req
}

/// `engine.generate` of `bicache_request(question, mode, depth, refresh_every, params)`.
pub(crate) fn generate(
    engine: &unmask::Engine,
    question: u32,
    mode: CacheMode,
    depth: usize,
    refresh_every: usize,
    params: GenerationParams,
) -> unmask::Generation {
    let request = bicache_request(question, mode, depth, refresh_every, params);
    engine.generate(&request).unwrap()
}

/// The same request with the depth a batch runs it at.
pub(crate) fn at_depth(req: &Request, depth: usize) -> Request {
    let mut r = req.clone();
    r.depth = Some(depth);
    r
}

#[test]
fn depth_zero_with_refresh_every_step_equals_none() {
    let engine = engine();
    for (p, q) in [(params(16, 16, 16), 0), (params(12, 6, 12), 1)] {
        let none = engine
            .generate(&Request::ids(prompt(q)).with_params(p.clone()))
            .unwrap();
        let out = engine
            .generate(&bicache_request(q, CacheMode::Bicache, 0, 1, p))
            .unwrap();
        let report = out.bicache.as_ref().expect("a BiCache report");
        assert!(report.fallback.is_none(), "{report:?}");
        assert_eq!(
            out.ids, none.ids,
            "b = 0, R = 1 must reproduce none exactly"
        );
    }
    eprintln!("[bicache] b=0, R=1 equals none");
}

/// Per layer (K, V) as read back.
type LayerKv = Vec<(Vec<f32>, Vec<f32>)>;

/// K/V and hidden state of a fresh prefix-only pass: (K, V) per layer, and x after `depth` layers.
fn fresh_prefix_pass(model: &Model, prefix: &[u32], depth: usize) -> (LayerKv, Vec<f32>) {
    let p = prefix.len();
    let st = model.new_state(p, p).unwrap();
    let positions: Vec<u32> = (0..p as u32).collect();
    model.write_rows(&st, prefix, &positions).unwrap();
    let mut step = StepEncoder::new(&model.ctx, "fresh prefix");
    model.encode_embed(&mut step, &st, p).unwrap();
    let whole = SeqWindow::single(p, p);
    let pass = |layers| LayerPass {
        x: &st.x,
        rows: p,
        positions: &st.positions,
        kv_index: &st.positions,
        layers,
        arena: &st.kv,
        seqs: &whole,
        seg_a: None,
        probe: None,
    };
    model.encode_pass(&mut step, &st, &pass(0..depth)).unwrap();
    step.submit().unwrap();
    let boundary = st.x.read_f32(&model.ctx).unwrap()[..p * model.cfg.d_model].to_vec();
    let mut step = StepEncoder::new(&model.ctx, "fresh prefix deep");
    model
        .encode_pass(&mut step, &st, &pass(depth..model.cfg.n_layers))
        .unwrap();
    step.submit().unwrap();
    let kv = st
        .kv
        .iter()
        .map(|l| {
            (
                l.k.read_f32(&model.ctx).unwrap(),
                l.v.read_f32(&model.ctx).unwrap(),
            )
        })
        .collect();
    (kv, boundary)
}

#[test]
fn shared_entry_equals_a_fresh_prefix_pass_and_is_never_written() {
    let engine = engine();
    let depth = 1;
    let first = generate(&engine, 0, CacheMode::Bicache, depth, 4, params(16, 16, 16));
    assert!(!first.bicache.as_ref().unwrap().hit);
    let entry = engine
        .prefix_entry(&prefix())
        .expect("the prefix is stored");
    let read = |e: &unmask::PrefixEntry| -> LayerKv {
        e.kv.iter()
            .map(|l| {
                (
                    l.k.read_f32(engine.ctx()).unwrap(),
                    l.v.read_f32(engine.ctx()).unwrap(),
                )
            })
            .collect()
    };
    let before = read(&entry);
    let (fresh_kv, fresh_boundary) = fresh_prefix_pass(engine.model(), &prefix(), depth);
    for (l, ((k, v), (fk, fv))) in before.iter().zip(&fresh_kv).enumerate() {
        assert_eq!(
            k, fk,
            "layer {l}: entry K differs from a fresh prefix-only pass"
        );
        assert_eq!(
            v, fv,
            "layer {l}: entry V differs from a fresh prefix-only pass"
        );
    }
    let boundary = entry
        .read_boundary(engine.model(), depth)
        .unwrap()
        .expect("boundary of the depth in use");
    assert_eq!(
        boundary, fresh_boundary,
        "boundary state differs from a prefix-only pass stopped after layer {depth}"
    );
    // Two more requests with other questions (one at another depth) reuse the entry.
    let second = generate(&engine, 1, CacheMode::Bicache, depth, 4, params(16, 16, 16));
    let third = generate(&engine, 2, CacheMode::BicacheDual, 2, 4, params(16, 8, 4));
    assert!(second.bicache.as_ref().unwrap().hit && third.bicache.as_ref().unwrap().hit);
    assert_eq!(
        read(&entry),
        before,
        "requests must never write the shared entry"
    );
    let (_, fresh_b2) = fresh_prefix_pass(engine.model(), &prefix(), 2);
    assert_eq!(
        entry.read_boundary(engine.model(), 2).unwrap().unwrap(),
        fresh_b2,
        "boundary at depth 2"
    );
    let stats = engine.prefix_store_stats();
    assert_eq!(
        (stats.misses, stats.hits, stats.entries),
        (1, 2, 1),
        "{stats:?}"
    );
    eprintln!(
        "[bicache] entry K/V and boundaries equal fresh prefix passes; unchanged after 3 requests; {stats:?}"
    );
}

#[test]
fn token_layer_passes_follow_the_layer_partition() {
    let engine = engine();
    let layers = engine.config().n_layers;
    let (gen_len, steps) = (16, 16);
    let p = prefix().len();
    let t = prompt(0).len() + gen_len;
    let depth = 1;
    let refresh = 4;
    // Build the entry first so the measured request is a hit (no build pass counted).
    generate(
        &engine,
        0,
        CacheMode::Bicache,
        depth,
        refresh,
        params(gen_len, steps, gen_len),
    );
    let out = generate(
        &engine,
        0,
        CacheMode::Bicache,
        depth,
        refresh,
        params(gen_len, steps, gen_len),
    );
    let s = out.timings.steps;
    let refreshes = s.div_ceil(refresh);
    let n = t - p;
    let expected = s * n * depth + (refreshes * t + (s - refreshes) * n) * (layers - depth);
    assert_eq!(out.timings.token_layer_passes, expected);
    let none = engine
        .generate(&Request::ids(prompt(0)).with_params(params(gen_len, steps, gen_len)))
        .unwrap();
    let agree = same_tokens(&out.ids, &none.ids);
    eprintln!(
        "[bicache] b={depth} R={refresh}: {} token-layer passes vs {} for none; {agree}/{gen_len} tokens equal none",
        out.timings.token_layer_passes, none.timings.token_layer_passes
    );
}

#[test]
fn requests_run_uncached_and_say_why() {
    // No depth and no depth table in the fixture folder.
    let engine = engine();
    let mut req = bicache_request(0, CacheMode::Bicache, 0, 4, params(8, 8, 8));
    req.depth = None;
    let out = engine.generate(&req).unwrap();
    let why = out.bicache.unwrap().fallback.expect("a fallback");
    assert!(
        why.contains("ran as none") && why.contains("bicache_depth.json"),
        "{why}"
    );
    // A prefix over the budget is not stored; bicache-dual falls back to the dual cache.
    let small = engine_with(CacheBudget {
        max_tokens: 8,
        max_bytes: 1 << 30,
    });
    let out = small
        .generate(&bicache_request(
            0,
            CacheMode::BicacheDual,
            1,
            4,
            params(8, 8, 4),
        ))
        .unwrap();
    let why = out.bicache.unwrap().fallback.expect("a fallback");
    assert!(
        why.contains("fast-dllm-dual") && why.contains("budget"),
        "{why}"
    );
    assert_eq!(small.prefix_store_stats().entries, 0);
    // CFG masks the prefix: nothing to share.
    let p = GenerationParams {
        cfg_scale: 1.0,
        ..params(8, 8, 8)
    };
    let out = engine
        .generate(&bicache_request(0, CacheMode::Bicache, 1, 4, p))
        .unwrap();
    assert!(out.bicache.unwrap().fallback.unwrap().contains("guidance"));
}

/// The session key of the test prefix at `depth`.
/// The first items of the bundled model's held-out set (models/tiny, data/tasks/).
fn heldout_items(n: usize) -> Vec<serde_json::Value> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("data/tasks/heldout-small.jsonl"))
        .expect("data/tasks/heldout-small.jsonl");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// The bundled model reads its system prompt: it answers held-out questions (never seen in
/// training) exactly, with no cache and with BiCache + dual cache at the paper's request
/// shape (32 tokens, blocks of 4, 16 steps). A kernel or a cache that corrupts K/V fails here
/// by behaviour, not only by a tolerance.
///
/// And a wrong cache loses: the model's deep layers mark the table rows the question asks
/// about (models/tiny/README.md), so the prefix K/V of a prefix-only pass reused at every
/// depth (`prefix-arm`, or BiCache with b = every layer) leaves the rows unmarked and the
/// lookups answer wrong, while BiCache at the shipped depth (b = 2 from r = 85 %) stays
/// exact.
#[test]
fn bundled_model_answers_heldout_questions_with_and_without_bicache() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let options = EngineOptions {
        backend: None,
        ..EngineOptions::default()
    };
    let engine = Engine::load_on(
        common::ctx(),
        &root.join("models/tiny"),
        &options,
        &mut |_| {},
    )
    .expect("models/tiny loads");
    let n_layers = engine.model().cfg.n_layers;
    // The five questions of the first system prompt (every task type).
    let items = heldout_items(5);
    let answer = |mode: CacheMode, depth: Option<usize>, item: &serde_json::Value| {
        let field = |k: &str| item[k].as_str().expect(k).to_string();
        let mut request = Request::chat(Some(&field("system")), &field("user"))
            .with_params(params(32, 16, 4))
            .with_cache(mode);
        request.depth = depth;
        let out = engine.generate(&request).expect("generation");
        let text = out.text.clone().expect("the model has a tokenizer");
        let got = text.rsplit("####").next().unwrap_or("").trim().to_string();
        (
            got == field("answer"),
            text,
            out.bicache.map(|r| (r.hit, r.depth, r.ratio)),
        )
    };
    for mode in [CacheMode::None, CacheMode::BicacheDual] {
        let mut hits = 0;
        for item in &items {
            let (right, text, report) = answer(mode, None, item);
            assert!(right, "{mode}, {}: {text:?}", item["id"]);
            if let Some((hit, depth, ratio)) = report {
                hits += usize::from(hit);
                // The shipped table: r >= 85: b = 2 (these items: r 85-86).
                let want = if ratio >= 85 { 2 } else { 0 };
                assert_eq!(depth, want, "the shipped depth table's b at r = {ratio}");
            }
        }
        if mode == CacheMode::BicacheDual {
            // One entry for the shared system prompt: every question after the first hits it.
            assert_eq!(hits, items.len() - 1, "BiCache hits");
        }
        eprintln!(
            "[bundled model] {mode}: {} of {} answered",
            items.len(),
            items.len()
        );
    }
    // Ten questions over two system prompts; with no cache all ten are right (seed-0
    // held-out set: tools/cache_sim.py measures 1 of 10 with every layer reused).
    let items = heldout_items(10);
    for (mode, depth) in [
        (CacheMode::PrefixArm, None),
        (CacheMode::Bicache, Some(n_layers)),
    ] {
        let right = items
            .iter()
            .filter(|item| answer(mode, depth, item).0)
            .count();
        eprintln!(
            "[bundled model] {mode} (depth {depth:?}): {right} of {} answered",
            items.len()
        );
        assert!(
            right <= 3,
            "{mode} with every layer's prefix K/V from a prefix-only pass answered {right} of {}: \
             the deep layers no longer read the question",
            items.len()
        );
    }
}

/// Long random request sequences against the prefix store: prefixes that share parts,
/// random depths, budgets, batch sizes and sessions, injected failures after a pin and
/// cancelled requests. After every operation the store's counters equal its entries, the
/// budget holds and no pin is left; every answer equals the same request at the same
/// depth computed with an empty store.
#[test]
fn random_request_sequences_keep_the_prefix_store_true() {
    use unmask_core::rng::SplitMix64;
    let n_layers = 2;
    // Prefixes over one head: some equal, some one a prefix of another, some apart.
    let head = prefix();
    let variant = |v: u64, len: usize| -> Vec<u32> {
        let mut p = head[..len].to_vec();
        if v % 3 == 1 {
            p[2] = 45;
        }
        p
    };
    let request = |rng: &mut SplitMix64| -> Request {
        let len = [12, 18, head.len()][(rng.next_u64() % 3) as usize];
        let mut ids = variant(rng.next_u64(), len);
        let q = (rng.next_u64() % 5) as u32;
        ids.extend([302, 42, 303, 60 + q, 61 + q, 304, 302, 43, 303]);
        let (mode, p) = if rng.next_u64().is_multiple_of(2) {
            (CacheMode::Bicache, params(8, 8, 8))
        } else {
            (CacheMode::BicacheDual, params(8, 4, 4))
        };
        let mut req = Request::ids(ids).with_params(p).with_cache(mode);
        req.prefix_len = Some(len);
        req.depth = Some((rng.next_u64() % (n_layers as u64 + 1)) as usize);
        req.refresh_every = 1 + (rng.next_u64() % 4) as usize;
        req
    };
    let mut answers = 0;
    let mut faults = 0;
    let mut cancels = 0;
    for (seed, budget) in [
        (1u64, EngineOptions::default().cache_budget),
        // Room for about two entries: inserts evict, boundaries are refused or charged.
        (
            2,
            CacheBudget {
                max_tokens: 48,
                max_bytes: 56 << 10,
            },
        ),
    ] {
        let mut engine = engine_with(budget);
        engine.set_matmul_kernel(MatmulKernel::Tiled);
        let mut cold = engine_with(budget);
        cold.set_matmul_kernel(MatmulKernel::Tiled);
        assert_eq!(engine.config().n_layers, n_layers);
        let mut rng = SplitMix64(seed);
        let mut check = |req: &Request, got: &unmask::Generation| {
            let depth = got.bicache.as_ref().map_or(0, |r| r.depth);
            cold.clear_prefix_store();
            let want = cold.generate(&at_depth(req, depth)).unwrap();
            let fell_back =
                |g: &unmask::Generation| g.bicache.as_ref().and_then(|r| r.fallback.clone());
            assert_eq!(
                fell_back(got).is_some(),
                fell_back(&want).is_some(),
                "{:?}",
                fell_back(got)
            );
            assert_eq!(
                got.ids, want.ids,
                "seed {seed}: an answer differs from a cold store's"
            );
            answers += 1;
        };
        for op in 0..16 {
            match rng.next_u64() % 4 {
                0 => {
                    let req = request(&mut rng);
                    let got = engine.generate(&req).unwrap();
                    check(&req, &got);
                }
                1 => {
                    let reqs: Vec<Request> = (0..1 + rng.next_u64() % 3)
                        .map(|_| request(&mut rng))
                        .collect();
                    for (req, got) in reqs.iter().zip(engine.generate_batch(&reqs)) {
                        check(req, &got.unwrap());
                    }
                }
                2 => {
                    // A failure right after a pin: the request errs, the pin goes.
                    engine.inject_fault_after_pin(1);
                    let req = request(&mut rng);
                    let err = engine.generate(&req).map(|_| ()).unwrap_err();
                    assert!(err.to_string().contains("injected fault"), "{err}");
                    engine.inject_fault_after_pin(0);
                    faults += 1;
                }
                _ => {
                    // A session whose second request is withdrawn mid-run.
                    let req = request(&mut rng);
                    let prefix = match &req.prompt {
                        unmask::Prompt::Ids(ids) => ids[..req.prefix_len.unwrap()].to_vec(),
                        _ => unreachable!(),
                    };
                    let depth = req.depth.unwrap();
                    let Ok(mut session) = engine.session(
                        Some(&unmask::PrefixKey {
                            tokens: prefix,
                            depth,
                        }),
                        120,
                    ) else {
                        continue; // the entry does not fit this budget
                    };
                    let a = session.submit(req.clone()).unwrap();
                    let b = session.submit(req.clone()).unwrap();
                    session.step();
                    assert!(session.cancel(b) && !session.cancel(b));
                    cancels += 1;
                    let mut out = None;
                    while !session.is_idle() {
                        for (id, g) in session.step() {
                            assert_eq!(id, a);
                            out = Some(g.unwrap());
                        }
                    }
                    drop(session);
                    check(&req, &out.expect("the kept request finished"));
                }
            }
            let stats = engine.prefix_store_stats();
            let live = engine.prefix_store_recount();
            assert_eq!(
                (stats.entries, stats.tokens, stats.bytes),
                (live.entries, live.tokens, live.bytes),
                "seed {seed} op {op}: counters differ from the entries"
            );
            assert_eq!(
                live.pins, 0,
                "seed {seed} op {op}: a pin outlived its request"
            );
            assert!(
                live.tokens <= budget.max_tokens && live.bytes <= budget.max_bytes,
                "seed {seed} op {op}: {live:?} over {budget:?}"
            );
        }
        let stats = engine.prefix_store_stats();
        eprintln!("[bicache] seed {seed}, budget {budget:?}: {stats:?}");
        assert!(stats.hits > 0, "seed {seed}: no request reused an entry");
        if budget.max_tokens < 64 {
            assert!(
                stats.evictions + stats.rejected > 0,
                "seed {seed}: the budget never bound"
            );
        }
    }
    eprintln!(
        "[bicache] random sequences: {answers} answers equal a cold store's, {faults} injected \
         faults and {cancels} cancellations left no pin"
    );
    assert!(answers >= 10 && faults + cancels >= 2);
}
