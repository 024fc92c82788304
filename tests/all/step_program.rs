//! One step is one submit of a named, countable list of dispatches: its list per cache mode
//! against a golden file (a change in the step shows as a diff), and what the host creates
//! in the steady state (nothing).
//!
//! Regenerate the golden after an intended change with
//! `UNMASK_BLESS=1 cargo test --test all step_program::`.

use std::fmt::Write;
use std::sync::Arc;

use crate::common;

use unmask::{CacheMode, Engine, EngineOptions, Request};
use unmask_gpu::{ContextOptions, GpuContext, StepTrace, TraceOptions, WeightFormat};

const GOLDEN: &str = "tests/fixtures/tiny/goldens/dispatch_lists.txt";

/// The tiny fixture on a context of its own: traces and host counters are context-wide,
/// and the other tests of this binary share `common::ctx`.
fn private_engine() -> Engine {
    let ctx = GpuContext::new(&ContextOptions::default()).expect("GPU adapter");
    let options = EngineOptions {
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    Engine::load_on(
        Arc::clone(&ctx),
        &common::fixture_dir(),
        &options,
        &mut |_| {},
    )
    .expect("tiny model loads")
}

/// A request with a shared prefix (the first 12 ids), a shared span (ids 4..16, ACache's,
/// a quarter of it anchors) and two blocks, so every mode runs its block-start and its
/// cached steps.
fn request(cache: CacheMode) -> Request {
    let ids: Vec<u32> = (0..20).map(|i| 5 + (i * 7) % 250).collect();
    Request {
        prefix_len: Some(12),
        depth: Some(1),
        refresh_every: 3,
        span: (cache == CacheMode::Acache).then_some(unmask::Span::Tokens(4..16)),
        anchor_ratio: 0.25,
        ..Request::ids(ids)
            .with_full_canvas()
            .with_params(common::params(16, 8, 8))
            .with_cache(cache)
    }
}

/// Traces of one request's submits (after an untraced run that compiles the pipelines and
/// fills the prefix store).
fn trace(engine: &Engine, cache: CacheMode) -> Vec<StepTrace> {
    engine.generate(&request(cache)).expect("warm-up run");
    engine.ctx().start_trace(TraceOptions { timing: false });
    let g = engine.generate(&request(cache));
    let traces = engine.ctx().finish_trace();
    let g = g.expect("traced run");
    if cache.is_bicache() {
        let b = g.bicache.expect("BiCache report");
        assert!(b.fallback.is_none() && b.hit, "{cache}: {b:?}");
    }
    if cache == CacheMode::Acache {
        let a = g.acache.expect("ACache report");
        assert!(
            a.fallback.is_none() && a.hit && a.anchors.len() == 3,
            "{a:?}"
        );
    }
    traces
}

/// A dispatch as the golden names it: the kernel file and the fusions it carries, not the
/// tiling or weight-format variant (which depend on the adapter).
fn golden_name(kernel: &str, variant: &str) -> String {
    let file = kernel.split(':').next().unwrap_or(kernel);
    let fused: Vec<&str> = variant
        .split(',')
        .filter(|f| ["NORM", "RESIDUAL", "SWIGLU"].contains(f))
        .collect();
    let name = match file {
        // The matmul entry is the tiling the adapter chose.
        "matmul" => file.to_string(),
        _ => kernel.to_string(),
    };
    if fused.is_empty() {
        name
    } else {
        format!("{name}+{}", fused.join("+"))
    }
}

/// The dispatches of one submit, one line per run of the same dispatch.
fn body(t: &StepTrace) -> String {
    let mut lines: Vec<(String, usize)> = Vec::new();
    for d in &t.dispatches {
        let layer = d.layer.map_or("-".to_string(), |l| format!("L{l}"));
        let line = format!("  {layer} {}", golden_name(&d.kernel, &d.variant));
        match lines.last_mut() {
            Some((prev, n)) if *prev == line => *n += 1,
            _ => lines.push((line, 1)),
        }
    }
    lines
        .into_iter()
        .map(|(line, n)| {
            if n > 1 {
                format!("{line} x{n}\n")
            } else {
                format!("{line}\n")
            }
        })
        .collect()
}

fn describe(mode: CacheMode, n_layers: usize, traces: &[StepTrace]) -> String {
    let mut out = String::new();
    let mut previous = String::new();
    for (i, t) in traces.iter().enumerate() {
        let _ = writeln!(
            out,
            "== {mode} submit {} \"{}\": {} dispatches, per layer {:?}, {} copies",
            i + 1,
            t.label,
            t.dispatches.len(),
            t.per_layer(n_layers),
            t.copies
        );
        let list = body(t);
        if list == previous {
            out.push_str("  (the list of the submit before)\n");
        } else {
            out.push_str(&list);
        }
        previous = list;
    }
    out
}

#[test]
fn dispatch_lists_of_every_mode_match_the_golden() {
    let engine = private_engine();
    let n_layers = engine.config().n_layers;
    let mut text = String::from(
        "# Dispatch lists of one request per cache mode on the tiny fixture (20 prompt ids, \
         prefix 12, 16 generated in 2 blocks of 8, 8 steps; BiCache depth 1, refresh 3; ACache span 4..16, ratio 0.25).\n\
         # Regenerate: UNMASK_BLESS=1 cargo test --test all step_program::\n",
    );
    for mode in CacheMode::ALL {
        let traces = trace(&engine, mode);
        text.push_str(&describe(mode, n_layers, &traces));
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN);
    if std::env::var_os("UNMASK_BLESS").is_some() {
        std::fs::write(&path, &text).unwrap();
        eprintln!("[bless] wrote {}", path.display());
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (make it with UNMASK_BLESS=1)", path.display()));
    if want != text {
        let diff: Vec<String> = want
            .lines()
            .zip(text.lines())
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .take(10)
            .map(|(i, (a, b))| format!("line {}:\n  golden: {a}\n  now:    {b}", i + 1))
            .collect();
        panic!(
            "the dispatch lists changed ({} golden lines, {} now); first differences:\n{}\n\
             (bless an intended change with UNMASK_BLESS=1)",
            want.lines().count(),
            text.lines().count(),
            diff.join("\n")
        );
    }
}

#[test]
fn every_layer_of_a_step_is_six_dispatches() {
    let engine = private_engine();
    let n_layers = engine.config().n_layers;
    for mode in CacheMode::ALL {
        for t in trace(&engine, mode) {
            if t.label == "dllm-cache step" {
                // A refresh computes every row (QKV, RoPE, attention, O, add, gate|up,
                // down, add); computing some rows adds the gathers of QKV rows, positions,
                // arena rows and hidden rows and the two scatters (a refresh under a
                // shared prefix, whose shallow layers leave the prefix rows out); a
                // V-verify step adds the check (cosine, select, compact, store).
                let per_layer = t.per_layer(n_layers);
                assert!(
                    per_layer.iter().all(|&d| [8, 14, 18].contains(&d)),
                    "{mode}: {per_layer:?}"
                );
            }
            if t.label == "denoise step" || t.label == "bicache step" {
                // One attention dispatch per sequence window; one sequence here.
                assert_eq!(
                    t.per_layer(n_layers),
                    vec![6; n_layers],
                    "{mode} {}",
                    t.label
                );
            }
        }
    }
}

#[test]
fn a_steady_state_step_is_one_submit_and_creates_nothing() {
    let engine = private_engine();
    for mode in CacheMode::ALL {
        let traces = trace(&engine, mode);
        let steps: Vec<usize> = (0..traces.len())
            .filter(|&i| {
                ["denoise step", "bicache step", "dllm-cache step"].contains(&traces[i].label)
            })
            .collect();
        assert_eq!(steps.len(), 8, "{mode}: steps");
        // The first two steps may meet new shapes (a full pass, then a cached one); every
        // later step reuses their bind groups and buffers.
        for &i in &steps[2..] {
            let host = traces[i].host - traces[i - 1].host;
            assert_eq!(host.submits, 1, "{mode} submit {i}: {host:?}");
            assert_eq!(
                (
                    host.buffers_created,
                    host.bind_groups_created,
                    host.staging_buffers_created
                ),
                (0, 0, 0),
                "{mode} submit {i} created something: {host:?}"
            );
            assert_eq!(host.dispatches as usize, traces[i].dispatches.len());
        }
    }
}

#[test]
fn dropped_buffers_leave_the_bind_group_cache() {
    let engine = private_engine();
    engine.generate(&request(CacheMode::None)).unwrap();
    let after_one = engine.ctx().cached_bind_groups();
    for _ in 0..3 {
        engine.generate(&request(CacheMode::None)).unwrap();
    }
    // Each request's state is new buffers; the groups of the last request's are purged at
    // the next submit, so the cache does not grow with the number of requests.
    let after_four = engine.ctx().cached_bind_groups();
    assert!(
        after_four <= after_one + after_one / 2,
        "bind groups grew from {after_one} to {after_four} over three more requests"
    );
}

#[test]
fn timed_traces_say_which_clock_and_keep_the_answer() {
    let engine = private_engine();
    let want = engine.generate(&request(CacheMode::FastDllmDual)).unwrap();
    engine.ctx().start_trace(TraceOptions { timing: true });
    let got = engine.generate(&request(CacheMode::FastDllmDual));
    let traces = engine.ctx().finish_trace();
    assert_eq!(got.unwrap().ids, want.ids, "timing changed the tokens");
    let clock = if engine.ctx().has_timestamps() {
        unmask_gpu::TraceClock::GpuTimestamps
    } else {
        unmask_gpu::TraceClock::CpuWallClock
    };
    eprintln!("[path] dispatch times from {}", clock.name());
    for t in &traces {
        assert_eq!(t.clock, clock);
        assert!(
            t.dispatches
                .iter()
                .all(|d| d.ms.is_some_and(|ms| ms >= 0.0)),
            "{}: a dispatch without a time",
            t.label
        );
    }
}
