"""Parity of the runtime (`unmask logits`, `unmask generate`) with a reference.

For each id sequence it runs `unmask logits` and the reference over the same checkpoint
and prints, per position, the max and mean absolute error, the cosine similarity and
whether the argmax agrees; then a summary per sequence and whole temperature-0
generations compared token for token (agreement and first differing position).

References
----------
* `--against goldens` (standard library only: no numpy, no torch): the golden files of
  the checkpoint folder (LLaDA's of tools/llada_ref.py, or a Dream folder's of
  tools/dream_ref.py, whose cases carry Dream's `alg`), `goldens/logits.json` (logits for a few
  id sequences; `--golden-logits f32` (default) or `bf16` picks which path) and
  `goldens/generate.json` (sampler cases with the whole output).  Cases with `random`
  remasking are listed as not comparable: the runtime and numpy draw different random
  numbers.  A DiffusionGemma folder (`"model_type": "diffusion_gemma"`) has float32
  goldens in `goldens/logits.safetensors`, read here without numpy: the encoder cases and
  the decoder cases `unmask logits` can express are compared (see tools/parity_dgemma.py);
  commit passes and decoders after a commit are listed as not comparable.
* `--against torch`: tools/llada_torch.py, or tools/dream_torch.py when the folder's
  config.json has `"model_type": "Dream"`, on `--device` (default cuda when available)
  in `--ref-dtype f32` (default) or `bf16`, over `--ids` (repeatable; default: a
  pseudo-random prompt and the same prompt followed by masks, the shape of a generation
  canvas) and one generation from `--gen-prompt-ids` (default: that prompt).  A Dream
  generation runs Dream's timestep schedule on both sides with `--remasking` (Dream's
  alg: maskgit_plus, the default, topk_margin or entropy) and `--eps` (default 1e-3);
  with `--block-length` below `--gen-length`, or `--threshold`, it is Fast-dLLM's block
  schedule.  A DiffusionGemma folder runs tools/dgemma_torch.py (transformers' model): the
  encoder over the `--ids` prompts (default: the pseudo-random prompt, and a longer one
  past the sliding window when the window is small) and the decoder over 3 pseudo-random
  canvases after the longest prompt, each self-conditioned on the one before.
  Without PyTorch it prints "skipped: PyTorch is not installed" and exits 0,
  or 2 with `--require-torch`.
* DiffusionGemma generations are not compared: its sampler draws from torch's generator,
  which the runtime does not reproduce; tests/all/dgemma.rs replays the fixture's recorded
  draws instead.

Tolerances
----------
Logit errors scale with the logits, so the bound is `atol + rtol * scale`, scale being
the largest |logit| of the reference over the sequence.  Against a float32 reference
(the goldens' f32 path, torch f32) the defaults are rtol 1e-4, atol 1e-5 and cosine
>= 0.99999: the runtime computes in float32 (weights widened exactly from bf16), so
only summation order and transcendental functions differ; the observed error on the
tiny fixture is about 2e-6 of the scale.  Against a bf16 reference the defaults are
rtol 0.06 and cosine >= 0.998: the reference rounds every intermediate to 8 mantissa
bits while the runtime keeps float32, which moves the logits by a few percent of the
scale (about 4% on the tiny fixture).  DiffusionGemma's bf16 reference is looser still: it also
rounds the embedding scale sqrt(D) to bf16 (spec section 4.1; 6.93 -> 6.94 on the tiny
fixture, 53.07 -> 53.0 on the published model) and the self-conditioning logits, while the
runtime computes in float32 throughout.
A differing argmax fails only where the reference's top-2 gap exceeds twice the bound
(elsewhere the tolerance itself allows the flip); raw agreement is reported too.
Generations must agree on every token and every step's commits against a float32
reference (`--gen-min-agreement 1.0`); against bf16 they are reported but not judged
unless `--gen-min-agreement` is given, because one flipped near-tie changes the rest
of the canvas.

Exit status: 0 parity holds (or torch skipped), 1 parity fails, 2 setup or usage error.

Modules: this script keeps the references and the command line; tools/parity_runtime.py
runs `unmask` and reads its .npy output, tools/parity_compare.py computes the figures and
prints the report (both standard library only), tools/parity_dgemma.py has DiffusionGemma's
cases.

Examples (from the repository root):

    python3 tools/parity.py --against goldens --model tests/fixtures/tiny --unmask target/debug/unmask
    python3 tools/parity.py --against goldens --model tests/fixtures/tiny-dream --unmask target/debug/unmask
    python3 tools/parity.py --against goldens --model tests/fixtures/tiny-dgemma --unmask target/debug/unmask
    tools/.venv/bin/python tools/parity.py --against torch --device cpu --ref-dtype f32 --model models/tiny
    tools/.venv/bin/python tools/parity.py --against torch --device cpu --model tests/fixtures/tiny-dream \\
        --remasking entropy --block-length 32
    tools/.venv/bin/python tools/parity.py --against torch --device cpu --model tests/fixtures/tiny-dgemma
"""

