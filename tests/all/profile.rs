//! BiCache's profiler on the tiny fixture: a prefix profiled against itself is identical in
//! every layer, a prompt after it changes the deeper layers, and the table is a monotone step
//! function from r = 0 whose depths shrink as τ grows.

use crate::common;

use common::fixture_dir;

use unmask::profile::{ItemOutcome, ProfileItem, ProfileOptions, profile, profile_with};
use unmask::{Engine, EngineOptions};
use unmask_gpu::WeightFormat;

fn engine() -> Engine {
    let options = EngineOptions {
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    Engine::load_on(common::ctx(), &fixture_dir(), &options, &mut |_| {}).expect("tiny model loads")
}

fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 10 + (seed * 53 + i * 37) % 280)
        .collect()
}

/// A prefix alone (U = 0), the same prefix with a short prompt, and a short prefix with a
/// long prompt: ratios 100, 67 and 21.
fn items() -> Vec<ProfileItem> {
    let mut shared = vec![300];
    shared.extend(ids(1, 19));
    vec![
        ProfileItem::Ids {
            prefix: shared.clone(),
            rest: Vec::new(),
        },
        ProfileItem::Ids {
            prefix: shared,
            rest: ids(2, 10),
        },
        ProfileItem::Ids {
            prefix: ids(3, 8),
            rest: ids(4, 30),
        },
    ]
}

fn options(tau: f64, gen_length: usize) -> ProfileOptions {
    ProfileOptions {
        tau,
        gen_length,
        source: "tests/profile.rs".into(),
        ..ProfileOptions::default()
    }
}

#[test]
fn prefix_against_itself_is_identical_and_a_prompt_changes_deep_layers() {
    let engine = engine();
    let n_layers = engine.config().n_layers;
    let p = profile(&engine, &items(), &options(0.97, 0)).expect("profile");
    let ratios: Vec<u32> = p.similarity.iter().map(|b| b.0).collect();
    assert_eq!(ratios, [21, 67, 100]);
    for (r, samples, s) in &p.similarity {
        eprintln!("[profile] r = {r}: {samples} sample(s), s = {s:?}");
        assert_eq!(*samples, 1);
        assert_eq!(s.len(), n_layers);
        assert!(s.iter().all(|v| v.is_finite() && *v <= 1.0 + 1e-9), "{s:?}");
    }
    let alone = &p.similarity[2].2;
    assert!(
        alone.iter().all(|s| (s - 1.0).abs() < 1e-6),
        "prefix alone vs prefix alone: {alone:?}"
    );
    for (r, _, s) in &p.similarity[..2] {
        // Layer 0's K/V depend only on the token and its position; later layers see the rest.
        assert!((s[0] - 1.0).abs() < 1e-6, "r = {r}: layer 0 {}", s[0]);
        let last = s[n_layers - 1];
        assert!(last < 1.0 - 1e-6, "r = {r}: last layer {last}");
    }
    assert!(p.skipped.is_empty(), "{:?}", p.skipped);

    let t = &p.table;
    assert_eq!(t.n_layers, n_layers);
    assert_eq!(t.tau, 0.97);
    assert_eq!(t.samples_per_ratio, 1);
    assert_eq!(t.model_id, "tiny");
    assert!(
        t.ratio_definition.contains("P/(P+U)"),
        "{}",
        t.ratio_definition
    );
    assert_eq!(t.entries[0].0, 0);
    for w in t.entries.windows(2) {
        assert!(w[1].0 > w[0].0 && w[1].1 > w[0].1, "{:?}", t.entries);
    }
    assert!(t.entries.iter().all(|&(_, b)| b <= n_layers));
    // The fully shared request reuses every layer.
    assert_eq!(t.depth(100), n_layers);
    // The table round-trips through the JSON the engine reads.
    let text = serde_json::to_string(t).expect("json");
    let back = unmask_core::depth_policy::DepthTable::from_json(&text, "profile").expect("valid");
    assert_eq!(&back, t);
}

#[test]
fn a_higher_tau_never_gives_deeper_reuse() {
    let engine = engine();
    let strict = profile(&engine, &items(), &options(0.999999, 0)).expect("profile");
    let loose = profile(&engine, &items(), &options(0.5, 0)).expect("profile");
    for r in 0..=100 {
        assert!(
            strict.table.depth(r) <= loose.table.depth(r),
            "r = {r}: {:?} vs {:?}",
            strict.table.entries,
            loose.table.entries
        );
    }
    for (a, b) in strict.depths().iter().zip(loose.depths()) {
        assert!(*a <= b);
    }
}

#[test]
fn the_canvas_counts_in_the_ratio_and_chats_split_before_the_last_user_turn() {
    let engine = engine();
    let mut seen = Vec::new();
    let mut list = items();
    list.push(ProfileItem::chat(
        Some("Alice: Oslo, cat, 31. Bruno: Rome, dog, 27."),
        "Which city?",
    ));
    list.push(ProfileItem::Ids {
        prefix: Vec::new(),
        rest: ids(5, 4),
    });
    let p = profile_with(&engine, &list, &options(0.97, 16), &mut |o| {
        seen.push(o.clone())
    })
    .expect("profile");
    assert_eq!(seen.len(), list.len());
    assert_eq!(p.skipped.len(), 1);
    assert_eq!(p.skipped[0].0, 4);
    assert!(
        p.skipped[0].1.contains("no shared prefix"),
        "{:?}",
        p.skipped
    );
    assert!(p.table.ratio_definition.contains("G = 16"));
    // With 16 masks the prefix alone is no longer the whole request.
    let first = seen
        .iter()
        .find_map(|o| match o {
            ItemOutcome::Profiled(i) if i.index == 0 => Some(i.clone()),
            _ => None,
        })
        .expect("item 0 profiled");
    assert_eq!(first.ratio, 56);
    assert!(first.similarity[engine.config().n_layers - 1] < 1.0 - 1e-6);
    let chat = seen
        .iter()
        .find_map(|o| match o {
            ItemOutcome::Profiled(i) if i.index == 3 => Some(i.clone()),
            _ => None,
        })
        .expect("chat item profiled");
    assert!(chat.prefix_len > 1 && chat.rest_len > 1, "{chat:?}");
}
