"""Exact-match evaluation of an exported LLaDA model folder on a task set, in Python.

Two samplers, both the reference low-confidence `generate` (llada.md 3.1) at temperature 0
without a cache:

* `ref`: tools/llada_ref.py (numpy float32 forward, float64 softmax confidences, ties to
  the lowest position); slow, used on a subset;
* `torch`: the same algorithm around the PyTorch forward of tools/train.py on the
  exported bf16 weights (float32 compute); fast enough for the whole set.

Answer extraction (the rule of `unmask eval`): decode the generated ids with special
tokens skipped, cut at the first <|eot_id|>/<|endoftext|>, take the text after the last
"####", trim it, and compare it with the item's `answer` exactly.

Usage:
  tools/.venv/bin/python tools/py_eval.py --model models/tiny --set data/tasks/heldout.jsonl \
      --out models/tiny/eval_python.json [--ref-items 50]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llada_ref  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402


def load_items(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def torch_model(params):
    c = params["config"]
    cfg = {k: c[k] for k in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size",
                             "embedding_size", "max_sequence_length", "rope_theta", "rms_norm_eps")}
    m = train.LLaDA(cfg)
    m.load_state_dict({k[len("model."):]: torch.from_numpy(v) for k, v in params["tensors"].items()}, strict=True)
    m.eval()
    return m


def run(items, sampler, params, tok, ids, model, gen_length, steps, block_length, batch=20):
    per, rows = {}, []
    t0 = time.time()
    prompts = [tok.encode(tasks.render_chat(it["system"], it["user"]), add_special_tokens=False).ids for it in items]
    gens = [None] * len(items)
    if sampler == "ref":
        for i, prompt in enumerate(prompts):
            out, _ = llada_ref.generate(params, prompt, gen_length, steps, block_length, temperature=0.0,
                                        mask_id=ids.mask, eos_id=ids.eos)
            gens[i] = [int(t) for t in out[len(prompt):]]
    else:
        order = sorted(range(len(items)), key=lambda i: len(prompts[i]))
        for s in range(0, len(order), batch):
            chunk = order[s : s + batch]
            outs = train.generate_batch(model, [prompts[i] for i in chunk], ids, steps=steps, gen_length=gen_length,
                                        block_length=block_length)
            for i, g in zip(chunk, outs):
                gens[i] = g
    for it, prompt, gen in zip(items, prompts, gens):
        got = train.extract_answer(tok, ids, gen)
        ok = got == it["answer"]
        c, n = per.get(it["task"], (0, 0))
        per[it["task"]] = (c + int(ok), n + 1)
        rows.append({"id": it["id"], "task": it["task"], "answer": it["answer"], "got": got, "ok": ok,
                     "prompt_tokens": len(prompt), "generated": gen})
    correct = sum(r["ok"] for r in rows)
    return {
        "sampler": sampler, "n": len(rows), "correct": correct, "accuracy": correct / max(1, len(rows)),
        "per_task": per, "seconds": time.time() - t0, "items": rows,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--set", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sampler", choices=["torch", "ref", "both"], default="both")
    ap.add_argument("--ref-items", type=int, default=50, help="items (from the start of the set) for the numpy sampler")
    ap.add_argument("--ref-set", default=None, help="task set for the numpy sampler (default: --set)")
    ap.add_argument("--also-set", action="append", default=[], help="more task sets for the torch sampler")
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--block-length", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(2)

    params = llada_ref.load_checkpoint(args.model)
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    ids = train.Ids(tok)
    model = torch_model(params)
    result = {"model": args.model, "gen_length": args.gen_length, "steps": args.steps,
              "block_length": args.block_length, "temperature": 0.0, "remasking": "low_confidence", "runs": []}
    if args.sampler in ("torch", "both"):
        for path in [args.set] + args.also_set:
            items = load_items(path)
            r = run(items, "torch", params, tok, ids, model, args.gen_length, args.steps, args.block_length)
            r["set"] = os.path.relpath(path)
            r["sampler"] = "PyTorch forward on the exported bf16 weights, float32 compute"
            result["runs"].append(r)
            print(f"torch {path}: {r['correct']}/{r['n']} = {r['accuracy']:.3f} {r['per_task']} ({r['seconds']:.0f} s)",
                  flush=True)
    if args.sampler in ("ref", "both"):
        ref_set = args.ref_set or args.set
        items = load_items(ref_set)[: args.ref_items]
        r = run(items, "ref", params, tok, ids, model, args.gen_length, args.steps, args.block_length)
        r["set"] = os.path.relpath(ref_set) + (f" (first {len(items)})" if len(items) < len(load_items(ref_set)) else "")
        r["sampler"] = "tools/llada_ref.py numpy reference"
        result["runs"].append(r)
        print(f"ref: {r['correct']}/{r['n']} = {r['accuracy']:.3f} {r['per_task']} ({r['seconds']:.0f} s)", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8", newline="\n") as f:
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
