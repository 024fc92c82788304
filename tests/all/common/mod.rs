//! Shared helpers of the integration tests: one GPU context per test binary, seeded random
//! inputs (never zeros), and error measures that are printed next to their tolerance.
#![allow(dead_code)]

pub mod attention;
pub mod matmul;
pub mod select;
pub mod steps;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use unmask_core::rng::SplitMix64;
use unmask_gpu::{ContextOptions, GpuContext};

/// Whether kernels keep wgpu's runtime bounds checks: `UNMASK_SHADER_CHECKS=off` runs the
/// tests over kernels compiled without them (scripts/test.sh runs the kernel tests both ways).
pub fn shader_checks() -> bool {
    std::env::var("UNMASK_SHADER_CHECKS").map_or(true, |v| v != "off")
}

/// The fragment side the `coop` matmul must run with here, from `UNMASK_COOP_FRAGMENT`
/// (8 or 16), or `None` to take the adapter's. When it is set the tests also require
/// cooperative matrices to be on: scripts/test.sh runs the matmul and model tests so on
/// Mesa 26's lavapipe (`scripts/lavapipe-coop.sh`) with either side, and a fallback to
/// `gemm` must not pass for them.
pub fn coop_fragment() -> Option<u32> {
    let value = std::env::var("UNMASK_COOP_FRAGMENT").ok()?;
    match value.parse() {
        Ok(side @ (8 | 16)) => Some(side),
        _ => panic!("UNMASK_COOP_FRAGMENT={value:?}: expected 8 or 16"),
    }
}

pub fn options() -> ContextOptions {
    ContextOptions {
        runtime_checks: shader_checks(),
        cooperative_fragment: coop_fragment(),
        ..ContextOptions::default()
    }
}

/// The test binary's GPU context; prints which adapter and precision paths are in use.
pub fn ctx() -> Arc<GpuContext> {
    static CTX: OnceLock<Arc<GpuContext>> = OnceLock::new();
    CTX.get_or_init(|| {
        let ctx = GpuContext::new(&options())
            .unwrap_or_else(|e| panic!("tests need a GPU adapter (lavapipe in CI): {e}"));
        eprintln!(
            "[gpu] {} runtime_checks={}",
            ctx.describe(),
            ctx.runtime_checks
        );
        ctx
    })
    .clone()
}

/// A context whose kernels may bind at most `bytes`, to force the chunked-weight path.
pub fn ctx_with_binding_limit(bytes: u64) -> Arc<GpuContext> {
    GpuContext::new(&ContextOptions {
        max_binding_bytes: Some(bytes),
        ..options()
    })
    .expect("GPU adapter")
}

/// A context whose device allows only `bytes` of workgroup memory per workgroup (the
/// browser's 16 KiB), so kernels that size their tiles by the limit take the small ones.
pub fn ctx_with_workgroup_storage(bytes: u32) -> Arc<GpuContext> {
    GpuContext::new(&ContextOptions {
        max_workgroup_storage_bytes: Some(bytes),
        ..options()
    })
    .expect("GPU adapter")
}

/// `n` values uniform in [-scale, scale), none exactly zero.
pub fn random_vec(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|_| {
            let v = ((rng.next_f64() * 2.0 - 1.0) as f32) * scale;
            if v == 0.0 { scale * 1e-3 } else { v }
        })
        .collect()
}

/// max |got - want| / max |want|: a norm-wise relative error that does not blow up on
/// entries near zero.
pub fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let scale = want
        .iter()
        .map(|w| w.abs() as f64)
        .fold(0.0, f64::max)
        .max(1e-30);
    let diff = got
        .iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_nan() || w.is_nan() {
                f64::INFINITY
            } else {
                (*g as f64 - *w as f64).abs()
            }
        })
        .fold(0.0, f64::max);
    diff / scale
}

/// Asserts the relative error is within `tol` and prints the measurement either way.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let err = relative_error(got, want);
    eprintln!("[check] {what}: relative error {err:.3e} (tolerance {tol:.0e})");
    assert!(
        err <= tol,
        "{what}: relative error {err:.3e} exceeds {tol:.0e}"
    );
}

/// The tiny random LLaDA checkpoint and its goldens (tools/make_fixture.py).
pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny")
}

/// The LLaDA checkpoint with one 256-wide head and its goldens
/// (tools/make_wide_head_fixture.py).
pub fn wide_head_fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-wide-heads")
}

/// The tiny fixture loaded with f32 weights on the shared context.
pub fn tiny_engine() -> unmask::Engine {
    tiny_engine_on(ctx())
}

/// The tiny fixture loaded with f32 weights on `ctx` (one with other limits, or a
/// context of the test's own whose counters no other test touches).
pub fn tiny_engine_on(ctx: Arc<GpuContext>) -> unmask::Engine {
    let options = unmask::EngineOptions {
        weight_format: unmask_gpu::WeightFormat::F32,
        ..unmask::EngineOptions::default()
    };
    unmask::Engine::load_on(ctx, &fixture_dir(), &options, &mut |_| {}).expect("tiny model loads")
}

/// A shared "system" prefix of 24 tokens on the tiny fixture's vocabulary.
pub fn shared_prefix() -> Vec<u32> {
    let mut p = vec![300, 302, 40, 41, 303];
    p.extend((0..18u32).map(|i| 50 + (i * 37) % 200));
    p.push(304);
    p
}

/// `shared_prefix()` then a per-request question (9 tokens) numbered `question`.
pub fn shared_prefix_prompt(question: u32) -> Vec<u32> {
    let mut p = shared_prefix();
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

/// The bundled model (models/tiny) with the default options.
pub fn bundled_engine() -> unmask::Engine {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    unmask::Engine::load_on(
        ctx(),
        &root.join("models/tiny"),
        &unmask::EngineOptions::default(),
        &mut |_| {},
    )
    .expect("models/tiny loads")
}

/// The reference sampler's golden cases on the tiny fixture (read with
/// `unmask_goldens`).
pub fn golden_cases() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixture_dir().join("goldens/generate.json")).unwrap();
    unmask_goldens::cases(&text)
}

/// Default parameters with this schedule, ranking unrounded confidences so that cache
/// modes can be compared token for token.
pub fn params(gen_len: usize, steps: usize, block: usize) -> unmask::GenerationParams {
    unmask::GenerationParams {
        gen_length: gen_len,
        steps,
        block_length: block,
        round_confidence_bf16: false,
        ..unmask::GenerationParams::default()
    }
}

/// How many positions of two generations hold the same token.
pub fn same_tokens(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x == y).count()
}

/// The tiny random Dream checkpoint and its goldens (tools/make_dream_fixture.py).
pub fn dream_fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-dream")
}

/// The tiny Dream fixture loaded with f32 weights on the shared context.
pub fn tiny_dream_engine() -> unmask::Engine {
    let options = unmask::EngineOptions {
        weight_format: unmask_gpu::WeightFormat::F32,
        ..unmask::EngineOptions::default()
    };
    unmask::Engine::load_on(ctx(), &dream_fixture_dir(), &options, &mut |_| {})
        .expect("tiny Dream model loads")
}

/// The Dream reference sampler's golden cases (tools/dream_ref.py).
pub fn dream_golden_cases() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dream_fixture_dir().join("goldens/generate.json")).unwrap();
    unmask_goldens::cases(&text)
}

/// A JSON array of rows (golden logits) as one flat f32 vector.
pub fn flat(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
        })
        .collect()
}
