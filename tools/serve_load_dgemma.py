"""A bounded load test of `unmask serve` on a DiffusionGemma folder (standard library only).

    python3 tools/serve_load_dgemma.py --unmask target/release/unmask
        [--model tests/fixtures/tiny-dgemma] [--requests 16] [--clients 8] [--max-solo 1,4,8]
        [--max-tokens 32] [--steps 8] [--long-every 0] [--new-system-every 0]
        [--json docs/benchmarks/serve-load-dgemma.json]

For each `--max-solo` value, starts a server with it and sends REQUESTS chat requests from
CLIENTS concurrent clients, all with one system prompt (encoded once, then taken from the
prefix store) and their own seeds; with `--long-every K`, every K-th request also carries a
long user turn (its prompt is encoded a piece per round while the others denoise); with
`--new-system-every K`, every K-th request has a long system turn of its own instead, one the
prefix store has never seen (encoded a piece per round, then stored), and the result gives the
other requests' latency apart. Checks
that every request is answered, that each answer equals `unmask generate` for the same
system, question, seed and steps, and that nothing is left running. Prints one JSON object:
per setting the wall time, answer tokens/s, mean and worst latency, the most requests one
decoder pass took (`unmask.batch`) and the speedup over `--max-solo 1`.
"""

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time

from serve_harness import Server, report

SYSTEM = "You answer in one word."
QUESTIONS = [
    "Name a colour.", "Name an animal.", "Name a city.", "Name a fruit.",
    "Name a sport.", "Name a metal.", "Name a planet.", "Name a tree.",
]
LONG = " ".join(f"Item {i} is on the list." for i in range(60))
LONG_SYSTEM = " ".join(f"Rule {i} is on the list." for i in range(40))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--unmask", default="target/release/unmask")
    ap.add_argument("--model", default="tests/fixtures/tiny-dgemma")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-solo", default="1,4,8", help="comma-separated settings to compare")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--long-every", type=int, default=0,
                    help="every K-th request carries a long user turn (0: none)")
    ap.add_argument("--new-system-every", type=int, default=0,
                    help="every K-th request has a new long system turn of its own (0: none)")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()

    def user(i):
        q = QUESTIONS[i % len(QUESTIONS)]
        return f"{LONG} {q}" if a.long_every and i % a.long_every == a.long_every - 1 else q

    def system(i):
        k = a.new_system_every
        return f"{SYSTEM} Context {i}: {LONG_SYSTEM}" if k and i % k == k - 1 else SYSTEM

    work = [(system(i), user(i), 100 + i) for i in range(a.requests)]
    print(f"{len(work)} requests: reference answers from unmask generate", file=sys.stderr)
    expected = {}
    for sys_turn, question, seed in work:
        out = subprocess.run(
            [a.unmask, "generate", "--model", a.model, "--system", sys_turn, "--prompt", question,
             "--gen-length", str(a.max_tokens), "--steps", str(a.steps), "--seed", str(seed),
             "--json"], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            sys.exit(f"unmask generate failed ({out.returncode}): {out.stderr}")
        expected[(sys_turn, question, seed)] = json.loads(out.stdout)["text"]

    def body(sys_turn, question, seed):
        return {"messages": [{"role": "system", "content": sys_turn},
                             {"role": "user", "content": question}],
                "max_tokens": a.max_tokens, "steps": a.steps, "seed": seed}

    failures, runs = [], {}
    for solo in [int(s) for s in a.max_solo.split(",")]:
        server = Server(a.unmask, a.model, "--max-queue", str(len(work)), "--max-solo", str(solo))
        try:
            def post(item):
                t0 = time.time()
                status, reply, _ = server.request("POST", "/v1/chat/completions", body(*item))
                return item, status, reply, time.time() - t0

            # Warm-up outside the timing: the kernels compile and the system turn is stored.
            _, status, reply, _ = post(work[0])
            if status != 200:
                failures.append(f"max-solo {solo}: warm-up: status {status}: {reply}")
                continue
            print(f"max-solo {solo}: {len(work)} requests from {a.clients} clients", file=sys.stderr)
            t0 = time.time()
            with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
                replies = list(pool.map(post, work))
            wall = time.time() - t0
            tokens, batch = 0, 0
            for item, status, reply, _ in replies:
                if status != 200:
                    failures.append(f"max-solo {solo}: {item}: status {status}: {reply}")
                    continue
                text = reply["choices"][0]["message"]["content"]
                tokens += reply["usage"]["completion_tokens"]
                batch = max(batch, reply.get("unmask", {}).get("batch", 0))
                if text != expected[item]:
                    failures.append(f"max-solo {solo}: {item}: {text!r} != generate's "
                                    f"{expected[item]!r}")
            m = server.metrics()
            for name in ("unmask_queue_depth", "unmask_running_requests"):
                if m.get(name) != 0:
                    failures.append(f"max-solo {solo}: {name} is {m.get(name)} after the load")
            latencies = [r[3] for r in replies]
            common = [r[3] for r in replies if r[0][0] == SYSTEM]
            runs[solo] = {
                "wall_s": round(wall, 2),
                "answer_tokens_per_s": round(tokens / wall, 2),
                "mean_latency_s": round(sum(latencies) / len(latencies), 2),
                "max_latency_s": round(max(latencies), 2),
                "mean_latency_shared_system_s": round(sum(common) / max(len(common), 1), 2),
                "most_requests_in_one_pass": batch,
            }
        finally:
            server.stop()
    base = runs.get(1)
    for r in runs.values():
        if base:
            r["speedup_over_max_solo_1"] = round(base["wall_s"] / r["wall_s"], 2)
    result = {
        "bench": "serve-load-dgemma",
        "model": a.model,
        "requests": len(work),
        "clients": a.clients,
        "max_tokens": a.max_tokens,
        "steps": a.steps,
        "long_every": a.long_every,
        "new_system_every": a.new_system_every,
        "runs": {f"max_solo_{k}": v for k, v in runs.items()},
        "answers_equal_generate": not any("!=" in f for f in failures),
        "failures": failures,
    }
    sys.exit(report(result, a.json))


if __name__ == "__main__":
    main()
