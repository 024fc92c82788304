//! Quantized checkpoints: quantize → save → load gives the same codes and scales on the GPU,
//! bit for bit, as quantizing while loading; the file holds exactly the CPU quantizer's
//! bytes; a saved checkpoint is detected and loaded without re-quantizing; malformed
//! quantized tensors are named.

use crate::common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use common::{ctx, ctx_with_binding_limit, fixture_dir};
use unmask_core::config::ModelConfig;
use unmask_core::quant::{self, QuantFormat};
use unmask_core::safetensors_writer::{Dtype, SafetensorsWriter, TensorDecl};
use unmask_gpu::model::checkpoint::{META_BLOCK, META_EMBED, META_LAYERS, META_ROW_ALIGN};
use unmask_gpu::model::{Checkpoint, ModelWeights, WeightFormats, write_quantized};
use unmask_gpu::{GpuContext, Weight, WeightFormat};

/// A fresh folder under the test target's scratch space.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn config() -> ModelConfig {
    ModelConfig::from_file(fixture_dir().join("config.json")).unwrap()
}

/// Writes a quantized copy of the fixture into `dir` (checkpoint and config).
fn save(dir: &Path, layers: Option<QuantFormat>, embed: Option<QuantFormat>) -> u64 {
    let ckpt = Checkpoint::open(&fixture_dir()).unwrap();
    let file = File::create(dir.join("model.safetensors")).unwrap();
    let bytes = write_quantized(
        &config(),
        &ckpt,
        layers,
        embed,
        BufWriter::new(file),
        &mut |_| {},
    )
    .unwrap();
    std::fs::copy(fixture_dir().join("config.json"), dir.join("config.json")).unwrap();
    bytes
}

fn load(ctx: &GpuContext, dir: &Path, formats: WeightFormats) -> ModelWeights {
    let ckpt = Checkpoint::open(dir).unwrap();
    ModelWeights::load(ctx, &config(), &ckpt, formats, &mut |_| {}).unwrap()
}

/// Every matrix of the model, named.
fn matrices(w: &ModelWeights) -> Vec<(String, &Weight)> {
    let mut out = vec![("embedding".to_string(), &w.embedding)];
    for (i, l) in w.layers.iter().enumerate() {
        out.push((format!("{i}.qkv"), &l.qkv));
        out.push((format!("{i}.attn_out"), &l.attn_out));
        out.push((format!("{i}.gate_up"), &l.gate_up));
        out.push((format!("{i}.down"), &l.down));
    }
    out.push(("lm_head".to_string(), &w.lm_head));
    out
}

/// The GPU bytes of every chunk of `w`.
fn chunk_bytes(ctx: &GpuContext, w: &Weight) -> Vec<Vec<u8>> {
    w.chunks
        .iter()
        .map(|c| ctx.read_bytes(&c.buffer, 0, c.buffer.size()).unwrap())
        .collect()
}

fn assert_same_gpu_bytes(ctx: &GpuContext, a: &ModelWeights, b: &ModelWeights) -> u64 {
    let mut compared = 0;
    for ((name, wa), (_, wb)) in matrices(a).into_iter().zip(matrices(b)) {
        assert_eq!(wa.format, wb.format, "{name}: format");
        assert_eq!(wa.chunks.len(), wb.chunks.len(), "{name}: chunks");
        let (ba, bb) = (chunk_bytes(ctx, wa), chunk_bytes(ctx, wb));
        for (i, (x, y)) in ba.iter().zip(&bb).enumerate() {
            assert!(x == y, "{name} chunk {i}: GPU bytes differ");
            compared += x.len() as u64;
        }
    }
    compared
}

#[test]
fn save_then_load_is_bit_exact() {
    let ctx = ctx();
    let dir = scratch("quant_q4_q8");
    let file_bytes = save(&dir, Some(QuantFormat::Q4), Some(QuantFormat::Q8));
    let mixed = WeightFormats {
        layers: WeightFormat::Q4,
        embed: WeightFormat::Q8,
    };
    let at_load = load(&ctx, &fixture_dir(), mixed);
    // Asked for f16: the stored formats win, and nothing is converted.
    let saved = load(&ctx, &dir, WeightFormats::uniform(WeightFormat::F16Packed));
    assert_eq!(saved.formats(), mixed);
    let compared = assert_same_gpu_bytes(&ctx, &at_load, &saved);
    eprintln!(
        "[check] q4 blocks + q8 embedding/head: {file_bytes} file bytes, {compared} GPU bytes equal after save and load"
    );

    let ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(ckpt.metadata(META_BLOCK), Some("32"));
    assert_eq!(ckpt.metadata(META_LAYERS), Some("q4"));
    assert_eq!(ckpt.metadata(META_EMBED), Some("q8"));
}

