//! DiffusionGemma on the tiny fixture (tests/fixtures/tiny-dgemma, made with the transformers
//! reference): encoder, commit and decoder logits — with and without self-conditioning, with a
//! prompt longer than the sliding window — within 1e-3 of the reference's float32 goldens,
//! relative to the largest logit.

use std::path::PathBuf;

use serde_json::Value;
use unmask_core::checkpoint::Checkpoint;
use unmask_gpu::dgemma::DgemmaModel;
use unmask_gpu::{DType, WeightFormat};

use crate::common;

fn fixture() -> PathBuf {
    common::fixture_dir().with_file_name("tiny-dgemma")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn logits_match_the_reference_in_every_pass() {
    check_logits(DType::F32, 1e-3, &[]);
}

/// Pinned kernels (`--matmul`, `--attention`) run every pass of the family too.
#[test]
fn logits_match_the_reference_with_pinned_kernels() {
    use unmask_gpu::ops::attention::AttentionKernel;
    use unmask_gpu::ops::matmul::MatmulKernel;
    for (matmul, attention) in [
        (MatmulKernel::Naive, AttentionKernel::Register),
        (MatmulKernel::Gemm, AttentionKernel::WideSplit),
        (MatmulKernel::CoopSplit, AttentionKernel::CoopSplit),
    ] {
        check_logits_with(DType::F32, 1e-3, &[], &|m: &mut DgemmaModel| {
            m.kernels.matmul = matmul;
            m.kernels.attention = attention;
        });
    }
}

/// `--tune always`: the tuner times `Auto`'s candidates for each of the family's matmul and
/// attention shape classes, and whatever wins keeps the logits.
#[test]
fn logits_match_the_reference_with_measured_kernels() {
    use unmask_gpu::ops::{KernelOptions, Kernels};
    use unmask_gpu::tune::TunePolicy;
    let dir = std::env::temp_dir().join(format!("unmask-dgemma-tune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = KernelOptions {
        tune: TunePolicy::Always,
        tune_file: Some(dir.join("kernels.json")),
        ..KernelOptions::default()
    };
    let kernels = Kernels::new(&common::ctx(), &options);
    check_logits_with(DType::F32, 1e-3, &[], &|m: &mut DgemmaModel| {
        m.kernels = kernels.clone();
    });
    let classes: Vec<String> = kernels
        .tuner
        .entries()
        .into_iter()
        .map(|(c, _)| c)
        .collect();
    assert!(
        classes.iter().any(|c| c.starts_with("matmul"))
            && classes.iter().any(|c| c.starts_with("attention")),
        "matmul and attention classes measured: {classes:?}"
    );
    assert!(dir.join("kernels.json").is_file(), "the winners are kept");
    eprintln!(
        "[dgemma] --tune always: {} shape classes measured, logits within 1e-3",
        classes.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// K/V stored in f16 (`--kv f16`): every pass's logits stay near the reference (measured:
/// 2–5e-4 for the encoder and commit passes, 2e-3 for the decoder, 3.3e-2 for a decoder with
/// self-conditioning, where the rounding moves one of the random fixture's thin router
/// margins — its smallest top-2 margin is 0.0022 — and a row takes another expert).
#[test]
fn logits_with_f16_k_v_stay_near_the_reference() {
    check_logits(DType::F16, 5e-3, &[("dec.p24_c2_sc", 5e-2)]);
}

fn check_logits(kv: DType, tolerance: f64, exceptions: &[(&str, f64)]) {
    check_logits_with(kv, tolerance, exceptions, &|_| {});
}

/// Every logits case within `tolerance` (`exceptions`: a case's own bound), the model set
/// up by `setup`.
fn check_logits_with(
    kv: DType,
    tolerance: f64,
    exceptions: &[(&str, f64)],
    setup: &dyn Fn(&mut DgemmaModel),
) {
    let dir = fixture();
    let ctx = common::ctx();
    let mut model =
        DgemmaModel::load(&ctx, &dir, WeightFormat::F32, 64).expect("tiny DiffusionGemma loads");
    model.kv_dtype = kv;
    setup(&mut model);
    let v = model.cfg.vocab_size;
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("goldens/logits.json")).unwrap())
            .unwrap();
    let bytes = std::fs::read(dir.join("goldens/logits.safetensors")).unwrap();
    let goldens = Checkpoint::from_bytes(vec![("model.safetensors".into(), bytes)], None).unwrap();
    let golden = |name: &str, rows: usize| {
        let t = goldens.tensor(name, &[rows, v]).unwrap();
        let mut out = vec![0.0; rows * v];
        t.read_f32(0, &mut out);
        out
    };
    let cases = meta["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 8, "the fixture's logits cases");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let prompt = ids(&case["prompt"]);
        let mut cache = model.new_cache(&ctx, 64).unwrap();
        let got = match case["pass"].as_str().unwrap() {
            "encoder" => model
                .encode(&ctx, &mut cache, &prompt, true)
                .unwrap()
                .unwrap(),
            "commit" => {
                model.encode(&ctx, &mut cache, &prompt, false).unwrap();
                assert_eq!(cache.len, case["start"].as_u64().unwrap() as usize);
                let canvas = ids(&case["canvas"]);
                model
                    .encode(&ctx, &mut cache, &canvas, true)
                    .unwrap()
                    .unwrap()
            }
            "decoder" => {
                model.encode(&ctx, &mut cache, &prompt, false).unwrap();
                for commit in case["commits"].as_array().unwrap() {
                    model.encode(&ctx, &mut cache, &ids(commit), false).unwrap();
                }
                assert_eq!(cache.len, case["start"].as_u64().unwrap() as usize);
                let canvas = ids(&case["canvas"]);
                let sc = case["self_conditioning"]
                    .as_str()
                    .map(|n| golden(n, canvas.len()));
                model.decode(&ctx, &cache, &canvas, sc.as_deref()).unwrap()
            }
            other => panic!("unknown pass {other}"),
        };
        let rows = got.len() / v;
        assert!(cache.k.iter().all(|t| t.dtype == kv));
        common::assert_close(
            &format!(
                "DiffusionGemma {name} ({rows} rows, {kv:?} K/V, {:?} / {:?})",
                model.kernels.matmul, model.kernels.attention
            ),
            &got,
            &golden(name, rows),
            exceptions
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(tolerance, |e| e.1),
        );
    }
}

/// The sliding layers' K/V: a cache keeping only W - 1 + 16 rows (moving them as the
/// prompt's pieces and the commits arrive) gives the encoder, commit and decoder the same
/// logits as one keeping every position, bit for bit, and allocates what `kv_cache_bytes`
/// predicts.
#[test]
fn sliding_layers_keep_only_their_window() {
    use unmask_gpu::dgemma::kv_cache_bytes;
    let ctx = common::ctx();
    let mut model = DgemmaModel::load(&ctx, &fixture(), WeightFormat::F32, 256).unwrap();
    let w = model.cfg.sliding_window;
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 250 + 3).collect();
    let canvas: Vec<u32> = (0..16).map(|i| (i * 11 + 2) % 250 + 3).collect();
    let run = |model: &DgemmaModel| {
        let mut cache = model.new_cache(&ctx, 200).unwrap();
        let mut out = model
            .encode(&ctx, &mut cache, &prompt, true)
            .unwrap()
            .unwrap();
        for _ in 0..3 {
            out.extend(
                model
                    .encode(&ctx, &mut cache, &canvas, true)
                    .unwrap()
                    .unwrap(),
            );
            out.extend(model.decode(&ctx, &cache, &canvas, None).unwrap());
        }
        let bytes: u64 = cache.k.iter().chain(&cache.v).map(|t| t.size_bytes()).sum();
        (out, bytes, cache.sliding_base, cache.sliding_rows)
    };
    model.pass_rows = 512;
    let (every, every_bytes, base, rows) = run(&model);
    assert_eq!(
        (base, rows),
        (0, 200),
        "a cache of 200 positions never moves"
    );
    model.pass_rows = 16;
    let (windowed, bytes, base, rows) = run(&model);
    assert_eq!(rows, w - 1 + 16);
    // Moved before each pass that would overflow: the last move kept positions 65.. (the
    // last W - 1 before the third commit), and every position since.
    let len = 40 + 3 * 16;
    assert_eq!(base, len - 16 - (w - 1), "the rows kept at the last move");
    assert_eq!(bytes, kv_cache_bytes(&model.cfg, 200, 16, DType::F32));
    assert!(bytes < every_bytes, "{bytes} vs {every_bytes}");
    assert_eq!(
        windowed, every,
        "the same logits with the window's rows only"
    );
    // The same in f16: rows move bit for bit, in half the bytes, near the f32 logits.
    model.kv_dtype = DType::F16;
    model.pass_rows = 512;
    let (every16, _, _, _) = run(&model);
    model.pass_rows = 16;
    let (windowed16, bytes16, _, _) = run(&model);
    assert_eq!(windowed16, every16, "f16: the window's rows only");
    assert_eq!(
        (bytes16, 2 * bytes16),
        (kv_cache_bytes(&model.cfg, 200, 16, DType::F16), bytes)
    );
    common::assert_close(
        "DiffusionGemma f16 K/V against f32",
        &windowed16,
        &every,
        1e-2,
    );
    eprintln!(
        "[check] DiffusionGemma sliding cache: {} logits equal, K/V {bytes} bytes instead of {every_bytes}",
        every.len()
    );
}

/// The shared prefix store: a prompt whose system part is stored encodes only the rest and
/// gives the decoder the very same logits as encoding it afresh; another prefix is never
/// served from an entry that is not its own; the budget evicts the least recently used.
#[test]
fn stored_prompt_prefixes_are_exact_and_never_cross_prompts() {
    use unmask_gpu::dgemma::{DgemmaPrefixStore, PrefixUse};
    let ctx = common::ctx();
    let model = DgemmaModel::load(&ctx, &fixture(), WeightFormat::F32, 64).unwrap();
    let system: Vec<u32> = vec![2, 105, 90, 88, 271, 209, 60, 77, 282, 289, 302, 231];
    let other: Vec<u32> = vec![2, 105, 90, 88, 271, 209, 60, 77, 282, 289, 302, 15];
    let user_a = [231u32, 79, 90, 82];
    let user_b = [84u32, 93, 231];
    let canvas: Vec<u32> = (0..16).map(|i| 40 + 7 * i).collect();
    let prompt = |head: &[u32], tail: &[u32]| [head, tail].concat();
    let decode = |p: &[u32], shared: usize, store: Option<&mut DgemmaPrefixStore>| {
        let mut cache = model.new_cache(&ctx, 64).unwrap();
        let used = match store {
            Some(s) => model.encode_prompt(&ctx, &mut cache, p, shared, s).unwrap(),
            None => {
                model.encode(&ctx, &mut cache, p, false).unwrap();
                PrefixUse::Uncached
            }
        };
        (used, model.decode(&ctx, &cache, &canvas, None).unwrap())
    };
    let mut store = DgemmaPrefixStore::new(30, u64::MAX);
    let (used, first) = decode(&prompt(&system, &user_a), system.len(), Some(&mut store));
    assert_eq!(used, PrefixUse::Stored { tokens: 12 });
    let (used, again) = decode(&prompt(&system, &user_a), system.len(), Some(&mut store));
    assert_eq!(used, PrefixUse::Hit { reused: 12 });
    assert_eq!(
        again, first,
        "a stored prefix gives the same logits bit for bit"
    );
    let (_, whole) = decode(&prompt(&system, &user_a), 0, None);
    common::assert_close(
        "stored prefix against one encoder pass",
        &first,
        &whole,
        1e-5,
    );
    // Another question after the same system prompt reuses it; another system prompt does not.
    let (used, b) = decode(&prompt(&system, &user_b), system.len(), Some(&mut store));
    assert_eq!(used, PrefixUse::Hit { reused: 12 });
    let (_, b_whole) = decode(&prompt(&system, &user_b), 0, None);
    common::assert_close("second question", &b, &b_whole, 1e-5);
    let (used, o) = decode(&prompt(&other, &user_a), other.len(), Some(&mut store));
    assert_eq!(used, PrefixUse::Stored { tokens: 12 });
    let (_, o_whole) = decode(&prompt(&other, &user_a), 0, None);
    common::assert_close("other system prompt", &o, &o_whole, 1e-5);
    assert!(
        common::relative_error(&o, &first) > 1e-3,
        "another prefix's logits differ"
    );
    assert_eq!((store.hits, store.misses, store.len()), (2, 2, 2));
    // A third 12-token prefix passes the 30-token budget: the least recently used goes.
    let third: Vec<u32> = system.iter().map(|t| t + 1).collect();
    decode(&prompt(&third, &user_a), third.len(), Some(&mut store));
    assert_eq!((store.len(), store.tokens()), (2, 24));
    let (used, _) = decode(&prompt(&system, &user_a), system.len(), Some(&mut store));
    assert_eq!(
        used,
        PrefixUse::Stored { tokens: 12 },
        "the oldest entry was evicted"
    );
    // A byte budget: two entries' bytes hold two, a third evicts; one entry over it alone is
    // never stored.
    let one = store.bytes() / 2;
    let mut small = DgemmaPrefixStore::new(1000, 2 * one);
    for head in [&system, &other, &third] {
        let (used, _) = decode(&prompt(head, &user_a), 12, Some(&mut small));
        assert_eq!(used, PrefixUse::Stored { tokens: 12 });
    }
    assert_eq!((small.len(), small.bytes()), (2, 2 * one));
    let mut tiny = DgemmaPrefixStore::new(1000, one - 1);
    let (used, _) = decode(&prompt(&system, &user_a), 12, Some(&mut tiny));
    assert_eq!((used, tiny.len()), (PrefixUse::Uncached, 0));
    // Bad input is refused by name.
    let mut cache = model.new_cache(&ctx, 8).unwrap();
    let err = model
        .encode_prompt(&ctx, &mut cache, &prompt(&system, &user_a), 12, &mut store)
        .unwrap_err()
        .to_string();
    assert!(err.contains("8 positions"), "{err}");
}

/// Gemma 4's chat layout with the fixture's tokenizer gives the reference template's text and
/// ids for every recorded conversation (system turn, multi-turn with a thought stripped,
/// thinking on).
#[test]
fn the_chat_layout_gives_the_reference_ids() {
    use unmask_core::chat::{Message, Role};
    use unmask_core::gemma_chat;
    use unmask_core::tokenizer::Tokenizer;
    let dir = fixture();
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("chat_template_cases.json")).unwrap(),
    )
    .unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 4);
    for case in cases {
        let messages: Vec<Message> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let role = match m["role"].as_str().unwrap() {
                    "system" => Role::System,
                    "user" => Role::User,
                    _ => Role::Assistant,
                };
                Message::new(role, m["content"].as_str().unwrap())
            })
            .collect();
        let thinking = case["enable_thinking"].as_bool().unwrap();
        let name = case["name"].as_str().unwrap();
        assert_eq!(
            gemma_chat::render(&messages, thinking),
            case["rendered"].as_str().unwrap(),
            "{name}: text"
        );
        assert_eq!(
            gemma_chat::encode(&tokenizer, &messages, thinking).unwrap(),
            ids(&case["ids"]),
            "{name}: ids"
        );
    }
}

