//! Cache modes within a request: where a cached path must reproduce `none` exactly (a full
//! pass every step), it does, which checks its row ranges, arena offsets and sampled rows;
//! elsewhere its commits follow the schedule and its token-layer passes its formula.

use crate::common;

use common::{params, same_tokens};
use unmask::{CacheMode, Engine, Request};

fn engine() -> Engine {
    common::tiny_engine()
}

/// A chat-shaped prompt of the fixture vocabulary: BOS, a header, 20 ordinary ids.
fn prompt() -> Vec<u32> {
    let mut p = vec![300, 302, 40, 41, 303];
    p.extend((0..20u32).map(|i| 50 + (i * 37) % 200));
    p.extend([304, 302, 42, 303]);
    p
}

/// One step per block: every step of the Fast-dLLM modes is its block's full pass, so the
/// cached paths (their row ranges, arena offsets and sampled rows) must give exactly the
/// tokens and commits of `none`.
#[test]
fn fast_dllm_with_one_step_per_block_equals_none() {
    let engine = engine();
    for (p, what) in [
        (params(16, 4, 4), "4 blocks of 4"),
        (params(12, 2, 6), "2 blocks of 6"),
    ] {
        let none = engine
            .generate(
                &Request::ids(prompt())
                    .with_full_canvas()
                    .with_params(p.clone()),
            )
            .unwrap();
        for mode in [CacheMode::FastDllmPrefix, CacheMode::FastDllmDual] {
            let out = engine
                .generate(
                    &Request::ids(prompt())
                        .with_full_canvas()
                        .with_params(p.clone())
                        .with_cache(mode),
                )
                .unwrap();
            assert_eq!(out.ids, none.ids, "{mode}, {what}");
            assert_eq!(out.steps, none.steps, "{mode}, {what}");
            // Each step a full pass: the cache reused nothing.
            assert_eq!(
                out.timings.token_layer_passes, none.timings.token_layer_passes,
                "{mode}, {what}"
            );
        }
        eprintln!("[cache] one step per block, {what}: both Fast-dLLM modes equal none");
    }
}

/// With more steps per block the cached steps compute only some rows; the first step of
/// each block is still a full pass, so up to the first cached step the commits equal
/// `none`'s, and every step commits exactly the positions the schedule asks for, inside
/// its block.
#[test]
fn fast_dllm_cached_steps_commit_inside_their_block() {
    let engine = engine();
    let (gen_len, steps, block) = (16, 8, 4);
    let p_len = prompt().len();
    let none = engine
        .generate(
            &Request::ids(prompt())
                .with_full_canvas()
                .with_params(params(gen_len, steps, block)),
        )
        .unwrap();
    for mode in [CacheMode::FastDllmPrefix, CacheMode::FastDllmDual] {
        let out = engine
            .generate(
                &Request::ids(prompt())
                    .with_full_canvas()
                    .with_params(params(gen_len, steps, block))
                    .with_cache(mode),
            )
            .unwrap();
        assert_eq!(
            out.steps[0], none.steps[0],
            "{mode}: the first step is a full pass"
        );
        assert_eq!(out.steps.len(), steps, "{mode}");
        for s in &out.steps {
            let lo = (p_len + s.block * block) as u32;
            assert_eq!(
                s.committed.len(),
                block / (steps * block / gen_len),
                "{mode}: {s:?}"
            );
            assert!(
                s.committed
                    .iter()
                    .all(|&(pos, _)| pos >= lo && pos < lo + block as u32),
                "{mode}: a commit outside block {}: {s:?}",
                s.block
            );
        }
        let agree = same_tokens(&out.ids, &none.ids);
        eprintln!(
            "[cache] {mode}: cached steps commit inside their blocks; {agree}/{gen_len} tokens equal none"
        );
    }
}

