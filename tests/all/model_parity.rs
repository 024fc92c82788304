//! The whole LLaDA forward on the GPU against golden logits of the independent numpy
//! reference (tools/llada_ref.py) on the tiny bf16 checkpoint (2 layers, GQA 4/2 heads,
//! 2 shards with an index), and on the wide-head one (one head of 256 dimensions).

use crate::common;

use common::{fixture_dir, wide_head_fixture_dir};
use std::path::Path;

use common::{assert_close, ctx, flat, relative_error};
use serde_json::Value;
use unmask_gpu::WeightFormat;
use unmask_gpu::model::Model;
use unmask_gpu::ops::KernelOptions;
use unmask_gpu::ops::matmul::MatmulKernel;

fn goldens(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("goldens/logits.json")).expect("logits goldens");
    serde_json::from_str(&text).expect("valid JSON")
}

fn check(format: WeightFormat, tol: f64) {
    check_on(
        ctx(),
        &fixture_dir(),
        format,
        &KernelOptions::default(),
        tol,
    );
}

fn check_with(format: WeightFormat, kernel: MatmulKernel, tol: f64) {
    let options = KernelOptions {
        matmul: kernel,
        ..KernelOptions::default()
    };
    check_on(ctx(), &fixture_dir(), format, &options, tol);
}

fn check_on(
    ctx: std::sync::Arc<unmask_gpu::GpuContext>,
    dir: &Path,
    format: WeightFormat,
    kernels: &KernelOptions,
    tol: f64,
) {
    let mut model = Model::load(ctx.clone(), dir, format, &mut |_| {}).expect("model loads");
    model.set_kernels(kernels);
    let what = format!(
        "matmul={} attention={}",
        kernels.matmul.name(),
        kernels.attention.name()
    );
    check_model(&model, dir, &what, tol);
}