/// The weights in every format: the loader allocates what `weight_bytes` predicts; with f16
/// weights (which hold the bf16 checkpoint exactly) the decoder gives the reference's logits,
/// and with q8 / q4 those of an f32 model whose matrices were rounded through the same
/// quantization on the host (the tiny random model itself moves by 16 % / 92 % under q8 / q4).
#[test]
fn every_weight_format_loads_the_predicted_bytes_and_decodes() {
    use unmask_gpu::dgemma::weight_bytes;
    let dir = fixture();
    let ctx = common::ctx();
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("goldens/logits.json")).unwrap())
            .unwrap();
    let case = meta["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "dec.p24_c2")
        .unwrap();
    let bytes = std::fs::read(dir.join("goldens/logits.safetensors")).unwrap();
    let goldens = Checkpoint::from_bytes(vec![("model.safetensors".into(), bytes)], None).unwrap();
    let mut want = vec![0.0; 16 * 320];
    goldens
        .tensor("dec.p24_c2", &[16, 320])
        .unwrap()
        .read_f32(0, &mut want);
    for (format, tol) in [
        (WeightFormat::F32, 1e-5),
        (WeightFormat::F16Packed, 1e-5),
        (WeightFormat::Q8, 1e-4),
        (WeightFormat::Q4, 1e-4),
    ] {
        let model = DgemmaModel::load(&ctx, &dir, format, 64).unwrap();
        let predicted = weight_bytes(&model.cfg, format.resolve(&ctx));
        let held = model.weights.size_bytes();
        // Each buffer rounds up to 16 bytes: at most 16 per tensor more than predicted.
        assert!(
            predicted <= held && held <= predicted + 16 * 100,
            "{}: {held} bytes held, {predicted} predicted",
            format.name()
        );
        let run = |m: &DgemmaModel| {
            let mut cache = m.new_cache(&ctx, 64).unwrap();
            m.encode(&ctx, &mut cache, &ids(&case["prompt"]), false)
                .unwrap();
            m.decode(&ctx, &cache, &ids(&case["canvas"]), None).unwrap()
        };
        let got = run(&model);
        let want = match format.quant() {
            Some(q) => run(&DgemmaModel::load_dequantized(&ctx, &dir, q, 64).unwrap()),
            None => want.clone(),
        };
        common::assert_close(
            &format!("dec.p24_c2 with {} weights ({held} bytes)", format.name()),
            &got,
            &want,
            tol,
        );
    }
    // The token table in its own format (`--embed-weights`): f32 layers, a q8 table.
    let options = unmask::EngineOptions {
        weight_format: WeightFormat::F32,
        embed_format: Some(WeightFormat::Q8),
        ..unmask::EngineOptions::default()
    };
    let engine = unmask::DgemmaEngine::load(&dir, &options).unwrap();
    let mixed = unmask::WeightFormats {
        layers: WeightFormat::F32,
        embed: WeightFormat::Q8,
    };
    let (predicted, held) = (
        weight_bytes(&engine.config().clone(), mixed),
        engine.model().weights.size_bytes(),
    );
    assert_eq!(engine.weight_bytes(), predicted);
    assert!(predicted <= held && held <= predicted + 16 * 100);
    assert!(predicted < weight_bytes(engine.config(), WeightFormat::F32));
    let m = engine.model();
    let mut cache = m.new_cache(engine.ctx(), 64).unwrap();
    m.encode(engine.ctx(), &mut cache, &ids(&case["prompt"]), false)
        .unwrap();
    let got = m
        .decode(engine.ctx(), &cache, &ids(&case["canvas"]), None)
        .unwrap();
    // Only the table rounded: within what rounding every matrix to q8 moves the logits.
    let all_q8 = DgemmaModel::load(&ctx, &dir, WeightFormat::Q8, 64).unwrap();
    let mut cache = all_q8.new_cache(&ctx, 64).unwrap();
    all_q8
        .encode(&ctx, &mut cache, &ids(&case["prompt"]), false)
        .unwrap();
    let every = all_q8
        .decode(&ctx, &cache, &ids(&case["canvas"]), None)
        .unwrap();
    let (table_err, every_err) = (
        common::relative_error(&got, &want),
        common::relative_error(&every, &want),
    );
    eprintln!(
        "[check] dec.p24_c2: a q8 token table moves the logits by {table_err:.2e}, every matrix \
         in q8 by {every_err:.2e}"
    );
    assert!(
        table_err > 0.0 && table_err <= every_err,
        "{table_err} vs {every_err}"
    );
}