/// A prefix over the whole prompt is computed once and read by every step: the steps
/// commit the schedule's count, each canvas position exactly once and never the prompt.
#[test]
fn prefix_arm_over_the_whole_prompt_commits_what_the_schedule_asks() {
    let engine = engine();
    let (gen_len, steps, block) = (16, 8, 8);
    let mut req = Request::ids(prompt())
        .with_full_canvas()
        .with_params(params(gen_len, steps, block))
        .with_cache(CacheMode::PrefixArm);
    req.prefix_len = Some(prompt().len());
    let out = engine.generate(&req).unwrap();
    let p_len = prompt().len();
    assert_eq!(out.steps.len(), steps);
    let mut seen = std::collections::BTreeSet::new();
    for s in &out.steps {
        assert_eq!(s.committed.len(), gen_len / steps, "{s:?}");
        for &(pos, _) in &s.committed {
            assert!(
                (pos as usize) >= p_len && seen.insert(pos),
                "position {pos} committed twice or inside the prompt"
            );
        }
    }
    assert_eq!(seen.len(), gen_len, "every canvas position committed once");
}

#[test]
fn token_layer_passes_follow_each_modes_formula() {
    let engine = engine();
    let layers = engine.config().n_layers;
    let (gen_len, steps, block) = (16, 8, 4);
    let p_len = prompt().len();
    let t = p_len + gen_len;
    let prefix = 10;
    let reference = engine
        .generate(
            &Request::ids(prompt())
                .with_full_canvas()
                .with_params(params(gen_len, steps, block)),
        )
        .unwrap();
    // BiCache modes are covered by tests/bicache.rs.
    let single_pass = [
        CacheMode::None,
        CacheMode::FastDllmPrefix,
        CacheMode::FastDllmDual,
        CacheMode::PrefixArm,
        CacheMode::DllmCache,
    ];
    for mode in single_pass {
        let mut req = Request::ids(prompt())
            .with_full_canvas()
            .with_params(params(gen_len, steps, block))
            .with_cache(mode);
        req.prefix_len = Some(prefix);
        let out = engine.generate(&req).unwrap();
        let s = out.timings.steps;
        let blocks = gen_len / block;
        // Steps per block are fixed (steps / blocks) with the quota sampler.
        let spb = steps / blocks;
        let expected = match mode {
            CacheMode::None => s * t * layers,
            // Per block: one full pass, then the block and everything after it.
            CacheMode::FastDllmPrefix => {
                (0..blocks)
                    .map(|b| t + (spb - 1) * (t - (p_len + b * block)))
                    .sum::<usize>()
                    * layers
            }
            // Per block: one full pass, then only the block.
            CacheMode::FastDllmDual => blocks * (t + (spb - 1) * block) * layers,
            // The prefix once, alone; then every step computes all rows after it.
            CacheMode::PrefixArm => (prefix + s * (t - prefix)) * layers,
            // The defaults: the prompt every 100 forwards, the response every 7, and in
            // between the current block (several blocks) and ⌊0.25 G⌋ other response rows.
            CacheMode::DllmCache => {
                (0..s)
                    .map(|d| {
                        let prompt = if d % 100 == 0 { p_len } else { 0 };
                        prompt
                            + if d % 7 == 0 {
                                gen_len
                            } else {
                                block + gen_len / 4
                            }
                    })
                    .sum::<usize>()
                    * layers
            }
            CacheMode::Bicache
            | CacheMode::BicacheDual
            | CacheMode::BicacheDllm
            | CacheMode::Acache => {
                unreachable!("not in the list above")
            }
        };
        assert_eq!(out.timings.token_layer_passes, expected, "{mode}");
        assert_eq!(
            out.timings.forward_passes,
            s + usize::from(mode == CacheMode::PrefixArm),
            "{mode}"
        );
        let agree = same_tokens(&out.ids, &reference.ids);
        eprintln!(
            "[cache] {mode}: {} token-layer passes ({:.2}x fewer than none), {agree}/{gen_len} tokens equal none",
            out.timings.token_layer_passes,
            (s * t * layers) as f64 / out.timings.token_layer_passes as f64
        );
        assert!(
            !out.ids.contains(&engine.special().mask),
            "{mode}: the canvas is complete"
        );
    }
}

