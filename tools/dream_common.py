"""Config and schedule pieces shared by the Dream references.

tools/dream_ref.py (numpy) and tools/dream_torch.py (PyTorch) read the same Hugging
Face Qwen2-layout config.json, expect the same tensors, and count a step's commits by the
same rule.  This module holds that and uses the Python standard library only, like
tools/llada_common.py (whose checkpoint-file helpers both references use as well).
"""

from __future__ import annotations

import json
import os

# Qwen2 / Dream config fields the forward pass reads, with the defaults of DreamConfig
CONFIG_DEFAULTS = {
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "mask_token_id": None,
}


def resolve_config(raw):
    """The Dream config with defaults applied and head_dim added; refuses what the
    forward passes do not implement (another activation, RoPE scaling, sliding windows)."""
    cfg = dict(CONFIG_DEFAULTS)
    cfg.update(raw)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"config.json lacks {key}")
    unsupported = []
    if cfg["hidden_act"] != "silu":
        unsupported.append(f"hidden_act {cfg['hidden_act']!r}")
    if cfg["rope_scaling"] is not None:
        unsupported.append("rope_scaling")
    if cfg["use_sliding_window"]:
        unsupported.append("use_sliding_window")
    if unsupported:
        raise NotImplementedError("unsupported config: " + ", ".join(unsupported))
    if cfg["num_key_value_heads"] is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    D, H, Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if D % H or H % Hkv:
        raise ValueError("hidden_size must divide by num_attention_heads and that by num_key_value_heads")
    cfg["head_dim"] = D // H
    return cfg


def load_config(directory):
    """The resolved config.json of a Dream checkpoint folder."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        return resolve_config(json.load(f))


def expected_shapes(cfg):
    """Name -> shape of every tensor the forward pass reads (Hugging Face Qwen2 names)."""
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, D)
    per_layer = {
        "input_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (D, D),
        "self_attn.q_proj.bias": (D,),
        "self_attn.k_proj.weight": (kv, D),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, D),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (D, D),
        "post_attention_layernorm.weight": (D,),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
    }
    for i in range(cfg["num_hidden_layers"]):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{i}.{name}"] = shape
    return shapes


def quota(num_masked, t, s, last):
    """Dream's number of positions to commit at a step: int(num_masked * (1 - s/t)),
    everything at the last step."""
    if last:
        return int(num_masked)
    return int(num_masked * (1.0 - s / t))
