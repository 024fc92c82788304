"""A bounded load test of `unmask serve` on a loopback port (standard library only).

    python3 tools/serve_load.py --unmask target/release/unmask [--model models/tiny]
        [--requests 32] [--clients 8] [--others 4] [--cache bicache-dual,none,fast-dllm-dual]
        [--json docs/benchmarks/serve-load.json]

Sends REQUESTS chat requests from CLIENTS concurrent clients, all sharing the bundled
system prompt, plus OTHERS requests with other system prompts (data/tasks/heldout-small.jsonl),
then the same requests one at a time, to one server. With several cache modes the requests
take them in turn (a mixed workload): BiCache requests share their prefix's session, the
others share sessions without a prefix, and the mean batch is reported per session kind. Checks that every request is
answered, that at temperature 0 each answer equals `unmask generate` for the same request,
that BiCache hit for all but the first request of each system prompt, and that nothing
leaked (queue, running requests and prefix-store pins back to zero). Prints one JSON
object: throughput concurrent against one at a time, and the server's metrics.

Cluster mode (tools/serve_cluster.py), replicas behind the SGLang Model Gateway
(scripts/serve-cluster.sh), one measured run per routing policy:

    python3 tools/serve_load.py --unmask target/release/unmask --cluster cache_aware,round_robin
        [--systems 6] [--users 8] [--clients 8] [--replicas 3] [--tasks data/tasks/heldout.jsonl]
        [--json docs/benchmarks/serve-cluster.json] [--markdown docs/benchmarks/serve-cluster.md]
"""

import argparse
import concurrent.futures
import json
import os
import sys
import time

from serve_harness import ROOT, SYSTEM, Server, generate, report

