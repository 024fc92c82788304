"""Whole-request throughput of the PyTorch reference `generate` (tools/llada_torch.py: the
official algorithm, a full forward of the whole sequence per step, no K/V cache), written as
`unmask bench` request records so that `unmask bench-report` shows it as one more row,
`pytorch-reference`, next to the runtime's cache modes on the same GPU.

    python tools/torch_bench.py --model DIR --like bench-requests.jsonl --out torch.jsonl

`--like` names a file of `unmask bench --only requests` records: the new records copy the
first one's envelope (adapter, backend, model, weights: the same source in the report) and
its workload (gen_length, steps, block_length, prompt lengths, request count), so both sides
run the same shapes. The prompts are random ids of those lengths (the reference's speed does
not depend on which ids). One untimed request first warms the kernels up.

Figures: throughput of the canvas and of the answer (tokens before the first EOS), median
request seconds, the first step's seconds (one forward of the whole sequence, timed
alone), forward passes per request, token-layer passes (every token through every layer at
every forward), GPU memory of the weights and at the peak (CUDA; 0 on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llada_torch  # noqa: E402
import torch_common  # noqa: E402

WORKLOAD_KEYS = ("gen_length", "steps", "block_length", "prefix_tokens", "user_tokens", "requests")


def first_record(path):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not JSON ({e})") from None
            if rec.get("record") == "request":
                missing = [k for k in WORKLOAD_KEYS if k not in rec]
                if missing:
                    raise SystemExit(f"{path}:{n}: a request record without {', '.join(missing)}")
                return rec
    raise SystemExit(f"{path}: no request record (\"record\": \"request\") to copy the workload from")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (config.json, *.safetensors)")
    ap.add_argument("--like", required=True, help="unmask bench request records (JSON lines) to match")
    ap.add_argument("--out", required=True, help="JSON lines file to append the records to")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", choices=sorted(torch_common.DTYPES), default="bf16",
                    help="weights and compute (default bf16, as the official code runs)")
    ap.add_argument("--max-requests", type=int, default=None,
                    help="time at most this many of the workload's requests (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    like = first_record(args.like)
    device = torch.device(args.device or torch_common.default_device())
    model = llada_torch.load(args.model, device, args.dtype)
    cfg = model.config
    # a tied LM head is the embedding: count each tensor once
    unique = {t.data_ptr(): t for t in model_tensors(model)}.values()
    weights_bytes = sum(t.numel() * t.element_size() for t in unique)
    mask_id, eos_id = cfg["mask_token_id"], cfg.get("eos_token_id")
    vocab = min(cfg["vocab_size"], cfg["embedding_size"])
    rng = random.Random(args.seed)

    def ids(n):
        out = []
        while len(out) < n:
            t = rng.randrange(vocab)
            if t not in (mask_id, eos_id):
                out.append(t)
        return out

    gen, steps, block = like["gen_length"], like["steps"], like["block_length"]
    n_req = like["requests"] if args.max_requests is None else min(like["requests"], args.max_requests)
    prompts = [ids(like["prefix_tokens"] + like["user_tokens"]) for _ in range(max(n_req, 1))]
    run = lambda p: model.generate(p, steps=steps, gen_length=gen, block_length=block)  # noqa: E731

    run(prompts[0])  # warm-up: kernels, allocator
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    first = []
    for p in prompts[:n_req]:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.forward(p + [mask_id] * gen)
        sync(device)
        first.append(time.perf_counter() - t0)
    totals, canvas, answer, forwards = [], 0, 0, 0
    began = time.perf_counter()
    for p in prompts[:n_req]:
        t0 = time.perf_counter()
        out = run(p)
        sync(device)
        totals.append(time.perf_counter() - t0)
        canvas += len(out["ids"])
        answer += out["ids"].index(eos_id) if eos_id in out["ids"] else len(out["ids"])
        forwards += len(out["steps"])
    # the first-step forwards ran before `began`; the wall is the requests' alone
    wall = time.perf_counter() - began
    seq = like["prefix_tokens"] + like["user_tokens"] + gen
    nfe = forwards / max(n_req, 1)
    record = {k: v for k, v in like.items() if k not in RECORD_FIGURES}
    record.update(
        {
            "record": "request",
            "cache": "pytorch-reference",
            "decoding": "quota",
            "threshold": None,
            "batch": 1,
            "requests": n_req,
            "wall_s": round(wall, 3),
            "throughput_canvas": round(canvas / wall, 3),
            "throughput_answer": round(answer / wall, 3),
            "request_s_median": round(statistics.median(totals), 3),
            "ttft_s": round(statistics.median(first), 3),
            "nfe": round(nfe, 3),
            "token_layer_passes": round(nfe * seq * cfg["n_layers"], 3),
            "cache_bytes": 0,
            "gpu_weights_bytes": weights_bytes,
            "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
            "reference": {
                "engine": f"PyTorch {torch.__version__}",
                "device": str(device),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "dtype": args.dtype,
                "code": "tools/llada_torch.py generate (full forward per step, no K/V cache)",
            },
        }
    )
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    print(
        f"pytorch-reference ({args.dtype}, {device}): {n_req} requests, "
        f"{record['throughput_canvas']} canvas tok/s, {record['request_s_median']} s per request, "
        f"{nfe:.0f} forwards each",
        file=sys.stderr,
    )
    return 0


# figures of the copied record that this run measures anew (the rest: envelope, workload)
RECORD_FIGURES = {
    "bicache_hits", "bicache_misses", "bicache_fallbacks", "bicache_depth", "cache",
    "decoding", "threshold", "batch", "groups",
}


def model_tensors(model):
    yield model.wte
    yield model.head
    yield model.ln_f
    for b in model.blocks:
        yield from (t for t in vars(b).values() if isinstance(t, torch.Tensor))


if __name__ == "__main__":
    sys.exit(main())
