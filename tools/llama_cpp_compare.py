"""The same request through llama.cpp's diffusion example (`llama-diffusion-cli`, a full
forward of the whole sequence per step, no K/V cache) and through `unmask generate`, on the
same machine: the tokens each gives, and the seconds each takes.

    tools/build_llama_cpp.sh              # -> target/llama.cpp/src/build/bin/llama-diffusion-cli
    pip install gguf numpy tokenizers     # tools/to_gguf.py is called from here
    python tools/llama_cpp_compare.py \
        --llama-cli target/llama.cpp/src/build/bin/llama-diffusion-cli \
        --unmask target/release/unmask --model models/tiny --out llama-cpp.json

The request is the bundled demo question about the bundled system prompt (or --system-file
and --question), one block of --gen-length masks decoded in --steps steps. For LLaDA,
llama.cpp's block schedule spans its whole context (prompt included) and asserts that its
length is a multiple of the block, so its one block is given the whole context's length,
which leaves exactly the canvas after the prompt to denoise, split evenly over the steps
with the remainder first: LLaDA's own split, the one `unmask generate` uses. A Dream folder
runs Dream's timestep schedule (eps 1e-3) on both sides.

Greedy decoding differs between the two: llama.cpp's sampler chain ends in a draw from
the softmax even at `--temp 0`, so its greedy setting is `--top-k 1`, where every masked
position's confidence is 1 and the positions are committed left to right. `unmask generate
--top-k 1 --temperature 0` does the same (a lone id has probability 1, ties go to the
lowest position), so the `left_to_right` rows hold the two runtimes to the same tokens. The
`low_confidence` rows are LLaDA's own greedy decoding (argmax, highest probability first),
which llama.cpp's example cannot run; they time the runtime's cache modes.

Each configuration runs `--runs` times in a process of its own (model load not counted; the
first step's pipeline compilation counted on both sides); the medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import to_gguf  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL_RE = re.compile(r"total time: ([0-9.]+)ms, time per step: ([0-9.]+)ms")
# The stamp of the line the answer follows.
ANSWER_RE = re.compile(r"\d+\.\d+\.\d+\.\d+ I \n")
# llama.cpp's log stamps (minutes.seconds.milliseconds.microseconds) of each step's callback,
# which fires before the step's forward pass, and of the line after the last.
STAMP_RE = re.compile(r"(\d+)\.(\d+)\.(\d+)\.(\d+) I\s*(?:diffusion step: (\d+)/)?")


def run(cmd, timeout, env=None):
    proc = subprocess.run(cmd, capture_output=True, timeout=timeout, env=env)
    # Bytes as printed: a canvas may hold partial UTF-8, and its \r must stay a \r.
    proc.stdout = proc.stdout.decode("utf-8", errors="replace")
    proc.stderr = proc.stderr.decode("utf-8", errors="replace")
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        sys.exit(f"llama_cpp_compare.py: {cmd[0]} exited {proc.returncode}:\n{tail}")
    return proc.stdout, proc.stderr


def unmask_once(args, cache, greedy_order):
    cmd = [args.unmask, "generate", "--model", args.model, "--system", args.system,
           "--prompt", args.question, "--gen-length", str(args.gen_length),
           "--steps", str(args.steps), "--block-length", str(args.gen_length),
           "--temperature", "0", "--cache", cache, "--json"]
    if not args.early_finish:
        # Every step runs, as llama.cpp's example runs them (it has no early finish).
        cmd.append("--full-canvas")
    if greedy_order == "left_to_right":
        cmd += ["--top-k", "1"]
    out, _ = run(cmd, args.timeout)
    return json.loads(out)


def llama_once(args, gguf_path, backend, context, top_k=1, seed=0):
    """One run; `top_k` None keeps llama.cpp's default cut (40, and top-p 0.95)."""
    cmd = [args.llama_cli, "-m", gguf_path, "-sys", args.system, "-p", args.question,
           "-ub", str(context), "-b", str(context), "-c", str(context),
           "--diffusion-steps", str(args.steps), "--diffusion-algorithm", "4",
           "--temp", "0", "--seed", str(seed), "-t", str(args.threads)]
    if args.family == "Dream":
        # Dream's timestep schedule over the whole canvas, as `unmask generate` runs it.
        cmd += ["--diffusion-eps", "0.001"]
    else:
        cmd += ["--diffusion-block-length", str(context)]
    if top_k is not None:
        cmd += ["--top-k", str(top_k)]
    cmd += ["-ngl", "99"] if backend == "vulkan" else ["-ngl", "0", "--device", "none"]
    env = dict(os.environ)
    if backend == "vulkan":
        # ggml-vulkan passes over CPU-type adapters (lavapipe) unless one is named.
        env.setdefault("GGML_VK_VISIBLE_DEVICES", args.vulkan_device)
    # The example logs through a thread of its own, and a run's last lines (the timing and
    # the answer) can miss its output at exit: such a run is run again, twice at most.
    for attempt in range(3):
        out, err = run(cmd, args.timeout, env)
        text = out + err
        found = TOTAL_RE.search(text)
        if found:
            break
        print(f"llama.cpp run {attempt + 1}: no 'total time' line in its output", flush=True)
    else:
        sys.exit("llama_cpp_compare.py: no 'total time' line in llama-diffusion-cli's "
                 f"output:\n{text[-2000:]}")
    # The answer is printed whole after the timing line, on a line of its own after a stamp.
    rest = text[found.end():]
    printed = ANSWER_RE.search(rest)
    answer = rest[printed.end():].removesuffix("\n") if printed else ""
    return {"total_s": float(found.group(1)) / 1000,
            "steady_step_s": steady_step_s(text, args.steps),
            "text": answer}


