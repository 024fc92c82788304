"""OpenAI's `n` on a DiffusionGemma server: requests of N choices with a long user turn,
timed against builds of `unmask serve` (standard library only).

    python3 tools/serve_choices_dgemma.py --unmask OLD_BINARY,target/release/unmask
        [--model tests/fixtures/tiny-dgemma] [--choices 4] [--requests 3] [--user-items 40]
        [--json docs/benchmarks/serve-choices-dgemma.json]

For each binary, starts `unmask serve --max-solo N` and sends REQUESTS requests one after
another, each with the same system prompt, a long user turn of its own (so no request finds
its whole prompt stored) and `n` = N choices. Records per binary the median request
seconds, each choice's prefix-store use (`unmask.prefix`) and the answers, which must be the
same across binaries (the choices' seeds are `seed + i` whatever the build does with the
prompt). Run the binaries alternately on an idle machine: the timings are ratios.
"""

import argparse
import statistics
import sys
import time

from serve_harness import Server, report

SYSTEM = "You answer in one word."


def user_turn(request, items):
    return " ".join(f"Item {request}-{i} is on the list." for i in range(items)) + " Name one."


def run(binary, a):
    server = Server(binary, a.model, "--max-solo", str(a.choices), "--max-queue", str(a.choices))
    out = {"binary": binary, "seconds": [], "prompt_tokens": [], "prefix": [], "answers": []}
    try:
        # One untimed request first: the pipelines compile, and the system turn is stored.
        for r in range(-1, a.requests):
            body = {"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": user_turn(r, a.user_items)}],
                    "max_tokens": a.max_tokens, "steps": a.steps, "seed": 100 + r, "n": a.choices}
            t = time.perf_counter()
            status, reply, _ = server.request("POST", "/v1/chat/completions", body)
            seconds = time.perf_counter() - t
            if status != 200:
                sys.exit(f"{binary}: request {r} answered {status}: {reply}")
            if r < 0:
                continue
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            out["seconds"].append(seconds)
            out["prompt_tokens"].append(reply["usage"]["prompt_tokens"])
            out["prefix"].append([c["unmask"]["prefix"] for c in choices])
            out["answers"].append([c["message"]["content"] for c in choices])
    finally:
        server.stop()
    out["median_s"] = statistics.median(out["seconds"])
    print(f"{binary}: median {out['median_s']:.2f} s a request of {a.choices} choices "
          f"(prompts of {out['prompt_tokens']} tokens); prefix {out['prefix'][0]}", file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--unmask", required=True, help="comma-separated binaries to compare")
    ap.add_argument("--model", default="tests/fixtures/tiny-dgemma")
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--user-items", type=int, default=40, help="sentences in each user turn")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    runs = [run(b, a) for b in a.unmask.split(",")]
    failures = []
    if any(r["answers"] != runs[0]["answers"] for r in runs):
        failures.append("the binaries' answers differ")
    result = {
        "model": a.model, "choices": a.choices, "requests": a.requests,
        "user_items": a.user_items, "max_tokens": a.max_tokens, "steps": a.steps,
        "runs": runs,
        "speedup_vs_first": [runs[0]["median_s"] / r["median_s"] for r in runs],
        "failures": failures,
    }
    return report(result, a.json)


if __name__ == "__main__":
    sys.exit(main())
