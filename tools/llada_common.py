"""Checkpoint and command-line pieces shared by the LLaDA reference tools.

tools/llada_ref.py (numpy), tools/llada_torch.py (PyTorch) and tools/parity.py read the
same Hugging Face-layout checkpoints and take the same id lists.  This module holds what
they share (and the LLaDA special-token list that tools/make_fixture.py and
tools/train.py build their tokenizers with) and uses the Python standard library only, so
that `parity.py --against goldens` keeps running without numpy or torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct

# The special tokens of the LLaDA-Instruct tokenizer, in id order; the fixture
# (tools/make_fixture.py) and the trained models (tools/train.py) append them after the
# ordinary tokens.
SPECIAL_TOKENS = [
    "<|startoftext|>",  # BOS
    "<|endoftext|>",  # EOS = PAD
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|mdm_mask|>",  # mask
]

# ---------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------

# Defaults of the reference `ModelConfig` dataclass for fields a config.json may leave
# out (llada.md section 1).  Only fields that the forward pass depends on are listed.
CONFIG_DEFAULTS = {
    "rope": False,
    "weight_tying": True,
    "embedding_size": 50304,
    "block_type": "sequential",
    "activation_type": "swiglu",
    "layer_norm_type": "default",
    "rope_theta": 10000.0,
    "max_sequence_length": 1024,
    "n_kv_heads": None,
    "multi_query_attention": None,
    "mlp_ratio": 4,
    "mlp_hidden_size": None,
    "rms_norm_eps": 1e-5,
    "alibi": False,
    "attention_layer_norm": False,
    "scale_logits": False,
    "input_emb_norm": False,
    "include_qkv_bias": False,
    "include_bias": False,
}

# options of the reference model that the forward passes here do not implement
_ABSENT_FEATURES = ("attention_layer_norm", "scale_logits", "input_emb_norm", "include_qkv_bias", "include_bias")


def resolve_config(raw):
    """The config with the reference defaults applied and the derived sizes added.

    Raises NotImplementedError, naming every unsupported option at once, for a model
    the references do not implement (anything but a RoPE llama block with SiLU and RMS
    norm, without biases).
    """
    cfg = dict(CONFIG_DEFAULTS)
    cfg.update(raw)
    for key in ("d_model", "n_heads", "n_layers", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"config.json lacks {key}")
    unsupported = []
    if cfg["block_type"] != "llama":
        unsupported.append(f"block_type {cfg['block_type']!r}")
    if cfg["activation_type"] != "silu":
        unsupported.append(f"activation_type {cfg['activation_type']!r}")
    if cfg["layer_norm_type"] != "rms":
        unsupported.append(f"layer_norm_type {cfg['layer_norm_type']!r}")
    if not cfg["rope"] or cfg["alibi"]:
        unsupported.append("a position encoding other than RoPE")
    unsupported += [flag for flag in _ABSENT_FEATURES if cfg[flag]]
    if unsupported:
        raise NotImplementedError("unsupported config: " + ", ".join(unsupported))
    if cfg["n_kv_heads"] is None:
        cfg["n_kv_heads"] = 1 if cfg["multi_query_attention"] else cfg["n_heads"]
    if cfg["mlp_hidden_size"] is None:
        cfg["mlp_hidden_size"] = cfg["mlp_ratio"] * cfg["d_model"]
    if cfg["embedding_size"] is None:
        cfg["embedding_size"] = cfg["vocab_size"]
    if cfg["d_model"] % cfg["n_heads"] or cfg["n_heads"] % cfg["n_kv_heads"]:
        raise ValueError("d_model must divide by n_heads and n_heads by n_kv_heads")
    cfg["head_dim"] = cfg["d_model"] // cfg["n_heads"]
    return cfg


def load_config(directory):
    """The resolved config.json of a checkpoint folder."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        return resolve_config(json.load(f))


# ---------------------------------------------------------------------------
# checkpoint files and tensors
# ---------------------------------------------------------------------------


def checkpoint_files(directory):
    """The safetensors files of a checkpoint and its index (None for a single file)."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        # always by the index: shard maps differ between releases (llada.md 1)
        return sorted(set(index["weight_map"].values())), index
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return ["model.safetensors"], None
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")


def check_shard(loaded, part, name, index):
    """Refuse tensors of shard `name` (`part`) that another shard already gave
    (`loaded`) or that the index places elsewhere."""
    for key in part:
        if key in loaded:
            raise ValueError(f"tensor {key} appears in more than one shard")
        if index is not None and index["weight_map"].get(key) != name:
            raise ValueError(f"tensor {key} is in {name}, the index says {index['weight_map'].get(key)}")


def expected_shapes(cfg):
    """Every tensor the forward pass reads, with its shape."""
    D, V, Fh = cfg["d_model"], cfg["embedding_size"], cfg["mlp_hidden_size"]
    kv = cfg["n_kv_heads"] * cfg["head_dim"]
    shapes = {"model.transformer.wte.weight": (V, D), "model.transformer.ln_f.weight": (D,)}
    if not cfg["weight_tying"]:
        shapes["model.transformer.ff_out.weight"] = (V, D)  # the LM head
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        shapes.update(
            {
                p + "attn_norm.weight": (D,),
                p + "q_proj.weight": (D, D),
                p + "k_proj.weight": (kv, D),
                p + "v_proj.weight": (kv, D),
                p + "attn_out.weight": (D, D),
                p + "ff_norm.weight": (D,),
                p + "ff_proj.weight": (Fh, D),  # gate (SiLU is applied to it)
                p + "up_proj.weight": (Fh, D),
                p + "ff_out.weight": (D, Fh),  # down projection, not the LM head
            }
        )
    return shapes


def check_shapes(shapes, tensors):
    """Every tensor of `shapes` (name -> shape) is in `tensors` with that shape."""
    for name, shape in shapes.items():
        if name not in tensors:
            raise ValueError(f"missing tensor {name}")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, expected {shape}")


# ---------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------

# safetensors dtype name -> bytes per element, for the dtypes the references read
SAFETENSORS_WIDTHS = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}


def read_safetensors_header(f):
    """The JSON header of a .safetensors file open at its start, and the file offset at
    which the tensor data begins (the header's data_offsets count from there)."""
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n).decode("utf-8")), 8 + n


def safetensors_entries(path, header, wanted=None):
    """(name, dtype, shape, begin, end) of each tensor of a parsed header, after checking
    that its dtype is readable and that its byte range fits its shape.  `wanted` (a set
    of names) limits the entries."""
    for name, info in header.items():
        if name == "__metadata__" or (wanted is not None and name not in wanted):
            continue
        dtype = info["dtype"]
        if dtype not in SAFETENSORS_WIDTHS:
            raise NotImplementedError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != math.prod(shape) * SAFETENSORS_WIDTHS[dtype]:
            raise ValueError(f"{path}: tensor {name}: byte range does not match its shape")
        yield name, dtype, shape, begin, end


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def parse_ids(text):
    """argparse type of a comma-separated token id list ("1,2,3")."""
    try:
        ids = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, found {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("the id list is empty")
    return ids
