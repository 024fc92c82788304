//! The tiny model with quantized weights: it generates, its logits stay close to the f16
//! model's, and the GPU memory its weights take is what `weight_bytes` predicts.

use crate::common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use common::{assert_close, ctx, ctx_with_binding_limit, fixture_dir};
use unmask::{Engine, EngineOptions, GenerationParams, Request};
use unmask_core::config::ModelConfig;
use unmask_core::quant::{self, QuantFormat};
use unmask_core::safetensors_writer::{Dtype, SafetensorsWriter, TensorDecl};
use unmask_gpu::model::{Checkpoint, ModelWeights, WeightFormats, weight_bytes};
use unmask_gpu::{GpuContext, WeightFormat};

fn engine(format: WeightFormat) -> Engine {
    let options = EngineOptions {
        weight_format: format,
        ..EngineOptions::default()
    };
    Engine::load_on(ctx(), &fixture_dir(), &options, &mut |_| {}).expect("tiny model loads")
}

fn prompt() -> Vec<u32> {
    (0..24u32).map(|i| (i * 37 + 11) % 300).collect()
}

/// Writes a float32 copy of the fixture whose matrices are the `format`-dequantized ones.
fn write_dequantized(dir: &Path, format: QuantFormat) {
    let cfg = ModelConfig::from_file(fixture_dir().join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&fixture_dir()).unwrap();
    let specs = cfg.tensor_specs();
    let decls = specs
        .iter()
        .map(|(name, shape)| TensorDecl::new(name, Dtype::F32, shape.clone()))
        .collect();
    let file = File::create(dir.join("model.safetensors")).unwrap();
    let mut w = SafetensorsWriter::new(BufWriter::new(file), &BTreeMap::new(), decls).unwrap();
    for (name, shape) in &specs {
        let t = ckpt.tensor(name, shape).unwrap();
        let mut values = vec![0f32; t.numel()];
        t.read_f32(0, &mut values);
        if let &[rows, cols] = shape.as_slice() {
            let mut codes = vec![0u8; rows * format.row_code_bytes(cols)];
            let mut scales = vec![0u8; rows * quant::row_scale_bytes(cols)];
            format
                .quantize_rows(&values, cols, &mut codes, &mut scales)
                .unwrap();
            values = format.dequantize_rows(&codes, &scales, rows, cols);
        }
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.write(&bytes).unwrap();
    }
    w.finish().unwrap();
    std::fs::copy(fixture_dir().join("config.json"), dir.join("config.json")).unwrap();
}

/// The fixture with `format`-dequantized matrices, loaded with f32 weights: the reference
/// a quantized model must reproduce.
fn dequantized_engine(format: QuantFormat, test: &str) -> Engine {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("dequantized_{}_{test}", format.name()));
    std::fs::create_dir_all(&dir).unwrap();
    write_dequantized(&dir, format);
    Engine::load_on(
        ctx(),
        &dir,
        &EngineOptions {
            weight_format: WeightFormat::F32,
            ..EngineOptions::default()
        },
        &mut |_| {},
    )
    .unwrap()
}

#[test]
fn quantized_model_matches_f32_model_of_dequantized_weights() {
    // The whole forward pass on quantized weights (embedding gather, every matmul, LM head)
    // against the f32 path on the same values: only kernel error remains.
    let ids = prompt();
    for (format, q) in [
        (WeightFormat::Q8, QuantFormat::Q8),
        (WeightFormat::Q4, QuantFormat::Q4),
    ] {
        let want = dequantized_engine(q, "logits")
            .model()
            .logits(&ids)
            .unwrap();
        let got = engine(format).model().logits(&ids).unwrap();
        assert_close(
            &format!(
                "tiny model {} logits vs f32 on dequantized weights",
                format.name()
            ),
            &got,
            &want,
            1e-4,
        );
    }
}

/// (max, median) of |a - b| and the rows whose argmax agrees.
fn compare(a: &[f32], b: &[f32], vocab: usize) -> (f32, f32, usize) {
    let mut d: Vec<f32> = a.iter().zip(b).map(|(x, y)| (x - y).abs()).collect();
    d.sort_by(f32::total_cmp);
    let argmax = |row: &[f32]| {
        (0..row.len())
            .max_by(|&i, &j| row[i].total_cmp(&row[j]).then(j.cmp(&i)))
            .unwrap()
    };
    let agree = a
        .chunks(vocab)
        .zip(b.chunks(vocab))
        .filter(|(x, y)| argmax(x) == argmax(y))
        .count();
    (d[d.len() - 1], d[d.len() / 2], agree)
}