/// The model's logits and argmax on every golden case of the fixture in `dir`, within `tol`
/// of the f32 reference.
fn check_model(model: &Model, dir: &Path, what: &str, tol: f64) {
    let g = goldens(dir);
    for case in g["cases"].as_array().unwrap() {
        let ids = unmask_goldens::ids(&case["ids"]);
        let want = flat(&case["logits_f32"]);
        let got = model.logits(&ids).expect("forward");
        let name = case["name"].as_str().unwrap();
        assert_close(
            &format!(
                "logits {name} (T={}) weights={} {what}",
                ids.len(),
                model.weights.embedding.format.name(),
            ),
            &got,
            &want,
            tol,
        );
        // The argmax of every row equals the reference's.
        let vocab = model.cfg.embedding_size;
        let want_argmax: Vec<u64> = case["argmax_f32"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        for (r, &w) in want_argmax.iter().enumerate() {
            let row = &got[r * vocab..(r + 1) * vocab];
            let a = row
                .iter()
                .enumerate()
                .fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
            assert_eq!(a as u64, w, "{name}: argmax of row {r}");
        }
        // For scale: how far the bf16-rounding reference is from the f32 one.
        let bf16 = flat(&case["logits_bf16"]);
        eprintln!(
            "[info] {name}: f32 reference vs bf16-rounding reference differ by {:.3e} relative",
            relative_error(&want, &bf16)
        );
    }
}

// The GPU computes in f32 with f32 weights: only summation order differs from the f64 reference.
#[test]
fn logits_match_reference_with_f32_weights() {
    check(WeightFormat::F32, 1e-4);
}

// bf16 checkpoint weights stored as f16 on the GPU: the same values except a few small ones
// below f16's normal range, so the error stays near f32 rounding; 1e-2 is the f16 path budget.
#[test]
fn logits_match_reference_with_f16_weights() {
    check(WeightFormat::F16Native, 1e-2);
    check(WeightFormat::F16Packed, 1e-2);
}

// The kernels `Auto` picks on hardware GPUs (narrow below 64 rows, gemm above), forced here,
// through the whole forward with its fusions (norm into qkv and gate|up, SwiGLU, residuals).
#[test]
fn logits_match_reference_with_the_hardware_gpu_kernels() {
    for kernel in [MatmulKernel::Narrow, MatmulKernel::Gemm] {
        check_with(WeightFormat::F32, kernel, 1e-4);
    }
}

// The tensor-core kernel through the whole forward (norm, SwiGLU and residual fusions, the
// LM head): every matmul input rounded to f16, sums in f32, so the f16 budget of 1e-2. Where
// the adapter has no cooperative matrices it runs `gemm`, and the test says so.
#[test]
fn logits_match_reference_with_the_tensor_core_kernel() {
    let ctx = ctx();
    let path = match unmask_gpu::ops::matmul::coop_shape(&ctx) {
        Some(shape) => format!(
            "cooperative matrices, {0}x{0} fragments, subgroup size {1}",
            shape.fragment, shape.subgroup
        ),
        None => "the f32 gemm (no cooperative matrices here)".to_string(),
    };
    eprintln!("[path] coop through the forward runs {path}");
    check_with(WeightFormat::F32, MatmulKernel::Coop, 1e-2);
}

// A 32 KiB binding limit splits the LM head (and embedding) over vocabulary chunks; the
// logits must not change.
#[test]
fn logits_match_reference_with_chunked_vocabulary() {
    let ctx = common::ctx_with_binding_limit(32 * 1024);
    let model =
        Model::load(ctx, &fixture_dir(), WeightFormat::F32, &mut |_| {}).expect("tiny model loads");
    assert!(
        model.weights.lm_head.chunks.len() > 1,
        "LM head should be chunked"
    );
    let g = goldens(&fixture_dir());
    let case = &g["cases"][2];
    let ids = unmask_goldens::ids(&case["ids"]);
    let got = model.logits(&ids).expect("forward");
    assert_close(
        &format!(
            "logits with the LM head in {} chunks",
            model.weights.lm_head.chunks.len()
        ),
        &got,
        &flat(&case["logits_f32"]),
        1e-4,
    );
}

// Every attention kernel through the whole forward: the one the device picks above, and
// here the others by name (on lavapipe: the wide kernel and its split over keys).
#[test]
fn logits_match_reference_with_every_attention_kernel() {
    use unmask_gpu::ops::attention::AttentionKernel;
    for kernel in AttentionKernel::CONCRETE {
        eprintln!("[attention] forward with the {} kernel", kernel.name());
        let options = KernelOptions {
            attention: kernel,
            ..KernelOptions::default()
        };
        check_on(ctx(), &fixture_dir(), WeightFormat::F32, &options, 1e-4);
    }
}

// Heads 256 wide (the wide kernels stage them 128 dimensions at a time) through the whole
// forward, with f32 and f16 weights and every attention kernel that serves them; the
// register kernel (at most 128) refuses by name instead of computing something else.
#[test]
fn logits_match_reference_with_heads_256_wide() {
    use unmask_gpu::ops::attention::AttentionKernel;
    let dir = wide_head_fixture_dir();
    check_on(
        ctx(),
        &dir,
        WeightFormat::F32,
        &KernelOptions::default(),
        1e-4,
    );
    check_on(
        ctx(),
        &dir,
        WeightFormat::F16Packed,
        &KernelOptions::default(),
        1e-2,
    );
    for kernel in AttentionKernel::CONCRETE {
        let options = KernelOptions {
            attention: kernel,
            ..KernelOptions::default()
        };
        if kernel == AttentionKernel::Register {
            let mut model = Model::load(ctx(), &dir, WeightFormat::F32, &mut |_| {}).unwrap();
            model.set_kernels(&options);
            let err = model.logits(&[1, 2, 3]).unwrap_err().to_string();
            assert!(err.contains("register kernel"), "{err}");
            eprintln!("[attention] the register kernel refuses head_dim 256: {err}");
            continue;
        }
        eprintln!("[attention] head_dim 256 with the {} kernel", kernel.name());
        check_on(ctx(), &dir, WeightFormat::F32, &options, 1e-4);
    }
}

// K/V arena in f16: K and V rounded to f16 once as they are written (2^-11 relative each);
// the logits stay within 3e-3 of the largest (measured about 1.1e-3 here) and every row's
// argmax is the reference's. Half the arena bytes of f32.
#[test]
fn logits_match_reference_with_an_f16_kv_arena() {
    let ctx = ctx();
    let mut model =
        Model::load(ctx.clone(), &fixture_dir(), WeightFormat::F32, &mut |_| {}).expect("loads");
    let f32_bytes = model.kv_bytes(64);
    model.kv_dtype = unmask_gpu::DType::F16;
    assert_eq!(
        model.kv_bytes(64) * 2,
        f32_bytes,
        "an f16 arena is half the bytes"
    );
    let state = model.new_state(8, 64).expect("state");
    assert!(
        state
            .kv
            .iter()
            .all(|l| l.k.dtype == unmask_gpu::DType::F16 && l.v.dtype == unmask_gpu::DType::F16),
        "the arena is f16"
    );
    check_model(&model, &fixture_dir(), "kv=f16", 3e-3);
}
