"""Pieces shared by the fixture makers and fixture checkers (numpy and tokenizers).

tools/make_fixture.py (LLaDA) and tools/make_dream_fixture.py (Dream) build their tiny
checkpoints the same way: a byte-level BPE trained on one corpus with the special tokens
appended after the ordinary ones, random bf16 weights in two safetensors shards with an
index, and goldens written as JSON with fixed float formats.  tools/check_fixture.py and
tools/check_dream_fixture.py re-read them the same way.  What is the same in both lives
here; what differs (token names, tensor names, the samplers' options) stays in the
per-model scripts.  tools/train.py and tools/export.py use the tokenizer and safetensors
writers too.

The standard-library-only checkpoint pieces are in tools/llada_common.py, which
`parity.py --against goldens` imports without numpy; this module needs numpy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys

import numpy as np
from tokenizers import AddedToken, Tokenizer, pre_tokenizers, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llada_ref  # noqa: E402

# Smallest confidence and logit margin a golden generation may have: a smaller one could
# flip under another implementation's float rounding.
MARGIN_FLOOR = 1e-3

# ---------------------------------------------------------------------------
# JSON output
# ---------------------------------------------------------------------------


class Floats:
    """A list of floats written with a given printf format (None/inf/nan -> null)."""

    def __init__(self, values, fmt="%.7g"):
        self.values, self.fmt = list(values), fmt


def _fmt_float(v, fmt):
    v = float(v)
    if not math.isfinite(v):
        return "null"
    # "f32" = shortest decimal that reads back as the same float32 (exact for bf16 values)
    s = str(np.float32(v)) if fmt == "f32" else fmt % v
    if not any(c in s for c in ".en"):
        s += ".0"  # keep floats recognisable as floats
    return s


def to_json(obj, indent=0, step=1):
    pad = " " * (indent + step)
    if isinstance(obj, Floats):
        return "[" + ",".join(_fmt_float(v, obj.fmt) for v in obj.values) + "]"
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        flat = "{" + ", ".join(f"{json.dumps(str(k))}: {to_json(v, 0, 0)}" for k, v in obj.items()) + "}"
        if "\n" not in flat and len(flat) <= 100:
            return flat  # short records stay on one line
        items = [f"{pad}{json.dumps(str(k))}: {to_json(v, indent + step, step)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(obj, (list, tuple)):
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in obj):
            return "[" + ",".join(str(int(v)) for v in obj) + "]"
        if not obj:
            return "[]"
        items = [pad + to_json(v, indent + step, step) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    if isinstance(obj, float):
        return _fmt_float(obj, "%.9g")
    if isinstance(obj, np.integer):
        return str(int(obj))
    return json.dumps(obj, ensure_ascii=False)


def write_text(path, text):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_json_files(out, files):
    """Write every name -> object of `files` as the JSON file out/name."""
    for name, obj in files.items():
        write_json(os.path.join(out, name), obj)


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------


def train_bpe(tok, lines, n_ordinary):
    """Train `tok` (a BPE model with its pre-tokenizer set) to exactly n_ordinary tokens
    over the whole byte alphabet, so that any text encodes without unknown tokens."""
    trainer = trainers.BpeTrainer(
        vocab_size=n_ordinary,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(lines, trainer)
    if tok.get_vocab_size(with_added_tokens=False) != n_ordinary:
        raise RuntimeError(f"trained vocabulary has {tok.get_vocab_size()} tokens, wanted {n_ordinary}")


def add_special_tokens(tok, tokens, first_id):
    """Append `tokens` as special tokens; they must get the ids first_id, first_id+1, ..."""
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False) for t in tokens]
    )
    for i, t in enumerate(tokens):
        if tok.token_to_id(t) != first_id + i:
            raise RuntimeError(f"{t} got id {tok.token_to_id(t)}")


def save_tokenizer(tok, path, probe):
    """Save tokenizer.json with merges in the "left right" string form.

    Every `tokenizers` release reads that form (newer ones also write [left, right]
    pairs); byte-level tokens never contain a literal space, so it is unambiguous.  The
    saved file must encode `probe` exactly as `tok` does.
    """
    data = json.loads(tok.to_str())
    merges = data["model"]["merges"]
    for m in merges:
        if isinstance(m, list) and any(" " in part for part in m):
            raise RuntimeError(f"merge {m} contains a space")
    data["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in merges]
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    reloaded = Tokenizer.from_file(path)
    if reloaded.encode(probe, add_special_tokens=False).ids != tok.encode(probe, add_special_tokens=False).ids:
        raise RuntimeError("tokenizer.json does not reproduce the trained tokenizer")


def encode(tok, text):
    """Token ids of `text` as plain ints, without added special tokens."""
    return [int(i) for i in tok.encode(text, add_special_tokens=False).ids]


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------


def write_safetensors(path, tensors):
    """Write name -> float32 array (bf16-exact) as a BF16 safetensors file."""
    names = sorted(tensors)
    header, blobs, offset = {}, [], 0
    for name in names:
        bits = llada_ref.f32_to_bf16_bits(tensors[name]).astype("<u2")
        blob = bits.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((-len(hb)) % 8)  # data start aligned to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for blob in blobs:
            f.write(blob)
    return offset


def write_checkpoint(out, weights, shard_of):
    """Two shards (shard_of(name) is 1 or 2) plus model.safetensors.index.json."""
    shards = {1: {}, 2: {}}
    for name, arr in weights.items():
        shards[shard_of(name)][name] = arr
    weight_map, total = {}, 0
    for idx in (1, 2):
        fname = f"model-{idx:05d}-of-00002.safetensors"
        total += write_safetensors(os.path.join(out, fname), shards[idx])
        for name in shards[idx]:
            weight_map[name] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(os.path.join(out, "model.safetensors.index.json"), index)


# ---------------------------------------------------------------------------
# goldens
# ---------------------------------------------------------------------------


def logits_prompts(tok, bos_id, mask_id):
    """The three prompts of the logits goldens: bare text, BOS + text, BOS + text + masks."""
    text = encode(tok, "The quick brown fox jumps over the lazy dog. Question: What is 7 times 8? Answer: 56.")
    p1 = text[:5]
    p2 = [bos_id] + text[:11]
    p3 = [bos_id] + text[:14] + [mask_id] * 8
    p3[6] = mask_id  # one mask inside the prompt as well
    assert (len(p1), len(p2), len(p3)) == (5, 12, 23)
    return [("len5", p1), ("len12_bos", p2), ("len23_masks", p3)]


def margins(trace):
    """Smallest confidence margin and smallest logit margin over a generation's steps."""
    return min(s["conf_margin"] for s in trace), min(s["logit_margin"] for s in trace)