#[test]
fn cached_modes_refuse_masks_in_the_prompt() {
    let engine = engine();
    let mut p = prompt();
    p[8] = engine.special().mask;
    let req = Request::ids(p.clone())
        .with_params(params(8, 8, 8))
        .with_cache(CacheMode::FastDllmDual);
    let err = engine.generate(&req).unwrap_err().to_string();
    assert!(err.contains("infilling"), "{err}");
    // `none` handles infilling.
    let out = engine
        .generate(&Request::ids(p).with_params(params(8, 8, 8)))
        .unwrap();
    assert_eq!(out.ids.len(), 8);
}

#[test]
fn prefix_longer_than_prompt_is_an_error() {
    let engine = engine();
    let mut req = Request::ids(prompt())
        .with_full_canvas()
        .with_params(params(8, 8, 8))
        .with_cache(CacheMode::PrefixArm);
    req.prefix_len = Some(1000);
    let err = engine.generate(&req).unwrap_err().to_string();
    assert!(err.contains("1000"), "{err}");
}

/// BiCache at depth 0 refreshing every step: no layer reads the shared entry's K/V, and
/// every step the deep layers (all of them) recompute the prefix rows from the boundary
/// state (the embedding) with the rest. That is the `none` computation through BiCache's
/// own path (entry, boundary copy, deep rows, arena offsets, sampled rows), so tokens and
/// commits must be exactly `none`'s, for both BiCache modes.
#[test]
fn bicache_refreshing_every_step_from_depth_0_equals_none() {
    let engine = engine();
    // One block, so refreshes follow `refresh_every`.
    let p = params(16, 8, 16);
    let none = engine
        .generate(
            &Request::ids(prompt())
                .with_full_canvas()
                .with_params(p.clone()),
        )
        .unwrap();
    for mode in [CacheMode::Bicache, CacheMode::BicacheDual] {
        let request = Request {
            prefix_len: Some(5),
            depth: Some(0),
            refresh_every: 1,
            ..Request::ids(prompt())
                .with_full_canvas()
                .with_params(p.clone())
                .with_cache(mode)
        };
        let out = engine.generate(&request).unwrap();
        let report = out.bicache.as_ref().expect("a BiCache report");
        assert!(report.fallback.is_none(), "{mode}: {report:?}");
        assert_eq!(report.depth, 0);
        assert_eq!(out.ids, none.ids, "{mode}");
        assert_eq!(out.steps, none.steps, "{mode}");
        // Every step computes every row in every layer, like `none`; a miss also builds
        // the entry (a prefix-only pass).
        let entry = if report.hit {
            0
        } else {
            5 * engine.config().n_layers
        };
        assert_eq!(
            out.timings.token_layer_passes,
            none.timings.token_layer_passes + entry,
            "{mode}"
        );
    }
    eprintln!("[cache] BiCache at depth 0, refresh every step: both modes equal none");
}

/// A shared prefix of no tokens is never read: prefix-arm then runs no prefix pass and
/// computes every row every step, exactly as `none`.
#[test]
fn a_prefix_of_no_tokens_changes_nothing() {
    let engine = engine();
    let p = params(16, 8, 8);
    let none = engine
        .generate(
            &Request::ids(prompt())
                .with_full_canvas()
                .with_params(p.clone()),
        )
        .unwrap();
    let request = Request {
        prefix_len: Some(0),
        ..Request::ids(prompt())
            .with_full_canvas()
            .with_params(p)
            .with_cache(CacheMode::PrefixArm)
    };
    let out = engine.generate(&request).unwrap();
    assert_eq!(out.ids, none.ids);
    assert_eq!(out.steps, none.steps);
    assert_eq!(out.timings.forward_passes, none.timings.forward_passes);
}

