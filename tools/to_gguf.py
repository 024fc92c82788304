"""Writes a LLaDA or Dream model folder (config.json, model.safetensors or shards + index,
tokenizer.json, tokenizer_config.json) as one GGUF file that llama.cpp's diffusion example
(`llama-diffusion-cli`) loads: the architecture `llada` or `dream`, the same weights (f32,
or f16 matrices), the tokenizer as a GPT-2 BPE vocabulary with its merges, special ids and
chat template.

    pip install gguf numpy
    python tools/to_gguf.py --model models/tiny --out /tmp/tiny-f32.gguf [--dtype f16]

It reads safetensors itself (bf16 included, which numpy's loaders do not take) and needs no
PyTorch or transformers. What llama.cpp expects, and this file writes:
- tensor names: token_embd, output, output_norm and per layer attn_norm, attn_q/k/v (with
  Dream's biases), attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down;
- LLaDA's q and k rows reordered from the checkpoint's rotate-half RoPE layout (pairs i,
  i + d/2) to the adjacent pairs (2i, 2i + 1) that llama.cpp's LLaMA-style RoPE rotates
  (Dream's Qwen2 RoPE is rotate-half in both);
- non-causal attention; `diffusion.shift_logits` false for LLaDA (position i predicts
  token i) and true for Dream (the row before predicts it);
- the pre-tokenizer by llama.cpp's name for the same splitting rules (`--pre` names another).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

import numpy as np

try:
    import gguf
except ImportError:  # the one dependency beyond numpy
    sys.exit("to_gguf.py needs the gguf package: pip install gguf")

# Checkpoint names -> llama.cpp's: per layer (after the layer number) and for the model.
LLADA_NAMES = {
    "layer_prefix": "model.transformer.blocks.",
    "layer": {
        "attn_norm.weight": "attn_norm.weight",
        "q_proj.weight": "attn_q.weight",
        "k_proj.weight": "attn_k.weight",
        "v_proj.weight": "attn_v.weight",
        "attn_out.weight": "attn_output.weight",
        "ff_norm.weight": "ffn_norm.weight",
        "ff_proj.weight": "ffn_gate.weight",
        "up_proj.weight": "ffn_up.weight",
        "ff_out.weight": "ffn_down.weight",
    },
    "model": {
        "model.transformer.wte.weight": "token_embd.weight",
        "model.transformer.ln_f.weight": "output_norm.weight",
        "model.transformer.ff_out.weight": "output.weight",
    },
}
DREAM_NAMES = {
    "layer_prefix": "model.layers.",
    "layer": {
        "input_layernorm.weight": "attn_norm.weight",
        **{f"self_attn.{x}_proj.{p}": f"attn_{x}.{p}" for x in "qkv" for p in ("weight", "bias")},
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    },
    "model": {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    },
}
# Qwen2's split rule, as tokenizer.json spells it.
QWEN2_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def fail(msg):
    sys.exit(f"to_gguf.py: {msg}")


def read_safetensors(path):
    """name -> float32 array, for every tensor of one safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            fail(f"{path}: expected an 8-byte header length, found {len(raw)} bytes")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            fail(f"{path}: {name} is {info['dtype']}, expected one of {sorted(SAFETENSORS_DTYPES)}")
        start, end = info["data_offsets"]
        if end > len(data):
            fail(f"{path}: {name} ends at byte {end} of the data, which has {len(data)} (truncated?)")
        arr = np.frombuffer(data[start:end], dtype=dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.astype(np.float32)
    return out


def read_weights(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        fail(f"{model_dir}: expected model.safetensors or model.safetensors.index.json, found neither")
    with open(index, encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    weights = {}
    for shard in shards:
        weights.update(read_safetensors(os.path.join(model_dir, shard)))
    return weights


def rope_pairs_adjacent(w, n_heads):
    """Rows of each head from (i, i + d/2) pairs to (2i, 2i + 1) pairs."""
    rows, cols = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_name(name, names):
    """llama.cpp's name for the checkpoint's tensor `name`."""
    if name in names["model"]:
        return names["model"][name]
    prefix = names["layer_prefix"]
    if name.startswith(prefix):
        layer, _, rest = name[len(prefix):].partition(".")
        if layer.isdigit() and rest in names["layer"]:
            return f"blk.{layer}.{names['layer'][rest]}"
    fail(f"unexpected tensor {name}: expected {sorted(names['model'])} or "
         f"{prefix}N.{{{', '.join(sorted(names['layer']))}}}")


def pre_tokenizer_name(tokenizer):
    """llama.cpp's name for this tokenizer's splitting rules, when it has one."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [(s.get("type"), s.get("individual_digits"), s.get("use_regex")) for s in steps]
    if any(s.get("add_prefix_space") for s in steps):
        return None  # llama.cpp's GPT-2 pre-tokenizers add no space
    if kinds == [("Digits", True, None), ("ByteLevel", None, True)]:
        return "refact"  # single digits, then GPT-2's regex
    if kinds == [("ByteLevel", None, True)]:
        return "gpt-2"
    if (len(steps) == 2 and steps[0].get("type") == "Split"
            and steps[0].get("pattern", {}).get("Regex") == QWEN2_REGEX
            and kinds[1] == ("ByteLevel", None, False)):
        return "qwen2"
    return None


def vocabulary(model_dir, vocab_size):
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tokenizer = json.load(f)
    if tokenizer["model"]["type"] != "BPE":
        fail(f"tokenizer.json: model.type is {tokenizer['model']['type']}, expected BPE")
    by_id = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    special = {}
    for added in tokenizer.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        special[added["id"]] = added.get("special", False)
    if max(by_id) >= vocab_size:
        fail(f"tokenizer.json: id {max(by_id)} is past config.json's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in special:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if special[i] else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types, pre_tokenizer_name(tokenizer)


class Shape:
    """A family's hyperparameters under llama.cpp's meanings."""

    def __init__(self, config):
        family = config.get("model_type")
        if family == "llada":
            self.arch, self.names, self.shifts_logits = "llada", LLADA_NAMES, False
            self.width, self.heads = config["d_model"], config["n_heads"]
            self.kv_heads = config.get("n_kv_heads") or self.heads
            self.layers, self.ffn = config["n_layers"], config["mlp_hidden_size"]
            self.context = config.get("max_sequence_length", 4096)
            self.vocab = config.get("vocab_size") or config["embedding_size"]
        elif family == "Dream":
            self.arch, self.names, self.shifts_logits = "dream", DREAM_NAMES, True
            self.width, self.heads = config["hidden_size"], config["num_attention_heads"]
            self.kv_heads = config.get("num_key_value_heads") or self.heads
            self.layers, self.ffn = config["num_hidden_layers"], config["intermediate_size"]
            self.context = config.get("max_position_embeddings", 4096)
            self.vocab = config["vocab_size"]
        else:
            fail(f"config.json: model_type is {family!r}, expected 'llada' or 'Dream'")
        self.eps = config.get("rms_norm_eps", 1e-5)
        self.rope_theta = config.get("rope_theta", 10000.0)


def convert(model_dir, out, dtype, pre_override):
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        shape = Shape(json.load(f))

    writer = gguf.GGUFWriter(out, shape.arch)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.width)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.width // shape.heads)
    writer.add_vocab_size(shape.vocab)
    writer.add_causal_attention(False)
    writer.add_diffusion_shift_logits(shape.shifts_logits)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)

    tokens, types, pre = vocabulary(model_dir, shape.vocab)
    pre = pre_override or pre
    if pre is None:
        fail("tokenizer.json: no llama.cpp pre-tokenizer name known for its pre_tokenizer; give --pre NAME")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # Merges, bos/eos/pad/mask ids (config.json's *_token_id), add_bos and the chat template.
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=shape.vocab).add_to_gguf(writer)

    for name, w in sorted(read_weights(model_dir).items()):
        target = gguf_name(name, shape.names)
        if shape.arch == "llada" and target.endswith("attn_q.weight"):
            w = rope_pairs_adjacent(w, shape.heads)
        elif shape.arch == "llada" and target.endswith("attn_k.weight"):
            w = rope_pairs_adjacent(w, shape.kv_heads)
        # Norms and biases stay f32, as llama.cpp's own converter keeps 1-D tensors.
        if dtype == "f16" and w.ndim == 2:
            w = w.astype(np.float16)
        writer.add_tensor(target, w)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a LLaDA or Dream model folder")
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    ap.add_argument("--dtype", choices=["f32", "f16"], default="f32", help="the matrices' type")
    ap.add_argument("--pre", help="llama.cpp's pre-tokenizer name, when it cannot be told")
    args = ap.parse_args()
    convert(args.model, args.out, args.dtype, args.pre)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
