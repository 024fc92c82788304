"""DiffusionGemma's cases of tools/parity.py (docstring there: tolerances, exit status).

`unmask logits` on a DiffusionGemma folder gives the encoder's soft-capped logits over a
prompt, or the decoder's over a list of canvases after it, canvas i >= 1 self-conditioned on
canvas i-1's logits divided by the temperature of step i-1 of the reference's loop.  Only
those passes can be compared:

* goldens (standard library only, like the rest of parity.py's goldens mode): the float32
  tensors of `goldens/logits.safetensors` as `goldens/logits.json` describes them.  Encoder
  cases run the prompt; decoder cases run the prompt then the canvas.  A decoder case whose
  self-conditioning tensor is, bit for bit, another decoder case's logits over the same
  prompt divided by the first step's temperature runs as that case's canvas followed by its
  own (`--canvas-ids C0 --canvas-ids C`), compared on the second canvas.  Commit passes
  and decoders after a committed canvas are listed as not comparable: the CLI has no commit.
* torch: tools/dgemma_torch.py (transformers' model) over pseudo-random prompts and canvases.

Generations are never compared: the sampler's draws come from torch's generator, which the
runtime does not reproduce; tests/all/dgemma.rs replays the fixture's recorded draws.
"""

from __future__ import annotations

import array
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dgemma_common  # noqa: E402  (standard library only)
import llada_common  # noqa: E402
import parity  # noqa: E402

from parity import SetupError, compare_logits  # noqa: E402

GENERATIONS = (
    "the sampler draws from torch's generator, which the runtime does not reproduce; "
    "tests/all/dgemma.rs replays the fixture's recorded draws step by step"
)
CANVASES = 3  # decoder steps of the torch cases: the first unconditioned, then two chained
LONG_PROMPT_LIMIT = 160  # longest extra prompt (tokens) that the row-by-row comparison stays quick on


def f32(x):
    """x rounded to the nearest float32, as a Python float."""
    return array.array("f", [x])[0]


def temperature(gen, steps_left):
    """The reference's temperature with `steps_left` steps to go, rounded as it computes it:
    an int32 step over N in float32, times `t_max - t_min` (a Python float made float32),
    plus t_min (gen.py:298-317; `unmask logits` rounds the same way)."""
    frac = f32(steps_left / gen["max_denoising_steps"])
    return f32(f32(gen["t_min"]) + f32(f32(gen["t_max"] - gen["t_min"]) * frac))


def generations_note(args):
    if args.no_generate:
        return []
    return [{"name": "DiffusionGemma generations", "skipped": GENERATIONS, "pass": True}]


# ---------------------------------------------------------------------------
# goldens
# ---------------------------------------------------------------------------


def read_f32_safetensors(path):
    """name -> (shape, flat array of float32) of every tensor of a float32 .safetensors file:
    an 8-byte little-endian header length, a JSON header of byte ranges, the raw values."""
    try:
        with open(path, "rb") as f:
            header, _ = llada_common.read_safetensors_header(f)
            data = f.read()  # the ranges count from the end of the header
    except (OSError, ValueError) as e:
        raise SetupError(f"cannot read {path}: {e}") from None
    tensors = {}
    try:
        entries = list(llada_common.safetensors_entries(path, header))
    except (ValueError, NotImplementedError) as e:
        raise SetupError(str(e)) from None
    for name, dtype, shape, begin, end in entries:
        if dtype != "F32":
            raise SetupError(f"{path}: {name} is {dtype}; the goldens are float32")
        if end > len(data):
            raise SetupError(f"{path}: {name} runs past the end of the file")
        values = array.array("f")
        values.frombytes(data[begin:end])
        if sys.byteorder != "little":
            values.byteswap()
        tensors[name] = (shape, values)
    return tensors


def self_conditioning_source(case, cases, tensors, t_first):
    """The decoder case the CLI can run just before `case` to self-condition it as its golden
    was: over the same prompt, uncommitted and unconditioned, with logits whose quotient by
    the first step's temperature is the golden's self-conditioning tensor bit for bit."""
    shape, wanted = tensors[case["self_conditioning"]]
    for c in cases:
        if c["pass"] != "decoder" or c["commits"] or c.get("self_conditioning") or c["prompt"] != case["prompt"]:
            continue
        c_shape, logits = tensors[c["name"]]
        # array('f') rounds each float64 quotient of two float32 values: their float32 quotient
        if c_shape == shape and array.array("f", (x / t_first for x in logits)) == wanted:
            return c
    return None


def golden_plan(case, cases, tensors, t_first):
    """(prompt, canvases, index of the compared canvas or None for the encoder's rows) of the
    `unmask logits` run that computes a golden, or a string saying why none can."""
    kind = case["pass"]
    if kind == "encoder":
        return case["prompt"], [], None
    if kind == "commit":
        return "a commit pass's logits: the CLI gives the encoder's over a prompt from position 0 only"
    if kind != "decoder":
        return f"unknown pass {kind!r}"
    if case["commits"]:
        return "a decoder after a committed canvas: the CLI cannot commit one"
    if case["start"] != len(case["prompt"]):
        return f"the canvas starts at {case['start']}, not after the prompt"
    if not case.get("self_conditioning"):
        return case["prompt"], [case["canvas"]], 0
    source = self_conditioning_source(case, cases, tensors, t_first)
    if source is None:
        return (
            f"its self-conditioning {case['self_conditioning']} is no decoder case's logits / T = {t_first:g} "
            "over this prompt, which is all the CLI feeds"
        )
    return case["prompt"], [source["canvas"], case["canvas"]], 1


