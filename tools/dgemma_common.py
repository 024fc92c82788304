"""Config, tensor names and sampler settings of DiffusionGemma, shared by the numpy
reference (tools/dgemma_ref.py) and the fixture maker (tools/make_dgemma_fixture.py).

Standard library only.  What each key means, and where the reference reads it, is in
docs/models/diffusion-gemma.md (sections 1 and 2).
"""

from __future__ import annotations

import json
import os

SLIDING, FULL = "sliding_attention", "full_attention"

# DiffusionGemmaTextConfig fields the forward pass reads, with the class defaults
TEXT_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 512,
    "final_logit_softcapping": 30.0,  # a class attribute: 5.25 does not write it
    "use_bidirectional_attention": None,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "layer_types": None,
    "rope_parameters": None,
    "head_dim": 256,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}

# DiffusionGemmaGenerationConfig's global defaults (used where generation_config.json is silent)
GENERATION_DEFAULTS = {
    "max_new_tokens": 256,
    "max_denoising_steps": 48,
    "entropy_bound": 0.1,
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
    "eos_token_id": None,
    "pad_token_id": None,
}


def default_layer_types(n):
    """A full layer every sixth layer (index % 6 == 5), the last one forced to full."""
    types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
    types[-1] = FULL
    return types


def resolve_config(raw):
    """The checkpoint's config.json (with `text_config`) resolved to what the forward pass
    needs: sizes, and one entry per layer (type, head_dim, kv heads, RoPE)."""
    if raw.get("model_type") not in (None, "diffusion_gemma"):
        raise ValueError(f"model_type {raw.get('model_type')!r} is not diffusion_gemma")
    if "text_config" not in raw:
        raise ValueError("config.json lacks text_config")
    t = dict(TEXT_DEFAULTS)
    t.update(raw["text_config"])
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "num_experts", "top_k_experts", "moe_intermediate_size"):
        if t.get(key) is None:
            raise ValueError(f"text_config lacks {key}")
    unsupported = []
    if t["hidden_activation"] != "gelu_pytorch_tanh":
        unsupported.append(f"hidden_activation {t['hidden_activation']!r}")
    if t["use_bidirectional_attention"] == "all":
        unsupported.append("use_bidirectional_attention 'all'")
    if t["attention_bias"]:
        unsupported.append("attention_bias")
    if unsupported:
        raise NotImplementedError("unsupported config: " + ", ".join(unsupported))
    n = t["num_hidden_layers"]
    types = list(t["layer_types"]) if t["layer_types"] else default_layer_types(n)
    if len(types) != n or any(x not in (SLIDING, FULL) for x in types):
        raise ValueError("layer_types must name sliding_attention or full_attention for every layer")
    types[-1] = FULL  # the reference forces it (with a warning)
    rope = dict(DEFAULT_ROPE)
    rope.update(t["rope_parameters"] or {})
    # full layers: per_layer_config (5.25's form) or global_head_dim / num_global_key_value_heads
    per_layer = {int(k): v for k, v in (t.get("per_layer_config") or {}).items()}
    if not per_layer:
        override = {"head_dim": t.get("global_head_dim", 512)}
        if t.get("num_global_key_value_heads") is not None and t.get("attention_k_eq_v", True):
            override["num_key_value_heads"] = t["num_global_key_value_heads"]
        per_layer = {i: override for i, x in enumerate(types) if x == FULL}
    layers = []
    for i, kind in enumerate(types):
        over = per_layer.get(i, {})
        rp = rope[kind]
        if rp["rope_type"] not in ("default", "proportional"):
            raise NotImplementedError(f"rope_type {rp['rope_type']!r}")
        if rp["rope_type"] == "default" and rp.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial_rotary_factor with the default rope_type")
        layers.append({
            "type": kind,
            "head_dim": over.get("head_dim", t["head_dim"]),
            "kv_heads": over.get("num_key_value_heads", t["num_key_value_heads"]),
            "rope_type": rp["rope_type"],
            "rope_theta": float(rp["rope_theta"]),
            "partial_rotary_factor": float(rp.get("partial_rotary_factor", 1.0)),
        })
    for ly in layers:
        if t["num_attention_heads"] % ly["kv_heads"]:
            raise ValueError("num_attention_heads must divide by every layer's kv heads")
    return {
        "canvas_length": raw.get("canvas_length", 256),
        "vocab_size": t["vocab_size"],
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_layers": n,
        "num_heads": t["num_attention_heads"],
        "layers": layers,
        "sliding_window": t["sliding_window"],
        "rms_norm_eps": float(t["rms_norm_eps"]),
        "softcap": float(t["final_logit_softcapping"]),
        "num_experts": t["num_experts"],
        "top_k": t["top_k_experts"],
        "expert_size": t["moe_intermediate_size"],
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", t["tie_word_embeddings"])),
    }


def load_config(directory):
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        return resolve_config(json.load(f))


def load_generation_config(directory):
    """generation_config.json over the global defaults; the sampler's bound flattened."""
    g = dict(GENERATION_DEFAULTS)
    path = os.path.join(directory, "generation_config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        for k, v in raw.items():
            if k == "sampler_config" and v is not None:
                g["entropy_bound"] = v["entropy_bound"]
            elif k in g and v is not None:
                g[k] = v
    if isinstance(g["eos_token_id"], int):
        g["eos_token_id"] = [g["eos_token_id"]]
    return g


DEC = "model.decoder."
ENC_SCALAR = "model.encoder.language_model.layers.{}.layer_scalar"
LAYER_NORMS = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
    "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2",
)


def expected_shapes(cfg):
    """Name -> shape of every text tensor of the published checkpoint (decoder names; the
    encoder keeps only its own layer_scalar buffers)."""
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, E, Fe = cfg["num_heads"], cfg["num_experts"], cfg["expert_size"]
    shapes = {DEC + "embed_tokens.weight": (V, D), DEC + "norm.weight": (D,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, D)
    sc = DEC + "self_conditioning."
    shapes.update({sc + "pre_norm.weight": (D,), sc + "gate_proj.weight": (F, D),
                   sc + "up_proj.weight": (F, D), sc + "down_proj.weight": (D, F)})
    for i, ly in enumerate(cfg["layers"]):
        p, d, kv = f"{DEC}layers.{i}.", ly["head_dim"], ly["kv_heads"]
        shapes.update({p + n + ".weight": (D,) for n in LAYER_NORMS})
        shapes.update({
            p + "self_attn.q_proj.weight": (H * d, D),
            p + "self_attn.k_proj.weight": (kv * d, D),
            p + "self_attn.o_proj.weight": (D, H * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
            p + "router.proj.weight": (E, D),
            p + "router.scale": (D,),
            p + "router.per_expert_scale": (E,),
            p + "experts.gate_up_proj": (E, 2 * Fe, D),
            p + "experts.down_proj": (E, D, Fe),
            p + "layer_scalar": (1,),
            ENC_SCALAR.format(i): (1,),
        })
        if ly["type"] == SLIDING:
            shapes[p + "self_attn.v_proj.weight"] = (kv * d, D)
    return shapes


def is_vision_tensor(name):
    """Tensors of the vision tower, which a text-only runtime skips."""
    return name.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision."))