QUESTIONS = [
    "What is the city of Bella?", "What is the pet of Martin?", "Give the record of Peter.",
    "What is the sport of Bella and of Martin?", "What is the colour of Peter?",
    "What is the sport of Peter?", "What is the colour of Martin?", "What is the pet of Bella?",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--unmask", default="target/release/unmask")
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--others", type=int, default=4)
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--cache", default="bicache-dual",
                    help="cache mode, or a comma-separated list the requests take in turn")
    ap.add_argument("--json", help="also write the result here")
    cl = ap.add_argument_group("cluster mode (tools/serve_cluster.py)")
    cl.add_argument("--cluster", metavar="POLICIES",
                    help="run through scripts/serve-cluster.sh, once per router policy "
                         "(comma-separated, e.g. cache_aware,round_robin)")
    cl.add_argument("--systems", type=int, default=6, help="system prompts of the workload")
    cl.add_argument("--users", type=int, default=8, help="users (questions) per system prompt")
    cl.add_argument("--tasks", default="data/tasks/heldout.jsonl", help="task set, grouped by system")
    cl.add_argument("--seed", type=int, default=0, help="seed of the workload's shuffled order")
    cl.add_argument("--replicas", type=int, default=3)
    cl.add_argument("--port", type=int, default=8300, help="router port; replicas on the next ones")
    cl.add_argument("--cluster-dir", help="state folder (default target/cluster-load)")
    cl.add_argument("--markdown", help="also write the comparison as Markdown here")
    cl.add_argument("--expect-affinity", action="store_true",
                    help="fail unless the cache_aware run sent each system prompt to one replica")
    a = ap.parse_args()
    if a.cluster:
        import serve_cluster
        sys.exit(serve_cluster.run(a))

    others = []
    with open(os.path.join(ROOT, "data/tasks/heldout-small.jsonl")) as f:
        seen = set()
        for line in f:
            item = json.loads(line)
            if item["system"] not in seen and len(others) < a.others:
                seen.add(item["system"])
                others.append((item["system"], item["user"]))
    modes = a.cache.split(",")
    work = [(SYSTEM, QUESTIONS[i % len(QUESTIONS)]) for i in range(a.requests)] + others
    work = [(system, user, modes[i % len(modes)]) for i, (system, user) in enumerate(work)]

    def body(system, user, mode):
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "max_tokens": a.gen_length, "steps": a.steps, "block_length": a.block_length,
                "temperature": 0, "cache": mode}

    print(f"{len(work)} requests: reference answers from unmask generate", file=sys.stderr)
    expected = {}
    for system, user, mode in work:
        if (system, user, mode) not in expected:
            expected[(system, user, mode)] = generate(a.unmask, a.model, system, user, a.gen_length,
                                                      a.steps, a.block_length, mode)

    server = Server(a.unmask, a.model, "--max-queue", str(len(work)))
    failures = []
    try:
        def post(item):
            t0 = time.time()
            status, reply, _ = server.request("POST", "/v1/chat/completions", body(*item))
            return item, status, reply, time.time() - t0

        def check_replies(replies, label):
            tokens = 0
            for item, status, reply, _ in replies:
                if status != 200:
                    failures.append(f"{label}: {item[1]!r}: status {status}: {reply}")
                    continue
                text = reply["choices"][0]["message"]["content"]
                tokens += reply["usage"]["completion_tokens"]
                if text != expected[item]:
                    failures.append(f"{label}: {item[1]!r}: {text!r} != generate's {expected[item]!r}")
            return tokens

        # Warm-up outside the timings: compiles the kernels and stores each system prompt's
        # entry once, so both runs below start from the same state.
        warm = [post(item) for item in {(w[0], w[2]): w for w in work}.values()]
        check_replies(warm, "warm-up")
        m0 = server.metrics()

        print(f"concurrent: {len(work)} requests from {a.clients} clients", file=sys.stderr)
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
            concurrent_replies = list(pool.map(post, work))
        concurrent_s = time.time() - t0
        m1 = server.metrics()

        print("one at a time", file=sys.stderr)
        t0 = time.time()
        serial_replies = [post(item) for item in work]
        serial_s = time.time() - t0
        m2 = server.metrics()

        concurrent_tokens = check_replies(concurrent_replies, "concurrent")
        serial_tokens = check_replies(serial_replies, "one at a time")

        bicache = lambda items: [w for w in items if w[2].startswith("bicache")]
        systems = len({w[0] for w in bicache(work)})
        hits = m2.get("unmask_bicache_hits_total", 0)
        misses = m2.get("unmask_bicache_misses_total", 0)
        fallbacks = m2.get("unmask_bicache_fallbacks_total", 0)
        total = len(bicache(r[0] for r in warm)) + 2 * len(bicache(work))
        if misses > systems or hits + misses + fallbacks != total or fallbacks:
            failures.append(f"BiCache: {hits} hits, {misses} misses, {fallbacks} fallbacks over "
                            f"{total} requests and {systems} system prompts")
        for name in ("unmask_queue_depth", "unmask_running_requests", "unmask_prefix_store_pins"):
            if m2.get(name) != 0:
                failures.append(f"{name} is {m2.get(name)} after the load")

        def batch_mean(before, after, session=None):
            """Mean requests per forward pass between two snapshots, of one session kind
            (shared_prefix, no_prefix) or all."""
            def total(m, suffix):
                return sum(v for k, v in m.items() if k.startswith(f"unmask_batch_size_{suffix}")
                           and (session is None or f'session="{session}"' in k))
            n = total(after, "count") - total(before, "count")
            s = total(after, "sum") - total(before, "sum")
            return round(s / n, 2) if n else 0

        def phase(wall_s, tokens, replies, before, after):
            """One run's numbers: throughput, latency and the batches the server ran."""
            return {"wall_s": round(wall_s, 2), "requests_per_s": round(len(work) / wall_s, 3),
                    "answer_tokens_per_s": round(tokens / wall_s, 2),
                    "canvas_tokens_per_s": round(len(work) * a.gen_length / wall_s, 2),
                    "mean_batch": batch_mean(before, after),
                    "mean_batch_by_session": {kind: batch_mean(before, after, kind)
                                              for kind in ("shared_prefix", "no_prefix")},
                    "mean_latency_s": round(sum(r[3] for r in replies) / len(work), 2)}

        result = {
            "bench": "serve-load",
            "model": a.model,
            "requests": len(work),
            "clients": a.clients,
            "system_prompts": systems,
            "gen_length": a.gen_length, "steps": a.steps, "block_length": a.block_length,
            "cache": modes,
            "concurrent": phase(concurrent_s, concurrent_tokens, concurrent_replies, m0, m1),
            "one_at_a_time": phase(serial_s, serial_tokens, serial_replies, m1, m2),
            "speedup": round(serial_s / concurrent_s, 2),
            "bicache": {"hits": hits, "misses": misses, "fallbacks": fallbacks},
            "answers_equal_generate": not any("!=" in f for f in failures),
            "failures": failures,
        }
    finally:
        server.stop()
    sys.exit(report(result, a.json))


if __name__ == "__main__":
    main()