from __future__ import annotations

import argparse
import array
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llada_common  # noqa: E402  (standard library only, like this script's goldens mode)

# The runtime side and the comparisons (with the report) are modules of their own; their
# names are re-exported because tools/parity_dgemma.py reads some of them as parity.NAME.
from parity_compare import (  # noqa: E402,F401
    argmax_and_gap,
    compare_generation,
    compare_logits,
    compare_row,
    print_report,
    runtime_steps,
    strict_json,
)
from parity_runtime import ROOT, Runtime, SetupError, find_unmask, join_ids, read_npy, rows_of  # noqa: E402,F401

# tools/parity_dgemma.py imports this module by name.  Run as a script it is __main__, and
# without this alias that import would load and run a second copy of this file.
sys.modules.setdefault("parity", sys.modules[__name__])

# default tolerances by reference numerics: (rtol, atol, min cosine, generation agreement)
TOLERANCES = {
    "f32": (1e-4, 1e-5, 0.99999, 1.0),
    "bf16": (0.06, 1e-3, 0.998, None),
}


# ---------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------


def goldens_cases(args, runtime, tol):
    """Logit and generation comparisons against the checkpoint's golden files."""
    if model_type(args.model) == "diffusion_gemma":
        import parity_dgemma

        return parity_dgemma.goldens_cases(args, runtime, tol)
    gdir = os.path.join(args.model, "goldens")
    try:
        with open(os.path.join(gdir, "logits.json"), encoding="utf-8") as f:
            logits_doc = json.load(f)
        gen_doc = None
        if not args.no_generate:  # --no-generate: a checkpoint with logit goldens only
            with open(os.path.join(gdir, "generate.json"), encoding="utf-8") as f:
                gen_doc = json.load(f)
    except OSError as e:
        raise SetupError(f"goldens not found: {e}") from None
    key = "logits_" + args.golden_logits
    logit_results = []
    for case in logits_doc["cases"]:
        if key not in case:
            raise SetupError(f"{case['name']}: the goldens have no {key} (only the f32 path for Dream)")
        got = runtime.logits(case["ids"])
        logit_results.append(compare_logits(case["name"], case["ids"], got, case[key], tol))
    gen_results = []
    if not args.no_generate:
        for case in gen_doc["cases"]:
            params = case["params"]
            random = params.get("remasking") == "random" or params.get("alg") == "origin" or params.get("alg_temp")
            if random or params["temperature"] != 0:
                gen_results.append(
                    {
                        "name": case["name"],
                        "skipped": "random numbers differ between the runtime and numpy",
                        "pass": True,
                    }
                )
                continue
            # llada_ref ranks float32 (from float64) confidences: no bf16 rounding
            out = runtime.generate(case["prompt"], dict(params, confidence_precision=args.confidence_precision or "f32"))
            Lp = len(case["prompt"])
            if out["prompt_ids"] != case["prompt"]:
                raise SetupError(f"{case['name']}: the runtime changed the prompt ids")
            # Dream's goldens list steps that commit nothing; the runtime skips them.
            want_steps = [(list(s["committed"]), list(s["tokens"])) for s in case["steps"] if s["committed"]]
            gen_results.append(
                compare_generation(
                    case["name"],
                    case["prompt"],
                    out["ids"],
                    runtime_steps(out),
                    case["output"][Lp:],
                    want_steps,
                    tol["gen_min_agreement"],
                )
            )
    return logit_results, gen_results


def default_ids(cfg, n=12):
    """A fixed pseudo-random prompt over the tokenizer's ids, avoiding the mask id."""
    mask = cfg.get("mask_token_id")
    vocab = min(cfg["vocab_size"], cfg.get("embedding_size") or cfg["vocab_size"])
    ids, state = [], 20240531
    while len(ids) < n:
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)  # LCG
        t = (state >> 33) % vocab
        if t != mask:
            ids.append(int(t))
    return ids