#[test]
fn saved_codes_are_the_quantizers_bytes() {
    let dir = scratch("quant_q8");
    save(&dir, Some(QuantFormat::Q8), Some(QuantFormat::Q8));
    let cfg = config();
    let source = Checkpoint::open(&fixture_dir()).unwrap();
    let saved = Checkpoint::open(&dir).unwrap();
    let d = cfg.d_model;
    for (name, rows, cols) in [
        ("model.transformer.blocks.1.k_proj.weight", 32, d),
        (
            "model.transformer.blocks.0.ff_out.weight",
            d,
            cfg.mlp_hidden_size,
        ),
        ("model.transformer.wte.weight", cfg.embedding_size, d),
    ] {
        let mut values = vec![0f32; rows * cols];
        source
            .tensor(name, &[rows, cols])
            .unwrap()
            .read_f32(0, &mut values);
        let mut codes = vec![0u8; rows * QuantFormat::Q8.row_code_bytes(cols)];
        let mut scales = vec![0u8; rows * quant::row_scale_bytes(cols)];
        QuantFormat::Q8
            .quantize_rows(&values, cols, &mut codes, &mut scales)
            .unwrap();
        let q = saved
            .quantized(name, rows, cols)
            .unwrap()
            .expect("stored quantized");
        assert_eq!(q.format, QuantFormat::Q8);
        assert!(q.codes == codes.as_slice(), "{name}: codes");
        assert!(q.scales == scales.as_slice(), "{name}: scales");
        // A quantized tensor has no float twin.
        assert!(saved.tensor(name, &[rows, cols]).is_err());
    }
    // Norm weights are copied as stored.
    let norm = "model.transformer.blocks.0.attn_norm.weight";
    assert_eq!(
        saved.tensor(norm, &[d]).unwrap().data,
        source.tensor(norm, &[d]).unwrap().data
    );
}

#[test]
fn unquantized_tables_and_chunked_weights_round_trip() {
    // The embedding and LM head kept as stored (f16 on the GPU), q8 blocks, and a binding
    // limit that splits the matrices over several chunks.
    let ctx = ctx_with_binding_limit(4096);
    let dir = scratch("quant_q8_float_tables");
    save(&dir, Some(QuantFormat::Q8), None);
    let formats = WeightFormats {
        layers: WeightFormat::Q8,
        embed: WeightFormat::F16Packed,
    };
    let at_load = load(&ctx, &fixture_dir(), formats);
    let saved = load(&ctx, &dir, formats);
    assert_eq!(saved.formats(), formats);
    assert!(saved.layers[0].gate_up.chunks.len() > 1);
    assert!(saved.lm_head.chunks.len() > 1);
    let compared = assert_same_gpu_bytes(&ctx, &at_load, &saved);
    eprintln!("[check] q8 blocks, f16 tables, 4 KiB chunks: {compared} GPU bytes equal");
    let saved_ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(saved_ckpt.metadata(META_EMBED), Some("none"));
    assert!(
        saved_ckpt
            .quantized(
                "model.transformer.wte.weight",
                config().embedding_size,
                config().d_model
            )
            .unwrap()
            .is_none()
    );
}

