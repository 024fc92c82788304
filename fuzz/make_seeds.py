#!/usr/bin/env python3
"""Writes the seed corpus of each fuzz target (fuzz/corpus/<target>/seed-*) from the tiny
fixture, plus safetensors files of the fuzzers' micro model (unmask_fuzz::MICRO_CONFIG):
small enough that libFuzzer can mutate a whole checkpoint. Run again after changing a
fixture or MICRO_CONFIG; inputs the fuzzers found (crash-*, regress-*) are left alone."""

import json
import math
import struct
from pathlib import Path

FUZZ = Path(__file__).resolve().parent
TINY = FUZZ.parent / "tests" / "fixtures" / "tiny"

# MICRO_CONFIG's shapes: d_model 8, 2 heads of 4, 1 KV head, mlp 8, embedding 16.
D, KV, HIDDEN, EMBED = 8, 4, 8, 16
# unmask_core::quant: rows padded to 64 weights, one f16 scale per 32.
ROW_ALIGN, BLOCK = 64, 32


def values(n, seed):
    return [math.sin(seed * 7.1 + i * 0.37) for i in range(n)]


def encode(dtype, xs):
    if dtype == "F32":
        return struct.pack(f"<{len(xs)}f", *xs)
    if dtype == "F16":
        return struct.pack(f"<{len(xs)}e", *xs)
    if dtype == "BF16":
        return b"".join(struct.pack("<f", x)[2:] for x in xs)
    if dtype in ("I8", "U8"):
        return bytes(int(x) & 0xFF for x in xs)
    raise ValueError(dtype)


def safetensors(tensors, metadata=None):
    """tensors: (name, dtype, shape, values), written in this order."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, xs in tensors:
        raw = encode(dtype, xs)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + data


def micro_tensors(quantized):
    dtypes = ["F32", "BF16", "F16"]
    out = []

    def float_tensor(name, shape):
        n = math.prod(shape)
        out.append((name, dtypes[len(out) % 3], shape, values(n, len(out))))

    def matrix(name, rows, cols, fmt=None):
        if fmt is None:
            float_tensor(name, [rows, cols])
            return
        padded = max(cols, 1) + (-max(cols, 1) % ROW_ALIGN)
        prefix = name.removesuffix(".weight")
        if fmt == "q8":
            codes = [(r * 31 + c * 7) % 255 - 127 for r in range(rows) for c in range(padded)]
            out.append((prefix + ".qweight", "I8", [rows, padded], codes))
        else:
            codes = [(r * 13 + c * 5) % 256 for r in range(rows) for c in range(padded // 2)]
            out.append((prefix + ".qweight", "U8", [rows, padded // 2], codes))
        out.append((prefix + ".scales", "F16", [rows, padded // BLOCK], [0.01 * (1 + i % 5) for i in range(rows * padded // BLOCK)]))

    block = "model.transformer.blocks.0."
    matrix("model.transformer.wte.weight", EMBED, D)
    float_tensor(block + "attn_norm.weight", [D])
    matrix(block + "q_proj.weight", D, D, "q8" if quantized else None)
    matrix(block + "k_proj.weight", KV, D, "q4" if quantized else None)
    matrix(block + "v_proj.weight", KV, D)
    matrix(block + "attn_out.weight", D, D)
    float_tensor(block + "ff_norm.weight", [D])
    matrix(block + "ff_proj.weight", HIDDEN, D)
    matrix(block + "up_proj.weight", HIDDEN, D)
    matrix(block + "ff_out.weight", D, HIDDEN)
    float_tensor("model.transformer.ln_f.weight", [D])
    matrix("model.transformer.ff_out.weight", EMBED, D)
    return out


def write(target, name, data):
    path = FUZZ / "corpus" / target / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def main():
    fixture = lambda name: (TINY / name).read_bytes()
    write("config", "seed-config", fixture("config.json"))
    write("config", "seed-config-generation", fixture("config.json") + b"\0" + fixture("generation_config.json"))
    dgemma = lambda name: (TINY.parent / "tiny-dgemma" / name).read_bytes()
    write("dgemma_config", "seed-config", dgemma("config.json"))
    write("dgemma_config", "seed-config-generation", dgemma("config.json") + b"\0" + dgemma("generation_config.json"))
    write("shard_index", "seed-index", fixture("model.safetensors.index.json"))
    write("tokenizer", "seed-tokenizer", fixture("tokenizer.json"))
    # Dream's ChatML BPE and DiffusionGemma's Gemma tokenizer: other models, normalizers and
    # decoders than the tiny fixture's.
    for family in ("tiny-dream", "tiny-dgemma"):
        write("tokenizer", f"seed-tokenizer-{family}", (TINY.parent / family / "tokenizer.json").read_bytes())
    write("safetensors", "seed-micro-float", safetensors(micro_tensors(False)))
    quant_meta = {"unmask.quant.block": str(BLOCK), "unmask.quant.row_align": str(ROW_ALIGN),
                  "unmask.quant.layers": "q8", "unmask.quant.embed": "none"}
    write("safetensors", "seed-micro-quant", safetensors(micro_tensors(True), quant_meta))
    write("safetensors", "seed-empty", safetensors([]))
    # Offsets chained up to 2^64 - 1: the file's end, 8 + header + data, overflows usize.
    chunk, entries = 1 << 60, {}
    for i in range(16):
        size = chunk - 1 if i == 15 else chunk
        entries[f"t{i}"] = {"dtype": "U8", "shape": [size], "data_offsets": [i * chunk, i * chunk + size]}
    text = json.dumps(entries, separators=(",", ":")).encode()
    write("safetensors", "seed-offsets-past-usize-max", struct.pack("<Q", len(text)) + text)


if __name__ == "__main__":
    main()