/// BiCache at depth n_layers reads the entry's prefix K/V (from a prefix-only pass) in every
/// layer and never recomputes the prefix: prefix-arm's computation, with the prefix's K/V as
/// segment A of the attention instead of the first rows of the arena. The sums over keys
/// then split at the prefix boundary, so scores may differ in the last bits; on this
/// fixture the tokens and commits are the same.
#[test]
fn bicache_reading_the_entry_in_every_layer_equals_prefix_arm() {
    let engine = engine();
    let n_layers = engine.config().n_layers;
    let p = params(16, 8, 16);
    let arm = Request {
        prefix_len: Some(5),
        ..Request::ids(prompt())
            .with_full_canvas()
            .with_params(p.clone())
            .with_cache(CacheMode::PrefixArm)
    };
    let arm = engine.generate(&arm).unwrap();
    let bicache = Request {
        prefix_len: Some(5),
        depth: Some(n_layers),
        ..Request::ids(prompt())
            .with_full_canvas()
            .with_params(p)
            .with_cache(CacheMode::Bicache)
    };
    let out = engine.generate(&bicache).unwrap();
    assert!(out.bicache.as_ref().is_some_and(|b| b.fallback.is_none()));
    assert_eq!(out.ids, arm.ids);
    assert_eq!(out.steps, arm.steps);
}

/// Every cache mode with the K/V arena and the BiCache entries in f16 commits the same
/// tokens at the same steps as with f32 on this fixture (the f16 rounding moves logits by
/// about 1e-3 of their scale, below its decision margins), and a BiCache entry takes half
/// the K/V bytes.
#[test]
fn every_cache_mode_with_an_f16_kv_arena_commits_as_f32() {
    let load = |kv_dtype| {
        let options = unmask::EngineOptions {
            weight_format: unmask_gpu::WeightFormat::F32,
            kv_dtype,
            ..unmask::EngineOptions::default()
        };
        Engine::load_on(common::ctx(), &common::fixture_dir(), &options, &mut |_| {})
            .expect("tiny model loads")
    };
    let (full, half) = (load(unmask_gpu::DType::F32), load(unmask_gpu::DType::F16));
    assert_eq!(half.model().kv_dtype, unmask_gpu::DType::F16);
    for mode in CacheMode::ALL {
        let request = Request {
            prefix_len: Some(5),
            ..Request::ids(prompt())
                .with_full_canvas()
                .with_params(params(16, 8, 8))
                .with_cache(mode)
        };
        let (a, b) = (
            full.generate(&request).unwrap(),
            half.generate(&request).unwrap(),
        );
        assert_eq!(b.ids, a.ids, "{mode}");
        assert_eq!(b.steps, a.steps, "{mode}");
        if let (Some(ra), Some(rb)) = (&a.bicache, &b.bicache) {
            // K/V of every layer plus one f32 boundary state.
            let t = rb.entry_tokens;
            let boundary = (t * full.config().d_model * 4) as u64;
            assert_eq!(ra.entry_tokens, t);
            assert_eq!(
                ra.entry_bytes,
                full.model().kv_bytes(t) + boundary,
                "{mode}"
            );
            assert_eq!(
                rb.entry_bytes,
                half.model().kv_bytes(t) + boundary,
                "{mode}"
            );
            assert_eq!(
                half.model().kv_bytes(t) * 2,
                full.model().kv_bytes(t),
                "{mode}: an f16 entry's K/V take half the bytes"
            );
            eprintln!(
                "[kv] {mode}: an entry of {t} tokens takes {} bytes in f32, {} in f16",
                ra.entry_bytes, rb.entry_bytes
            );
        }
        eprintln!("[kv] {mode}: f16 K/V commits as f32");
    }
}
