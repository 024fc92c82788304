use super::*;

fn config(
    d: usize,
    heads: usize,
    kv: usize,
    layers: usize,
    mlp: usize,
    vocab: usize,
) -> ModelConfig {
    ModelConfig {
        family: unmask_core::config::ModelFamily::Llada,
        qkv_bias: false,
        d_model: d,
        n_heads: heads,
        n_kv_heads: kv,
        n_layers: layers,
        mlp_hidden_size: mlp,
        vocab_size: vocab,
        embedding_size: vocab,
        max_sequence_length: 4096,
        rope_theta: 500000.0,
        rms_norm_eps: 1e-5,
        weight_tying: false,
        mask_token_id: 3,
        eos_token_id: 1,
        pad_token_id: 1,
        bos_token_id: Some(0),
        default_top_k: None,
    }
}

#[test]
fn llada_8b_cases_fit_the_host_bound() {
    let cfg = ModelConfig::preset("llada-8b").unwrap();
    let cases = model_kernel_cases(&cfg, &[1, 64, 512], &[512, 4096]);
    let largest = cases.iter().map(KernelCase::host_bytes).max().unwrap();
    assert!(
        largest > 1 << 30 && largest <= MAX_CASE_HOST_BYTES,
        "{largest}"
    );
}

#[test]
fn model_cases_cover_every_layer_matmul_and_attention() {
    let cfg = config(64, 4, 2, 2, 96, 320);
    let cases = model_kernel_cases(&cfg, &[8, 64], &[100]);
    assert_eq!(cases.len(), 2 * (5 + 2));
    let hd = cfg.d_model / cfg.n_heads;
    assert!(cases.contains(&KernelCase::Matmul {
        case: "qkv",
        m: 8,
        n: cfg.d_model + 2 * cfg.n_kv_heads * hd,
        k: cfg.d_model,
    }));
}