def model_type(directory):
    """The folder's config.json `model_type`, lower-cased: "dream", "diffusion_gemma", or
    another (LLaDA's)."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SetupError(f"cannot read {directory}/config.json: {e}") from None
    return str(raw.get("model_type", "")).lower()


def torch_cases(args, runtime, tol):
    """Logit and generation comparisons against tools/llada_torch.py, or tools/dream_torch.py
    for a Dream checkpoint, or tools/dgemma_torch.py for a DiffusionGemma one."""
    import torch  # noqa: F401  (checked importable by the caller)
    import llada_torch
    import torch_common

    kind = model_type(args.model)
    if kind == "dream":
        return dream_torch_cases(args, runtime, tol)
    if kind == "diffusion_gemma":
        import parity_dgemma

        return parity_dgemma.torch_cases(args, runtime, tol)
    if args.remasking is not None or args.eps is not None:
        raise SetupError("--remasking and --eps are Dream's generation options; this is not a Dream checkpoint")
    device = args.device or torch_common.default_device()
    model = llada_torch.load(args.model, device, args.ref_dtype)
    mask = model.config.get("mask_token_id")
    cases, logit_results = reference_cases(args, model, runtime, tol)
    gen_results = []
    if not args.no_generate:
        prompt = args.gen_prompt_ids or [t for t in cases[0][1] if t != mask]
        params = {
            "gen_length": args.gen_length,
            "steps": args.steps if args.steps is not None else args.gen_length,
            "block_length": args.block_length if args.block_length is not None else args.gen_length,
            "cfg_scale": args.cfg_scale,
            "threshold": args.threshold,
            "logits_eos_inf": args.logits_eos_inf,
            "confidence_eos_eot_inf": args.confidence_eos_eot_inf,
        }
        # every key of params is a sampler option of the same name in llada_torch
        precision = args.confidence_precision or args.ref_dtype
        ref = model.generate(prompt, round_confidence_bf16=precision == "bf16", **params)
        out = runtime.generate(prompt, dict(params, confidence_precision=precision))
        want_steps = [(s["positions"], s["tokens"]) for s in ref["steps"]]
        name = "generate gen_length={gen_length} steps={steps} block_length={block_length}".format(**params)
        name += f" confidences={precision}"
        if params["cfg_scale"]:
            name += f" cfg_scale={params['cfg_scale']:g}"
        if params["threshold"] is not None:
            name += f" threshold={params['threshold']:g}"
        name += "".join(f" {k}" for k in ("logits_eos_inf", "confidence_eos_eot_inf") if params[k])
        gen_results.append(
            compare_generation(
                name, prompt, out["ids"], runtime_steps(out), ref["ids"], want_steps, tol["gen_min_agreement"]
            )
        )
    return logit_results, gen_results, {"device": str(model.device), "dtype": args.ref_dtype}


def reference_cases(args, model, runtime, tol):
    """Logit comparisons of the default (or `--ids`) sequences against `model.forward`."""
    mask = model.config.get("mask_token_id")
    if args.ids:
        cases = [(f"ids{i}", ids) for i, ids in enumerate(args.ids)]
    else:
        prompt = default_ids(model.config)
        cases = [("prompt", prompt)]
        if mask is not None:
            cases.append(("canvas", prompt + [mask] * 20))
            if args.canvas_only:
                cases = cases[1:]
    results = []
    for name, ids in cases:
        ref = model.forward(ids).cpu()
        ref_rows = [array.array("f", row) for row in ref.tolist()]
        got = runtime.logits(ids)
        results.append(compare_logits(name, ids, got, ref_rows, tol))
    return cases, results


def dream_torch_cases(args, runtime, tol):
    """Logit and generation comparisons of a Dream checkpoint against tools/dream_torch.py:
    unshifted logits, and one generation on Dream's timestep schedule (`--remasking` is
    Dream's alg) through both samplers."""
    import dream_torch
    import torch_common

    unsupported = [
        flag
        for flag, given in (
            ("--cfg-scale", args.cfg_scale),
            ("--logits-eos-inf", args.logits_eos_inf),
            ("--confidence-eos-eot-inf", args.confidence_eos_eot_inf),
        )
        if given
    ]
    if unsupported:
        raise SetupError(f"{', '.join(unsupported)}: LLaDA's generation options, not Dream's")
    alg = args.remasking or "maskgit_plus"
    if args.threshold is not None and alg != "maskgit_plus":
        raise SetupError("--threshold ranks probabilities: use it with --remasking maskgit_plus")
    device = args.device or torch_common.default_device()
    try:
        model = dream_torch.load(args.model, device, args.ref_dtype)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        raise SetupError(f"tools/dream_torch.py cannot load {args.model}: {e}") from None
    cases, logit_results = reference_cases(args, model, runtime, tol)
    gen_results = []
    if not args.no_generate:
        mask = model.config.get("mask_token_id")
        prompt = args.gen_prompt_ids or [t for t in cases[0][1] if t != mask]
        params = {
            "gen_length": args.gen_length,
            "steps": args.steps if args.steps is not None else args.gen_length,
            "block_length": args.block_length if args.block_length is not None else args.gen_length,
            "threshold": args.threshold,
            "alg": alg,
            "eps": 1e-3 if args.eps is None else args.eps,
        }
        # every key of params is a generate() option of the same name in dream_torch; the
        # "alg" key makes Runtime.generate pass --schedule dream, --eps and --remasking
        precision = args.confidence_precision or args.ref_dtype
        ref = model.generate(prompt, round_confidence_bf16=precision == "bf16", **params)
        out = runtime.generate(prompt, dict(params, confidence_precision=precision))
        want_steps = [(s["positions"], s["tokens"]) for s in ref["steps"]]
        name = "dream generate gen_length={gen_length} steps={steps} block_length={block_length} alg={alg}".format(
            **params
        )
        name += f" eps={params['eps']:g} confidences={precision}"
        if params["threshold"] is not None:
            name += f" threshold={params['threshold']:g}"
        gen_results.append(
            compare_generation(
                name, prompt, out["ids"], runtime_steps(out), ref["ids"], want_steps, tol["gen_min_agreement"]
            )
        )
    return logit_results, gen_results, {"device": str(model.device), "dtype": args.ref_dtype, "model": "dream"}