#[test]
fn quantizing_a_quantized_checkpoint_copies_it() {
    let first = scratch("quant_again_a");
    let second = scratch("quant_again_b");
    save(&first, Some(QuantFormat::Q4), Some(QuantFormat::Q4));
    let ckpt = Checkpoint::open(&first).unwrap();
    let mut out = Vec::new();
    write_quantized(
        &config(),
        &ckpt,
        Some(QuantFormat::Q4),
        Some(QuantFormat::Q4),
        &mut out,
        &mut |_| {},
    )
    .unwrap();
    let original = std::fs::read(first.join("model.safetensors")).unwrap();
    assert!(out == original, "re-quantizing changed the file");
    // Another format re-quantizes from the dequantized values; tables left alone (None)
    // keep their stored q4 codes.
    let file = File::create(second.join("model.safetensors")).unwrap();
    write_quantized(
        &config(),
        &ckpt,
        Some(QuantFormat::Q8),
        None,
        BufWriter::new(file),
        &mut |_| {},
    )
    .unwrap();
    std::fs::copy(
        fixture_dir().join("config.json"),
        second.join("config.json"),
    )
    .unwrap();
    let second_ckpt = Checkpoint::open(&second).unwrap();
    assert_eq!(second_ckpt.metadata(META_LAYERS), Some("q8"));
    assert_eq!(second_ckpt.metadata(META_EMBED), Some("q4"));
    let w = load(&ctx(), &second, WeightFormats::uniform(WeightFormat::F32));
    assert_eq!(
        w.formats(),
        WeightFormats {
            layers: WeightFormat::Q8,
            embed: WeightFormat::Q4
        }
    );
}

/// A one-file checkpoint of the given tensors (zero bytes) and metadata.
fn handmade(
    name: &str,
    metadata: &[(&str, &str)],
    tensors: &[(&str, Dtype, Vec<usize>)],
) -> PathBuf {
    let dir = scratch(name);
    let metadata: BTreeMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let decls: Vec<TensorDecl> = tensors
        .iter()
        .map(|(n, d, s)| TensorDecl::new(*n, *d, s.clone()))
        .collect();
    let sizes: Vec<u64> = decls.iter().map(|d| d.byte_len().unwrap()).collect();
    let file = File::create(dir.join("model.safetensors")).unwrap();
    let mut w = SafetensorsWriter::new(BufWriter::new(file), &metadata, decls).unwrap();
    for size in sizes {
        w.write(&vec![0u8; size as usize]).unwrap();
    }
    w.finish().unwrap();
    dir
}

#[test]
fn malformed_quantized_tensors_are_named() {
    let meta = [(META_BLOCK, "32"), (META_ROW_ALIGN, "64")];
    let good = [
        ("a.qweight", Dtype::U8, vec![2, 32]),
        ("a.scales", Dtype::F16, vec![2, 2]),
    ];
    let ckpt = Checkpoint::open(&handmade("quant_good", &meta, &good)).unwrap();
    let q = ckpt.quantized("a.weight", 2, 40).unwrap().unwrap();
    assert_eq!(
        (q.format, q.codes.len(), q.scales.len()),
        (QuantFormat::Q4, 64, 8)
    );
    let stored = ckpt.stored_tensor("a.weight", &[2, 40]).unwrap();
    assert_eq!(
        (stored.dtype.as_str(), stored.bytes, stored.file_tensors),
        ("q4", 72, 2)
    );
    assert!(ckpt.quantized("b.weight", 2, 40).unwrap().is_none());

    let error = |name: &str, meta: &[(&str, &str)], tensors: &[(&str, Dtype, Vec<usize>)]| {
        let ckpt = Checkpoint::open(&handmade(name, meta, tensors)).unwrap();
        let e = ckpt.quantized("a.weight", 2, 40).err().expect("an error");
        e.to_string()
    };
    let e = error(
        "quant_block",
        &[(META_BLOCK, "16"), (META_ROW_ALIGN, "64")],
        &good,
    );
    assert!(e.contains(META_BLOCK) && e.contains("\"32\""), "{e}");
    let e = error("quant_no_meta", &[], &good);
    assert!(e.contains(META_BLOCK), "{e}");
    let e = error("quant_no_scales", &meta, &good[..1]);
    assert!(e.contains("a.scales") && e.contains("missing"), "{e}");
    let e = error(
        "quant_scale_shape",
        &meta,
        &[good[0].clone(), ("a.scales", Dtype::F16, vec![2, 1])],
    );
    assert!(e.contains("a.scales") && e.contains("[2, 2]"), "{e}");
    let e = error(
        "quant_dtype",
        &meta,
        &[("a.qweight", Dtype::F32, vec![2, 32]), good[1].clone()],
    );
    assert!(e.contains("I8") && e.contains("U8"), "{e}");
    let e = error(
        "quant_code_shape",
        &meta,
        &[("a.qweight", Dtype::I8, vec![2, 32]), good[1].clone()],
    );
    assert!(e.contains("q8") && e.contains("[2, 64]"), "{e}");
    eprintln!("[check] malformed quantized tensors: {e}");
}