def try_case(run_case, is_interesting, params, name, prompt, fp):
    """Run one candidate golden generation: (out, trace, min_margin, min_logit_margin), or
    None when a margin is below MARGIN_FLOOR or the case does not exercise its option."""
    out, trace = run_case(params, prompt, fp)
    cm, lm = margins(trace)
    if cm < MARGIN_FLOOR or lm < MARGIN_FLOOR:
        return None
    if not is_interesting(name, params, prompt, fp, out, trace):
        return None
    return out, trace, cm, lm


# ---------------------------------------------------------------------------
# the makers' command line
# ---------------------------------------------------------------------------


def maker_args(description, default_out):
    """Parse --seed and --out, and empty the output folder (with its goldens/)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=default_out)
    args = ap.parse_args()
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    os.makedirs(os.path.join(args.out, "goldens"))
    return args


def report_size(out):
    """Print the fixture's size; a fixture must stay under 1 MiB (it is committed)."""
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"wrote {out} ({size} bytes)")
    if size >= 1 << 20:
        raise SystemExit("fixture is larger than 1 MiB")


# ---------------------------------------------------------------------------
# checkers
# ---------------------------------------------------------------------------

# the failed checks of this run (a checker is one process, so one list serves it)
FAILURES = []

FIXTURE_FILES = [
    "README.md", "config.json", "generation_config.json", "special_tokens_map.json",
    "tokenizer.json", "tokenizer_config.json", "chat_template_cases.json",
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    "model.safetensors.index.json", "goldens/logits.json", "goldens/generate.json",
]


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)
    return cond


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check_files(d, limit, limit_text):
    """Every fixture file is there and the folder is smaller than `limit` bytes."""
    for n in FIXTURE_FILES:
        check(os.path.isfile(os.path.join(d, n)), f"missing file {n}")
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
    check(size < limit, f"fixture is {size} bytes (limit {limit_text})")
    print(f"files ok, {size} bytes")


def check_round_trips(tok, texts, special_ids):
    """Encoding never adds tokens (no post-processor), every text decodes back to itself,
    and every special token (name -> id) is that one token."""
    for t in texts:
        without = tok.encode(t, add_special_tokens=False).ids
        check(tok.encode(t, add_special_tokens=True).ids == without, f"add_special_tokens changes the encoding of {t!r}")
        check(tok.decode(without, skip_special_tokens=False) == t, f"round trip of {t!r}")
    for t, i in special_ids.items():
        check(tok.encode(t, add_special_tokens=False).ids == [i], f"{t} is not one token")


def check_shards(d, params):
    """Re-read every shard with the `safetensors` library and compare with params (a
    reference's load_checkpoint); every tensor must be stored as BF16.  Returns the data
    bytes and (shard, name) of each tensor."""
    import safetensors

    index = load(os.path.join(d, "model.safetensors.index.json"))
    tensors = params["tensors"]
    total, placed = 0, []
    for fname in sorted(set(index["weight_map"].values())):
        path = os.path.join(d, fname)
        with open(path, "rb") as f:
            raw = f.read()
        (n,) = struct.unpack("<Q", raw[:8])
        check((8 + n) % 8 == 0, f"{fname}: data start not 8-byte aligned")
        # the safetensors library parses the file and hands back raw bytes per tensor
        for name, info in safetensors.deserialize(raw):
            check(info["dtype"] in ("bfloat16", "BF16"), f"{fname}:{name} dtype {info['dtype']}")
            bits = np.frombuffer(bytes(info["data"]), dtype="<u2").reshape(info["shape"])
            check(np.array_equal(llada_ref.bf16_bits_to_f32(bits), tensors[name]), f"{fname}:{name} differs between readers")
            check(index["weight_map"][name] == fname, f"{name} not in the shard the index names")
            total += bits.nbytes
            placed.append((fname, name))
        with safetensors.safe_open(path, framework="numpy") as f:
            check(set(f.keys()) == {k for k, v in index["weight_map"].items() if v == fname}, f"{fname}: key set")
    check(index["metadata"]["total_size"] == total, "index total_size")
    check(all(v == "BF16" for v in params["dtypes"].values()), "every tensor must be BF16")
    return total, placed


def finish_checks():
    """Exit with status 1 if any check failed."""
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        sys.exit(1)
    print("all checks passed")