def goldens_cases(args, runtime, tol):
    """Logit comparisons against the fixture's float32 goldens; generations not compared."""
    if args.golden_logits != "f32":
        raise SetupError("DiffusionGemma's goldens are float32 only: use --golden-logits f32")
    gdir = os.path.join(args.model, "goldens")
    try:
        with open(os.path.join(gdir, "logits.json"), encoding="utf-8") as f:
            cases = json.load(f)["cases"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise SetupError(f"goldens not found: {e}") from None
    tensors = read_f32_safetensors(os.path.join(gdir, "logits.safetensors"))
    missing = sorted({c["name"] for c in cases} - set(tensors))
    missing += sorted({c["self_conditioning"] for c in cases if c.get("self_conditioning")} - set(tensors))
    if missing:
        raise SetupError(f"goldens/logits.safetensors lacks {missing}")
    gen = dgemma_common.load_generation_config(args.model)
    t_first = temperature(gen, gen["max_denoising_steps"])
    results = []
    for case in cases:
        plan = golden_plan(case, cases, tensors, t_first)
        if isinstance(plan, str):
            results.append({"name": case["name"], "skipped": plan, "pass": True})
            continue
        prompt, canvases, index = plan
        want = parity.rows_of(*tensors[case["name"]])
        if index is None:
            got, name, ids = runtime.logits(prompt), f"{case['name']}: encoder", prompt
        else:
            got, ids = runtime.logits(prompt, canvases)[index], canvases[index]
            name = f"{case['name']}: decoder after {len(prompt)} prompt tokens"
            if index:
                name += f", canvas {index} of {len(canvases)} (self-conditioned on canvas {index - 1} / T {t_first:g})"
        results.append(compare_logits(name, ids, got, want, tol))
    return results, generations_note(args)


# ---------------------------------------------------------------------------
# PyTorch (tools/dgemma_torch.py)
# ---------------------------------------------------------------------------


def pseudo_random_ids(n, vocab, seed):
    """n fixed ids below `vocab` from a 64-bit LCG (another stream than parity.default_ids)."""
    ids, state = [], seed
    for _ in range(n):
        state = (state * 2862933555777941757 + 3037000493) % (1 << 64)
        ids.append(int((state >> 33) % vocab))
    return ids


def rows(a):
    """A float32 numpy array [T, V] as the row arrays compare_logits reads."""
    return [array.array("f", row.astype("<f4").tobytes()) for row in a]


def torch_cases(args, runtime, tol):
    """The encoder over the prompts and the decoder over a self-conditioned chain of canvases,
    against transformers' model in --ref-dtype; generations not compared."""
    import dgemma_torch
    import torch_common

    device = args.device or torch_common.default_device()
    try:
        model = dgemma_torch.load(args.model, device, args.ref_dtype)
    except (ValueError, NotImplementedError, OSError, ImportError) as e:
        raise SetupError(f"tools/dgemma_torch.py cannot load {args.model}: {e}") from None
    cfg = model.cfg
    vocab, window, canvas_len = cfg["vocab_size"], cfg["sliding_window"], cfg["canvas_length"]
    if args.ids:
        prompts = [(f"ids{i}", ids) for i, ids in enumerate(args.ids)]
    else:
        prompts = [("prompt", parity.default_ids({"vocab_size": vocab}))]
        # past two windows the encoder's sliding layers drop keys for most queries, and the
        # decoder after it sees only the last W - 1 prompt positions in those layers
        n = 2 * window + 3
        if n <= LONG_PROMPT_LIMIT:
            prompts.append((f"prompt{n}", pseudo_random_ids(n, vocab, 7)))
    results = []
    if not args.canvas_only:
        for name, ids in prompts:
            want = rows(model.encoder_logits(ids))
            results.append(compare_logits(f"encoder {name}", ids, runtime.logits(ids), want, tol))
    prompt_name, prompt = max(prompts, key=lambda p: len(p[1]))
    canvases = [pseudo_random_ids(canvas_len, vocab, 101 + i) for i in range(CANVASES)]
    want = model.decoder_logits(prompt, canvases)
    got = runtime.logits(prompt, canvases)
    gen = model.generation
    for i, canvas in enumerate(canvases):
        name = f"decoder canvas {i} after {prompt_name}"
        if i:
            t = temperature(gen, max(gen["max_denoising_steps"] - (i - 1), 1))
            name += f", self-conditioned on canvas {i - 1} / T {t:.6g}"
        results.append(compare_logits(name, canvas, got[i], rows(want[i]), tol))
    info = {"device": str(model.device), "dtype": args.ref_dtype, "model": "diffusion_gemma"}
    return results, generations_note(args), info