def steady_step_s(log, steps):
    """Seconds a step after the first (whose pipelines compile), from the log's stamps."""
    stamps = {}
    end = None
    for m in STAMP_RE.finditer(log):
        t = int(m[1]) * 60 + int(m[2]) + int(m[3]) / 1e3 + int(m[4]) / 1e6
        if m[5] is not None:
            stamps[int(m[5])] = t
        elif stamps:
            end = t if end is None else end
    if 1 not in stamps or end is None or steps < 2:
        return None
    return (end - stamps[1]) / (steps - 1)


def median_row(samples, **fields):
    totals = [s["total_s"] for s in samples]
    row = dict(fields)
    row["total_s"] = statistics.median(totals)
    row["runs_s"] = totals
    row["step_ms"] = row["total_s"] / fields["steps"] * 1000
    steady = [s["steady_step_s"] for s in samples if s.get("steady_step_s") is not None]
    row["steady_step_ms"] = statistics.median(steady) * 1000 if steady else None
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cli", required=True, help="llama.cpp's llama-diffusion-cli")
    ap.add_argument("--unmask", default=os.path.join(ROOT, "target/release/unmask"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models/tiny"), help="a LLaDA folder")
    ap.add_argument("--system-file", default=os.path.join(ROOT, "data/tasks/demo-system.txt"))
    ap.add_argument("--system", help="the system prompt itself (instead of --system-file)")
    ap.add_argument("--question", default="What is the city of Bella?")
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="llama.cpp's threads (-t)")
    ap.add_argument("--backends", default="vulkan,cpu",
                    help="llama.cpp's backends: vulkan (every layer offloaded), cpu")
    ap.add_argument("--vulkan-device", default="0",
                    help="GGML_VK_VISIBLE_DEVICES for llama.cpp's Vulkan runs (default 0)")
    ap.add_argument("--caches", default="none,fast-dllm-dual,bicache-dual",
                    help="unmask's cache modes for the low_confidence rows")
    ap.add_argument("--early-finish", action="store_true",
                    help="let unmask end a request once its answer is final (default: every "
                         "step runs on both sides)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds a run may take")
    ap.add_argument("--out", required=True, help="the JSON report")
    args = ap.parse_args()
    if args.system is None:
        with open(args.system_file, encoding="utf-8") as f:
            args.system = f.read()
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        args.family = json.load(f).get("model_type")

    # The prompt as unmask tokenizes it (the chat template, then the tokenizer).
    probe = unmask_once(args, "none", "left_to_right")
    prompt_tokens = len(probe["prompt_ids"])
    context = prompt_tokens + args.gen_length
    adapter = probe["adapter"]
    print(f"prompt {prompt_tokens} tokens + canvas {args.gen_length}; unmask on {adapter}",
          flush=True)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ggufs = {}
        for dtype in ("f32", "f16"):
            ggufs[dtype] = os.path.join(tmp, f"model-{dtype}.gguf")
            to_gguf.convert(args.model, ggufs[dtype], dtype, None)
        for backend in args.backends.split(","):
            for dtype in ("f32", "f16"):
                samples = [llama_once(args, ggufs[dtype], backend, context)
                           for _ in range(args.runs)]
                row = median_row(samples, engine="llama.cpp", backend=backend,
                                 weights=dtype, decoding="left_to_right", cache="none",
                                 steps=args.steps, text=samples[0]["text"])
                rows.append(row)
                print(f"llama.cpp {backend} {dtype}: {row['total_s']:.3f} s "
                      f"({row['step_ms']:.1f} ms a step) {row['text']!r}", flush=True)

        # At --temp 0 with its default cut the example still draws from the softmax: the
        # answer moves with the seed.
        backends = args.backends.split(",")
        backend = "cpu" if "cpu" in backends else backends[0]
        draws = {seed: llama_once(args, ggufs["f32"], backend, context, None, seed)["text"]
                 for seed in range(3)}
        print(f"llama.cpp --temp 0 without --top-k 1, seeds 0-2: {list(draws.values())}",
              flush=True)

    for decoding, caches in (("left_to_right", ["none"]),
                             ("low_confidence", args.caches.split(","))):
        for cache in caches:
            samples = [unmask_once(args, cache, decoding) for _ in range(args.runs)]
            for s in samples:
                t = s["timings"]
                s["total_s"] = t["total_s"]
                s["steady_step_s"] = (t["total_s"] - t["first_step_s"]) / max(t["steps"] - 1, 1)
            row = median_row(samples, engine="unmask", backend="wgpu", weights=probe["weight_format"],
                             decoding=decoding, cache=cache, steps=args.steps,
                             text=samples[0]["text"],
                             canvas_ids=samples[0]["ids"],
                             forward_passes=samples[0]["timings"]["forward_passes"],
                             token_layer_passes=samples[0]["timings"]["token_layer_passes"])
            rows.append(row)
            print(f"unmask {cache} ({decoding}): {row['total_s']:.3f} s "
                  f"({row['step_ms']:.1f} ms a step) {row['text']!r}", flush=True)

    # llama.cpp prints the whole canvas without its special tokens (past the end of text
    # too), so unmask's canvas is decoded the same way to compare them.
    reference = next(r for r in rows if r["engine"] == "unmask" and r["decoding"] == "left_to_right")
    tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    reference["canvas_text"] = tokenizer.decode(reference.pop("canvas_ids"), skip_special_tokens=True)
    for r in rows:
        r.pop("canvas_ids", None)
        if r["engine"] == "llama.cpp":
            r["same_canvas_as_unmask"] = r["text"] == reference["canvas_text"]
    llama_best = min((r for r in rows if r["engine"] == "llama.cpp" and r["backend"] == "vulkan"),
                     key=lambda r: r["total_s"], default=None)
    report = {
        "workload": {"model": os.path.relpath(args.model, ROOT), "family": args.family,
                     "system": args.system if len(args.system) < 200
                     else os.path.relpath(args.system_file, ROOT),
                     "question": args.question, "prompt_tokens": prompt_tokens,
                     "gen_length": args.gen_length, "steps": args.steps, "blocks": 1,
                     "runs": args.runs, "llama_cpp_threads": args.threads,
                     "unmask_early_finish": args.early_finish},
        "adapter": adapter,
        "rows": rows,
        "llama_cpp_temp0_default_top_k_by_seed": draws,
    }
    if llama_best is not None:
        report["speedup_vs_llama_cpp_vulkan"] = {
            f"{r['cache']} ({r['decoding']})": llama_best["total_s"] / r["total_s"]
            for r in rows if r["engine"] == "unmask"}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