#[test]
fn quantized_logits_stay_close_to_f16() {
    let ids = prompt();
    let reference = engine(WeightFormat::F16Packed);
    let vocab = reference.config().embedding_size;
    let f16 = reference.model().logits(&ids).unwrap();
    let mean = f16.iter().map(|v| v.abs()).sum::<f32>() / f16.len() as f32;
    // Bounds about twice the measured differences. The tiny model's random weights make it
    // sensitive: q8 embedding and head alone move the median logit by ~2 %.
    for (format, max_bound, median_bound) in
        [(WeightFormat::Q8, 1.5, 0.25), (WeightFormat::Q4, 12.0, 3.0)]
    {
        let q = engine(format).model().logits(&ids).unwrap();
        let (max, median, agree) = compare(&q, &f16, vocab);
        eprintln!(
            "[check] tiny model {} logits vs f16: max abs diff {max:.4} (bound {max_bound}), median {median:.4} (bound {median_bound}), mean |logit| {mean:.2}, argmax equal in {agree} of {} rows",
            format.name(),
            ids.len()
        );
        assert!(
            max <= max_bound && median <= median_bound,
            "{}",
            format.name()
        );
    }
}

#[test]
fn q8_model_generates() {
    let params = GenerationParams {
        gen_length: 32,
        steps: 32,
        block_length: 16,
        ..GenerationParams::default()
    };
    let request = Request::ids(prompt()).with_params(params);
    let q8_engine = engine(WeightFormat::Q8);
    assert_eq!(
        q8_engine.model().weights.formats(),
        WeightFormats::uniform(WeightFormat::Q8)
    );
    let q8 = q8_engine.generate(&request).unwrap();
    assert_eq!(q8.ids.len(), 32);
    assert!(!q8.ids.contains(&q8_engine.special().mask));
    // Same tokens as the f32 model on the dequantized weights; f16's differ only through
    // the quantization (a random model's confidences are close, so many flip).
    let reference = dequantized_engine(QuantFormat::Q8, "generate")
        .generate(&request)
        .unwrap();
    assert_eq!(q8.ids, reference.ids, "q8 vs f32 on dequantized weights");
    let f16 = engine(WeightFormat::F16Packed).generate(&request).unwrap();
    let same = common::same_tokens(&q8.ids, &f16.ids);
    eprintln!(
        "[check] tiny model q8 generation: 32 tokens equal to the dequantized f32 model's, {same} of 32 equal to f16's"
    );
}

/// Live storage bytes the weights add on a fresh context, against `weight_bytes`.
fn check_memory(ctx: &GpuContext, formats: WeightFormats) {
    let cfg = ModelConfig::from_file(fixture_dir().join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&fixture_dir()).unwrap();
    let predicted = weight_bytes(&cfg, formats, ctx.features.max_binding_bytes).unwrap();
    let before = ctx.memory.live_bytes();
    let weights = ModelWeights::load(ctx, &cfg, &ckpt, formats, &mut |_| {}).unwrap();
    let allocated = ctx.memory.live_bytes() - before;
    eprintln!(
        "[check] tiny model {} / {} (binding limit {} B, LM head in {} chunks): {allocated} bytes allocated, {predicted} predicted",
        formats.layers.name(),
        formats.embed.name(),
        ctx.features.max_binding_bytes,
        weights.lm_head.chunks.len()
    );
    assert_eq!(allocated, predicted);
    assert_eq!(weights.size_bytes(), predicted);
    drop(weights);
    assert_eq!(ctx.memory.live_bytes(), before);
}

#[test]
fn weight_bytes_is_what_loading_allocates() {
    // Fresh contexts: the shared one's counter also sees other tests' buffers.
    for limit in [None, Some(4096)] {
        let ctx = match limit {
            Some(bytes) => ctx_with_binding_limit(bytes),
            None => ctx_with_binding_limit(u64::MAX),
        };
        for layers in [
            WeightFormat::F32,
            WeightFormat::F16Packed,
            WeightFormat::Q8,
            WeightFormat::Q4,
        ] {
            check_memory(&ctx, WeightFormats::uniform(layers));
        }
        check_memory(
            &ctx,
            WeightFormats {
                layers: WeightFormat::Q4,
                embed: WeightFormat::F16Packed,
            },
        );
    }
}
