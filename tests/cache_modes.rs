//! Cache modes within a request. With `recompute_all` every mode must give exactly the
//! tokens of `none` (the plan plumbing — row ranges, arena offsets, sampled-row indices — is
//! exact); without it, each mode's token-layer passes follow its formula.

mod common;

use common::{params, same_tokens};
use unmask::{CacheMode, Engine, GenerationParams, Request};

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

#[test]
fn every_mode_recomputing_everything_equals_none() {
    let engine = engine();
    for (p, cfg) in [(params(16, 16, 4), 0.0), (params(12, 6, 6), 1.0)] {
        let p = GenerationParams {
            cfg_scale: cfg,
            ..p
        };
        let reference = engine
            .generate(&Request::ids(prompt()).with_params(p.clone()))
            .unwrap();
        for mode in CacheMode::ALL {
            let mut req = Request::ids(prompt())
                .with_params(p.clone())
                .with_cache(mode);
            req.recompute_all = true;
            let out = engine.generate(&req).unwrap();
            assert_eq!(
                out.ids, reference.ids,
                "{mode} with recompute_all (cfg {cfg})"
            );
        }
        eprintln!("[plumbing] all modes equal none, cfg {cfg}");
    }
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
        .generate(&Request::ids(prompt()).with_params(params(gen_len, steps, block)))
        .unwrap();
    // BiCache modes are covered by tests/bicache.rs.
    let single_pass = [
        CacheMode::None,
        CacheMode::FastDllmPrefix,
        CacheMode::FastDllmDual,
        CacheMode::PrefixArm,
    ];
    for mode in single_pass {
        let mut req = Request::ids(prompt())
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
            CacheMode::Bicache | CacheMode::BicacheDual => unreachable!("not in the list above"),
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
            !out.ids.contains(&engine.special.mask),
            "{mode}: the canvas is complete"
        );
    }
}

#[test]
fn cached_modes_refuse_masks_in_the_prompt() {
    let engine = engine();
    let mut p = prompt();
    p[8] = engine.special.mask;
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
        .with_params(params(8, 8, 8))
        .with_cache(CacheMode::PrefixArm);
    req.prefix_len = Some(1000);
    let err = engine.generate(&req).unwrap_err().to_string();
    assert!(err.contains("1000"), "{err}");
}