def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Compare the runtime's logits and generations with a reference.",
        epilog="Tolerances and exit status: see the docstring of tools/parity.py.",
    )
    add = ap.add_argument
    add("--against", choices=["goldens", "torch"], required=True, help="the reference")
    fixture = os.path.join("tests", "fixtures", "tiny")
    add("--model", default=fixture, help="checkpoint folder (default tests/fixtures/tiny)")
    add("--unmask", help="runtime binary (default target/release/unmask, else target/debug/unmask)")
    add("--backend", help="passed to unmask as --backend")
    add("--dtype", help="passed to unmask as --dtype (f16, f16-packed, f32)")
    add("--matmul", help="passed to unmask as --matmul (a kernel: tiled, gemm, narrow, coop, ...)")
    add("--kv", choices=["f32", "f16"], help="passed to unmask as --kv (K/V arena storage)")
    add(
        "--tune",
        choices=["auto", "always", "off"],
        help="passed to unmask as --tune (off: the fixed kernel choice, never a measured tensor-core kernel)",
    )
    add("--golden-logits", choices=["f32", "bf16"], default="f32", help="goldens: which logits path (default f32)")
    add("--device", help="torch: cpu or cuda (default cuda when available)")
    add("--ref-dtype", choices=["f32", "bf16"], default="f32", help="torch: reference numerics (default f32)")
    add("--require-torch", action="store_true", help="torch: exit 2 instead of skipping without PyTorch")
    add("--ids", action="append", type=llada_common.parse_ids, help="torch: an id sequence to compare (repeatable)")
    add("--gen-prompt-ids", type=llada_common.parse_ids, help="torch: prompt of the generation")
    add("--gen-length", type=int, default=32, help="torch: generation length (default 32)")
    add("--steps", type=int, help="torch: steps (default gen-length)")
    add("--block-length", type=int, default=16, help="torch: block length (default 16)")
    add("--cfg-scale", type=float, default=0.0, help="torch: CFG weight of the generation")
    add("--threshold", type=float, help="torch: Fast-dLLM threshold of the generation")
    add("--logits-eos-inf", action="store_true", help="torch: generation flag")
    add("--confidence-eos-eot-inf", action="store_true", help="torch: generation flag")
    add(
        "--remasking",
        "--alg",
        dest="remasking",
        choices=["maskgit_plus", "topk_margin", "entropy"],
        help="torch, Dream checkpoints: Dream's alg of the generation (default maskgit_plus)",
    )
    add("--eps", type=float, help="torch, Dream checkpoints: the timestep schedule's eps (default 1e-3)")
    add(
        "--confidence-precision",
        choices=["f32", "bf16"],
        help="generations: precision of the confidences both sides rank (default: f32 against the "
        "goldens, the reference dtype against torch)",
    )
    add("--no-generate", action="store_true", help="compare logits only")
    add(
        "--canvas-only",
        action="store_true",
        help="torch: of the default sequences only the canvas (the prompt and masks): one load of the "
        "checkpoint by the runtime instead of two",
    )
    add("--rtol", type=float, help="bound = atol + rtol x max|reference logit| (default by reference numerics)")
    add("--atol", type=float)
    add("--min-cosine", type=float)
    add("--gen-min-agreement", type=float, help="required token agreement of generations (0..1)")
    add("--quiet", action="store_true", help="summaries only, no per-position table")
    add("--json", metavar="OUT", help="also write every figure to this JSON file")
    args = ap.parse_args(argv)

    if args.against == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            if args.require_torch:
                print("error: PyTorch is not installed (--require-torch)", file=sys.stderr)
                return 2
            print("skipped: PyTorch is not installed (use tools/.venv/bin/python, or --against goldens)")
            return 0

    numerics = args.golden_logits if args.against == "goldens" else args.ref_dtype
    rtol, atol, min_cos, gen_agree = TOLERANCES[numerics]
    tol = {
        "rtol": rtol if args.rtol is None else args.rtol,
        "atol": atol if args.atol is None else args.atol,
        "min_cosine": min_cos if args.min_cosine is None else args.min_cosine,
        # the goldens' generations were decided on the float32 path whatever the logits flag
        "gen_min_agreement": (1.0 if args.against == "goldens" else gen_agree)
        if args.gen_min_agreement is None
        else args.gen_min_agreement,
    }
    try:
        runtime = Runtime(
            find_unmask(args.unmask), args.model, args.backend, args.dtype, args.matmul, args.kv, args.tune
        )
        reference = {"against": args.against}
        if args.against == "goldens":
            logit_results, gen_results = goldens_cases(args, runtime, tol)
            reference["logits"] = args.golden_logits
        else:
            logit_results, gen_results, info = torch_cases(args, runtime, tol)
            reference.update(info)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    ref_text = ", ".join(f"{k} {v}" for k, v in reference.items() if k != "against")
    print(
        f"parity: {runtime.binary} (backend {args.backend or 'default'}, dtype {args.dtype or 'default'}) "
        f"against {args.against} ({ref_text}) on {args.model}"
    )
    agreement = "(not judged)" if tol["gen_min_agreement"] is None else tol["gen_min_agreement"]
    print(
        f"tolerance: bound = {tol['atol']:g} + {tol['rtol']:g} x scale, cosine >= {tol['min_cosine']}, "
        f"generation agreement >= {agreement}"
    )
    print_report(logit_results, gen_results, args.quiet)
    ok = all(r["pass"] for r in logit_results) and all(g["pass"] for g in gen_results)
    judged = [g for g in gen_results if "skipped" not in g]
    compared = [r for r in logit_results if "skipped" not in r]
    logit_ok = sum(r["pass"] for r in compared)
    gen_ok = sum(g["pass"] for g in judged)
    unmatched = len(logit_results) - len(compared)
    logit_text = f"{logit_ok}/{len(compared)} logit cases" + (f" ({unmatched} not comparable)" if unmatched else "")
    print(
        f"\nparity {'OK' if ok else 'FAILED'}: {logit_text}, "
        f"{gen_ok}/{len(judged)} generations" + ("" if all(g["judged"] for g in judged) else " (reported only)")
    )
    if args.json:
        doc = {
            "model": args.model,
            "unmask": runtime.binary,
            "backend": args.backend,
            "dtype": args.dtype,
            "matmul": args.matmul,
            "tune": args.tune,
            "kv": args.kv,
            "reference": reference,
            "tolerance": tol,
            "logits": logit_results,
            "generation": gen_results,
            "pass": ok,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(strict_json(doc), f, indent=1, allow_nan=False)
            f.write("\n")
    return 0 if ok else 1



if __name__ == "__main__":
    sys.exit(main())
