#!/usr/bin/env python3
"""Canvas tokens/s of every cache mode, two `unmask` binaries side by side.

Runs `unmask generate --json` for each mode with each binary, alternating the binaries run
by run so both see the same machine load, and prints one JSON object per (binary, mode) and
a markdown table of medians and the new/old ratio. Timings on shared or software adapters are
noisy: compare the ratios of one run, not absolute numbers across runs.

    python3 tools/compare_binaries.py --old /tmp/unmask-old --new target/release/unmask \
        --runs 5 [--model models/tiny] [-- extra generate flags]
"""

import argparse
import json
import statistics
import subprocess
import sys

MODES = ["none", "fast-dllm-prefix", "fast-dllm-dual", "prefix-arm", "bicache", "bicache-dual"]
SYSTEM = (
    "You answer questions about these people. Nina: pet hamster, sport rowing. "
    "Tara: pet parrot, sport fencing. Victor: pet turtle, sport climbing."
)
PROMPT = "What is the pet of Nina?"


def run(binary, mode, model, extra):
    cmd = [binary, "generate", "--cache", mode, "--system", SYSTEM, "--prompt", PROMPT, "--json"]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd + extra, capture_output=True, text=True, check=True)
    g = json.loads(out.stdout)
    return g["timings"]["throughput_canvas"], g["ids"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("extra", nargs="*", help="flags passed to every `unmask generate`")
    a = ap.parse_args()
    rows = []
    for mode in a.modes.split(","):
        rates = {"old": [], "new": []}
        ids = {}
        # One warm-up each (shader compilation caches, page cache), then alternate.
        for who in ("old", "new"):
            run(getattr(a, who), mode, a.model, a.extra)
        for _ in range(a.runs):
            for who in ("old", "new"):
                rate, got = run(getattr(a, who), mode, a.model, a.extra)
                rates[who].append(rate)
                ids[who] = got
        med = {w: statistics.median(v) for w, v in rates.items()}
        same = ids["old"] == ids["new"]
        for who in ("old", "new"):
            print(json.dumps({"binary": getattr(a, who), "cache": mode, "runs": rates[who],
                              "median_canvas_tokens_per_s": med[who],
                              "same_tokens_as_other": same}))
        rows.append((mode, med["old"], med["new"], med["new"] / med["old"], same))
    print()
    print("| cache mode | old tok/s | new tok/s | new / old | same tokens |")
    print("|---|---:|---:|---:|---|")
    for mode, old, new, ratio, same in rows:
        print(f"| {mode} | {old:.1f} | {new:.1f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")
    return 0 if all(r[4] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
