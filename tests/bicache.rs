//! BiCache on the tiny fixture: exactness at depth 0 with a refresh every step, the shared
//! entry's K/V and boundary state against fresh prefix-only passes, reuse across requests
//! without writes, the token-layer accounting, and the fallbacks.

mod common;

use common::{fixture_dir, params, same_tokens};

use unmask::{CacheBudget, CacheMode, Engine, EngineOptions, GenerationParams, Request};
use unmask_gpu::model::{LayerPass, LladaModel};
use unmask_gpu::{StepEncoder, WeightFormat};

fn engine_with(budget: CacheBudget) -> Engine {
    let options = EngineOptions {
        backend: None,
        weight_format: WeightFormat::F32,
        cache_budget: budget,
        ..EngineOptions::default()
    };
    Engine::load_on(common::ctx(), &fixture_dir(), &options, &mut |_| {}).expect("tiny model loads")
}

fn engine() -> Engine {
    engine_with(EngineOptions::default().cache_budget)
}

/// A shared "system" prefix of 24 tokens and a per-request question.
fn prefix() -> Vec<u32> {
    let mut p = vec![300, 302, 40, 41, 303];
    p.extend((0..18u32).map(|i| 50 + (i * 37) % 200));
    p.push(304);
    p
}

fn prompt(question: u32) -> Vec<u32> {
    let mut p = prefix();
    p.extend([
        302,
        42,
        303,
        60 + question,
        61 + question,
        304,
        302,
        43,
        303,
    ]);
    p
}

fn bicache_request(
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
fn fresh_prefix_pass(model: &LladaModel, prefix: &[u32], depth: usize) -> (LayerKv, Vec<f32>) {
    let p = prefix.len();
    let st = model.new_state(p, p).unwrap();
    let positions: Vec<u32> = (0..p as u32).collect();
    model.write_rows(&st, prefix, &positions).unwrap();
    let mut step = StepEncoder::new(&model.ctx, "fresh prefix");
    model.encode_embed(&mut step, &st, p).unwrap();
    let pass = |layers| LayerPass {
        x: &st.x,
        rows: p,
        positions: &st.positions,
        kv_index: &st.positions,
        layers,
        arena: &st.kv,
        kv_len: p,
        seg_a: None,
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
    let first = engine
        .generate(&bicache_request(
            0,
            CacheMode::Bicache,
            depth,
            4,
            params(16, 16, 16),
        ))
        .unwrap();
    assert!(!first.bicache.as_ref().unwrap().hit);
    let entry = engine
        .prefix_entry(&prefix())
        .expect("the prefix is stored");
    let read = |e: &unmask::PrefixEntry| -> LayerKv {
        e.kv.iter()
            .map(|l| {
                (
                    l.k.read_f32(&engine.ctx).unwrap(),
                    l.v.read_f32(&engine.ctx).unwrap(),
                )
            })
            .collect()
    };
    let before = read(&entry);
    let (fresh_kv, fresh_boundary) = fresh_prefix_pass(&engine.model, &prefix(), depth);
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
        .read_boundary(&engine.model, depth)
        .unwrap()
        .expect("boundary of the depth in use");
    assert_eq!(
        boundary, fresh_boundary,
        "boundary state differs from a prefix-only pass stopped after layer {depth}"
    );
    // Two more requests with other questions (one at another depth) reuse the entry.
    let second = engine
        .generate(&bicache_request(
            1,
            CacheMode::Bicache,
            depth,
            4,
            params(16, 16, 16),
        ))
        .unwrap();
    let third = engine
        .generate(&bicache_request(
            2,
            CacheMode::BicacheDual,
            2,
            4,
            params(16, 8, 4),
        ))
        .unwrap();
    assert!(second.bicache.as_ref().unwrap().hit && third.bicache.as_ref().unwrap().hit);
    assert_eq!(
        read(&entry),
        before,
        "requests must never write the shared entry"
    );
    let (_, fresh_b2) = fresh_prefix_pass(&engine.model, &prefix(), 2);
    assert_eq!(
        entry.read_boundary(&engine.model, 2).unwrap().unwrap(),
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
    engine
        .generate(&bicache_request(
            0,
            CacheMode::Bicache,
            depth,
            refresh,
            params(gen_len, steps, gen_len),
        ))
        .unwrap();
    let out = engine
        .generate(&bicache_request(
            0,
            CacheMode::Bicache,
            depth,
            refresh,
            params(gen_len, steps, gen_len),
        ))
        .unwrap();
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
