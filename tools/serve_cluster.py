"""The cluster mode of tools/serve_load.py: `unmask serve` replicas behind the SGLang Model
Gateway (scripts/serve-cluster.sh), one measured run per routing policy (standard library only).

Workload: SYSTEMS system prompts x USERS users from a task set (data/tasks/*.jsonl, grouped by
their `system` field), in one fixed shuffled order (a fixed order would cycle the prompts in
step with a round-robin router), sent as streamed chat requests by CLIENTS concurrent clients
through the router. For each policy the cluster is brought up fresh (empty prefix stores),
every replica is warmed up straight (the bundled demo system prompt, which the workload does
not use: it compiles the kernels without storing any workload prefix), then the workload runs
once. Reported per policy, as `vllm bench serve` reports a run: time to first token (the first
streamed text), latency of each request (its whole canvas), committed answer tokens/s and
canvas tokens/s (max_tokens per request), mean / median / p99; BiCache hits per replica and
overall from each replica's /metrics before and after; which replica served each system prompt
(the router's x-smg-routed-worker-id header, checked against the replicas' BiCache misses);
what the router read of the replicas' load (its /get_loads, sampled during the run, and its own
/metrics); whether the replicas publish vLLM's metric names. Every answer must equal
`unmask generate --json` for the same request (temperature 0, the same cache mode).
"""

import collections
import concurrent.futures
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from serve_harness import ROOT, SYSTEM, generate

VLLM_NAMES = [
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
]
SCRIPT = os.path.join(ROOT, "scripts/serve-cluster.sh")


def parse_metrics(text):
    """Prometheus text as {name: {labels: value}} (labels: the text between the braces)."""
    out = collections.defaultdict(dict)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)", line)
        if m:
            try:
                out[m.group(1)][m.group(2) or ""] = float(m.group(3))
            except ValueError:
                pass
    return out


def total(metrics, name):
    return sum(metrics.get(name, {}).values())


def fetch(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def percentiles(xs):
    """mean, median and p99 (nearest rank) of a list, in milliseconds, rounded."""
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    s = sorted(xs)
    p99 = s[min(len(s) - 1, max(0, -(-99 * len(s) // 100) - 1))]
    return {"mean": round(1000 * statistics.fmean(s), 1), "median": round(1000 * statistics.median(s), 1),
            "p99": round(1000 * p99, 1)}


def load_workload(tasks, systems, users, seed):
    """[(system index, system, user, answer)] in a fixed shuffled order."""
    groups = collections.OrderedDict()
    with open(tasks) as f:
        for line in f:
            item = json.loads(line)
            groups.setdefault(item["system"], []).append(item)
    if len(groups) < systems:
        sys.exit(f"{tasks} has {len(groups)} system prompts, fewer than --systems {systems}")
    work = []
    for si, (system, items) in enumerate(list(groups.items())[:systems]):
        if len(items) < users:
            sys.exit(f"{tasks}: system prompt {si} has {len(items)} users, fewer than --users {users}")
        work += [(si, system, it["user"], it["answer"]) for it in items[:users]]
    random.Random(seed).shuffle(work)
    return work


def cluster(cmd, env):
    out = subprocess.run(["bash", SCRIPT, cmd], env=env, capture_output=True, text=True)
    sys.stderr.write(out.stderr)
    return out


def read_state(cluster_dir):
    state = {}
    with open(os.path.join(cluster_dir, "cluster.env")) as f:
        for line in f:
            k, _, v = line.strip().partition("=")
            state[k] = v.strip('"')
    state["replicas"] = state["REPLICA_URLS"].split()
    return state


def body(a, system, user, stream):
    b = {"model": os.path.basename(os.path.normpath(a.model)),
         "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
         "max_tokens": a.gen_length, "steps": a.steps, "block_length": a.block_length,
         "temperature": 0, "cache": a.cache}
    if stream:
        b["stream"] = True
        b["stream_options"] = {"include_usage": True}
    return b


def stream_request(url, payload, timeout=600):
    """One streamed chat request: text, times, usage, the router's worker header, BiCache."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    pieces, usage, info, status, worker, error = [], None, None, None, None, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status = r.status
            worker = r.headers.get("x-smg-routed-worker-id")
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        if first is None:
                            first = time.perf_counter() - t0
                        pieces.append(text)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("unmask"):
                    info = chunk["unmask"]
    except urllib.error.HTTPError as e:
        status, error = e.code, e.read().decode()[:300]
    except (OSError, ValueError) as e:
        error = repr(e)
    return {"status": status, "error": error, "text": "".join(pieces), "ttft_s": first,
            "latency_s": time.perf_counter() - t0, "usage": usage, "worker": worker,
            "bicache_hit": ((info or {}).get("bicache") or {}).get("hit")}


class LoadSampler(threading.Thread):
    """Samples the router's GET /get_loads (what its load monitor read from the replicas)."""

    def __init__(self, router, every=0.5):
        super().__init__(daemon=True)
        self.router, self.every, self.samples, self.stop = router, every, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                self.samples.append(json.loads(fetch(self.router + "/get_loads", timeout=5)))
            except (OSError, ValueError):
                pass
            self.stop.wait(self.every)

    def summary(self):
        per = collections.defaultdict(lambda: {"samples": 0, "max_running": 0, "max_waiting": 0,
                                               "max_kv_usage": 0.0})
        for s in self.samples:
            for load in s.get("loads", []):
                w = per[load["worker"]]
                w["samples"] += 1
                w["max_running"] = max(w["max_running"], load.get("num_running_reqs", 0))
                w["max_waiting"] = max(w["max_waiting"], load.get("num_waiting_reqs", 0))
                w["max_kv_usage"] = max(w["max_kv_usage"], load.get("token_usage", 0.0))
        last = next((s for s in reversed(self.samples) if s.get("loads")), self.samples[-1] if self.samples else None)
        return {"polls": len(self.samples), "per_worker": dict(per), "last_nonempty": last}


def run_policy(a, policy, work, expected, env):
    """One measured run through a fresh cluster with the router on `policy`."""
    env = dict(env, POLICY=policy)
    up = cluster("up", env)
    if up.returncode != 0:
        return {"policy": policy, "error": f"serve-cluster.sh up exited {up.returncode}"}, up.returncode
    try:
        state = read_state(env["CLUSTER_DIR"])
        router, replicas = state["ROUTER_URL"], state["replicas"]
        # Warm-up, straight to each replica: kernels compile, no workload prefix is stored.
        for url in replicas:
            r = stream_request(url, body(a, SYSTEM, "What is the city of Bella?", True))
            if r["status"] != 200:
                return {"policy": policy, "error": f"warm-up of {url}: {r}"}, 1
        before = {u: parse_metrics(fetch(u + "/metrics")) for u in replicas}
        router_before = parse_metrics(fetch(state["ROUTER_METRICS_URL"] + "/metrics"))
        sampler = LoadSampler(router)
        sampler.start()
        print(f"{policy}: {len(work)} requests from {a.clients} clients", file=sys.stderr)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
            replies = list(pool.map(lambda w: stream_request(router, body(a, w[1], w[2], True)), work))
        wall = time.perf_counter() - t0
        time.sleep(1.5)  # one more load poll after the last request
        sampler.stop.set()
        sampler.join()
        after = {u: parse_metrics(fetch(u + "/metrics")) for u in replicas}
        router_after = parse_metrics(fetch(state["ROUTER_METRICS_URL"] + "/metrics"))
        with open(os.path.join(env["CLUSTER_DIR"], "router.log"), errors="replace") as f:
            router_log = f.read()
    finally:
        down = cluster("down", env)
    failures = []
    if down.returncode != 0:
        failures.append(f"serve-cluster.sh down exited {down.returncode}")
    return summarize(a, policy, work, expected, replies, wall, replicas, before, after,
                     router_before, router_after, sampler, router_log, failures), 0


def summarize(a, policy, work, expected, replies, wall, replicas, before, after, router_before,
              router_after, sampler, router_log, failures):
    tokens, correct = 0, 0
    served = collections.defaultdict(collections.Counter)
    for (si, system, user, answer), r in zip(work, replies):
        if r["status"] != 200 or r["error"]:
            failures.append(f"system {si} {user!r}: status {r['status']}: {r['error']}")
            continue
        tokens += (r["usage"] or {}).get("completion_tokens", 0)
        served[si][r["worker"] or "?"] += 1
        if r["text"] != expected[(system, user)]:
            failures.append(f"system {si} {user!r}: {r['text']!r} != generate's {expected[(system, user)]!r}")
        if r["text"].rsplit("####", 1)[-1].strip() == answer:
            correct += 1
    ok = [r for r in replies if r["status"] == 200 and not r["error"]]

    per_replica = {}
    for u in replicas:
        d = {k: total(after[u], f"unmask_bicache_{k}_total") - total(before[u], f"unmask_bicache_{k}_total")
             for k in ("hits", "misses", "fallbacks")}
        n = d["hits"] + d["misses"] + d["fallbacks"]
        d["hit_rate"] = round(d["hits"] / n, 3) if n else None
        vllm = [name for name in VLLM_NAMES if name in after[u]]
        d["vllm_names"] = vllm
        if "vllm:prefix_cache_queries_total" in after[u]:
            q = total(after[u], "vllm:prefix_cache_queries_total") - total(before[u], "vllm:prefix_cache_queries_total")
            h = total(after[u], "vllm:prefix_cache_hits_total") - total(before[u], "vllm:prefix_cache_hits_total")
            d["prefix_cache_tokens"] = {"queries": q, "hits": h, "hit_rate": round(h / q, 3) if q else None}
        per_replica[u] = d
    hits = sum(d["hits"] for d in per_replica.values())
    n = sum(d["hits"] + d["misses"] + d["fallbacks"] for d in per_replica.values())
    request_hits = sum(1 for r in ok if r["bicache_hit"])
    vllm_present = sorted({name for d in per_replica.values() for name in d["vllm_names"]})

    def deltas(prefix):
        out = {}
        for name, series in router_after.items():
            if name.startswith(prefix):
                for labels, v in series.items():
                    dv = v - router_before.get(name, {}).get(labels, 0.0)
                    if dv:
                        out[f"{name}{{{labels}}}"] = dv
        return out

    by_system = {}
    for si in sorted(served):
        by_system[str(si)] = dict(served[si])
    return {
        "policy": policy,
        "requests": len(work),
        "completed": len(ok),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "committed_tokens_per_s": round(tokens / wall, 2),
        "canvas_tokens_per_s": round(len(ok) * a.gen_length / wall, 2),
        "ttft_ms": percentiles([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "latency_ms": percentiles([r["latency_s"] for r in ok]),
        "answers_equal_generate": not any("!=" in f for f in failures),
        "answers_correct": f"{correct}/{len(work)}",
        "bicache": {"hits": hits, "requests": n, "hit_rate": round(hits / n, 3) if n else None,
                    "request_hits": request_hits, "per_replica": per_replica},
        "replicas_per_system_prompt": {si: len(c) for si, c in by_system.items()},
        "served_by": by_system,
        "vllm_names_on_replicas": vllm_present,
        "vllm_names_missing": [x for x in VLLM_NAMES if x not in vllm_present],
        "router": {
            "loads_read": sampler.summary(),
            "worker_requests": deltas("smg_worker_requests_total"),
            "load_polls": deltas("smg_engine_load_polls_total"),
            "cache_aware_branches": deltas("smg_cache_aware_policy_branch_total"),
            "log_load_lines": [l for l in re.sub(r"\x1b\[[0-9;]*m", "", router_log).splitlines()
                               if "load monitor" in l.lower() or "Fetched loads" in l][:3],
        },
        "failures": failures,
    }


def label(key, name):
    """The value of label `name` in a "metric{labels}" key."""
    m = re.search(name + r'="([^"]*)"', key)
    return m.group(1) if m else key


def markdown(result):
    """The comparison as docs/benchmarks/serve-cluster.md."""
    runs = result["runs"]
    cfg = result["config"]
    ms = lambda p, k: "–" if p[k] is None else f"{p[k]:.0f}"
    lines = [
        "# Serving cluster: cache-aware vs round-robin routing",
        "",
        f"{cfg['replicas']} `unmask serve` replicas of `{cfg['model']}` on loopback behind the SGLang Model "
        f"Gateway (PyPI `{result['router']}`, `scripts/serve-cluster.sh`), measured by",
        "",
        "    " + result["command"],
        "",
        f"Workload: {cfg['systems']} system prompts x {cfg['users']} users = {cfg['requests']} streamed chat "
        f"requests from `{cfg['tasks']}` in one fixed shuffled order, {cfg['clients']} concurrent clients, "
        f"max_tokens (canvas) {cfg['gen_length']}, {cfg['steps']} steps, block {cfg['block_length']}, "
        f"temperature 0, cache `{cfg['cache']}`. Each policy gets a fresh cluster (empty prefix stores); "
        "each replica is warmed up straight with the bundled demo system prompt, which the workload does "
        f"not use. Machine: {result['machine']}. Binary: `{result['binary']}`.",
        "",
        *summary(runs),
        "| | " + " | ".join(r["policy"] for r in runs) + " |",
        "|---|" + "---|" * len(runs),
        "| BiCache hit rate (all replicas) | " + " | ".join(
            f"{r['bicache']['hit_rate']:.1%} ({r['bicache']['hits']:.0f}/{r['bicache']['requests']:.0f})" for r in runs) + " |",
        "| replicas per system prompt | " + " | ".join(
            ", ".join(str(v) for v in r["replicas_per_system_prompt"].values()) for r in runs) + " |",
        "| committed (answer) tokens/s | " + " | ".join(f"{r['committed_tokens_per_s']:.1f}" for r in runs) + " |",
        "| canvas tokens/s | " + " | ".join(f"{r['canvas_tokens_per_s']:.1f}" for r in runs) + " |",
        "| requests/s | " + " | ".join(f"{r['requests_per_s']:.2f}" for r in runs) + " |",
        "| TTFT mean / median / p99 (ms) | " + " | ".join(
            f"{ms(r['ttft_ms'], 'mean')} / {ms(r['ttft_ms'], 'median')} / {ms(r['ttft_ms'], 'p99')}" for r in runs) + " |",
        "| latency (whole canvas) mean / median / p99 (ms) | " + " | ".join(
            f"{ms(r['latency_ms'], 'mean')} / {ms(r['latency_ms'], 'median')} / {ms(r['latency_ms'], 'p99')}" for r in runs) + " |",
        "| answers equal `unmask generate` | " + " | ".join(
            ("yes" if r["answers_equal_generate"] else "**no**") + f" ({r['completed']}/{r['requests']})" for r in runs) + " |",
        "| answers correct (task set) | " + " | ".join(r["answers_correct"] for r in runs) + " |",
        "",
        "TTFT is the time from sending a request to its first streamed text. A diffusion model "
        "streams text once every token before it is unmasked and final, so TTFT is how soon the "
        "start of the answer settles, not the end of a prefill. Latency is sending to `[DONE]`: "
        "the whole canvas of max_tokens. Throughput is over the wall time of the whole workload; "
        "committed tokens are the answer's (`usage.completion_tokens`), canvas tokens are "
        "requests x max_tokens.",
        "",
        "## BiCache per replica",
        "",
        "| policy | replica | hits | misses | fallbacks | hit rate | vLLM prefix cache (tokens hit / queried) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        for u, d in r["bicache"]["per_replica"].items():
            rate = "–" if d["hit_rate"] is None else f"{d['hit_rate']:.1%}"
            pc = d.get("prefix_cache_tokens")
            pc = (f"{pc['hits']:.0f} / {pc['queries']:.0f}" + (f" ({pc['hit_rate']:.1%})" if pc["hit_rate"] is not None else "")
                  if pc else "not published")
            lines.append(f"| {r['policy']} | {u} | {d['hits']:.0f} | {d['misses']:.0f} | {d['fallbacks']:.0f} | {rate} | {pc} |")
    lines += ["", "## Which replica served each system prompt", "",
              "Requests per replica, from the router's `x-smg-routed-worker-id` answer header "
              "(a replica's BiCache misses count the system prompts whose entry it built).", "",
              "| policy | system prompt | replicas (requests) |", "|---|---|---|"]
    for r in runs:
        for si, c in r["served_by"].items():
            lines.append(f"| {r['policy']} | {si} | " + ", ".join(f"{u.rsplit(':', 1)[-1]} ({n})" for u, n in sorted(c.items())) + " |")
    lines += ["", "## What the router read", ""]
    for r in runs:
        rt = r["router"]
        loads = rt["loads_read"]
        lines.append(f"- **{r['policy']}**: load polls per replica (`smg_engine_load_polls_total`, during the run): "
                     + ", ".join(f"{label(k, 'worker')} {v:.0f}" for k, v in rt["load_polls"].items())
                     + f"; `GET /get_loads` sampled {loads['polls']} times, "
                     + (("loads read: " + ", ".join(f"{w} max running {d['max_running']}, max waiting {d['max_waiting']}, "
                                                   f"max KV usage {d['max_kv_usage']:.2f}" for w, d in loads["per_worker"].items()))
                        if loads["per_worker"] else "no load read (the replicas publish none of the vLLM load names)")
                     + "; requests per worker (`smg_worker_requests_total`): "
                     + ", ".join(f"{label(k, 'worker')} {v:.0f}" for k, v in rt["worker_requests"].items())
                     + (("; cache-aware branches: " + ", ".join(f"{label(k, 'branch')} {v:.0f}"
                                                              for k, v in rt["cache_aware_branches"].items()))
                        if rt["cache_aware_branches"] else ""))
    present = runs[0]["vllm_names_on_replicas"] if runs else []
    lines += ["", "vLLM metric names on the replicas' `/metrics`: "
              + (", ".join(f"`{n}`" for n in present) if present else "none")
              + ("; absent: " + ", ".join(f"`{n}`" for n in runs[0]["vllm_names_missing"]) if runs and runs[0]["vllm_names_missing"] else "")
              + ".", ""]
    if any(r["failures"] for r in runs):
        lines += ["## Failures", ""] + [f"- {r['policy']}: {f}" for r in runs for f in r["failures"]] + [""]
    lines += [f"Raw numbers: `{os.path.basename(result['json'] or 'serve-cluster.json')}`.", ""]
    return "\n".join(lines)


def binary_label(path):
    """The binary's path, `--version` and the start of its sha256."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
    return f"{path} ({version}, sha256 {h.hexdigest()[:12]})"


def summary(runs):
    """One paragraph comparing the first run (the cache-aware one) with the second."""
    if len(runs) < 2 or any("bicache" not in r for r in runs[:2]):
        return []
    x, y = runs[0], runs[1]
    ratio = lambda k: x[k] / y[k] if y[k] else float("nan")
    misses = lambda r: sum(d["misses"] for d in r["bicache"]["per_replica"].values())
    return [
        f"**{x['policy']} against {y['policy']}**: BiCache hit rate {x['bicache']['hit_rate']:.1%} against "
        f"{y['bicache']['hit_rate']:.1%} ({misses(x):.0f} prefix entries built against {misses(y):.0f}: "
        f"{x['policy']} kept each of the {len(x['served_by'])} system prompts on "
        + ("one replica" if all(n == 1 for n in x["replicas_per_system_prompt"].values()) else "several replicas")
        + f", {y['policy']} spread them over up to {max(y['replicas_per_system_prompt'].values())}); "
        f"canvas throughput {ratio('canvas_tokens_per_s'):.2f}x, median TTFT "
        f"{x['ttft_ms']['median']:.0f} against {y['ttft_ms']['median']:.0f} ms, median latency "
        f"{x['latency_ms']['median']:.0f} against {y['latency_ms']['median']:.0f} ms; answers equal to "
        f"`unmask generate`: {'all' if x['answers_equal_generate'] and y['answers_equal_generate'] else 'NOT all'}.",
        "",
    ]


def run(a):
    """Both policies (or those given), one invocation; returns the exit status."""
    policies = a.cluster.split(",")
    tasks = os.path.join(ROOT, a.tasks) if not os.path.isabs(a.tasks) else a.tasks
    work = load_workload(tasks, a.systems, a.users, a.seed)
    print(f"{len(work)} requests: reference answers from unmask generate", file=sys.stderr)
    expected = {}
    for _, system, user, _ in work:
        if (system, user) not in expected:
            expected[(system, user)] = generate(a.unmask, a.model, system, user, a.gen_length, a.steps,
                                                a.block_length, a.cache)
    env = dict(os.environ, UNMASK=os.path.abspath(a.unmask), MODEL=os.path.abspath(a.model),
               REPLICAS=str(a.replicas), PORT=str(a.port),
               CLUSTER_DIR=os.path.abspath(a.cluster_dir or os.path.join(ROOT, "target/cluster-load")))
    runs, status = [], 0
    for policy in policies:
        r, code = run_policy(a, policy, work, expected, env)
        runs.append(r)
        if code or r.get("error") or r.get("failures"):
            status = 1
        if code:
            status = code
            break
    version = subprocess.run(["bash", SCRIPT, "install"], env=env, capture_output=True, text=True).stdout.strip()
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    result = {
        "bench": "serve-cluster",
        "command": " ".join(["python3", "tools/serve_load.py"] + sys.argv[1:]),
        "router": version.replace(" ", "=="),
        "binary": binary_label(a.unmask),
        "machine": f"{os.cpu_count()} CPU cores ({cpu}), wgpu on Mesa lavapipe (no GPU)",
        "config": {"model": a.model, "replicas": a.replicas, "systems": a.systems, "users": a.users,
                   "requests": len(work), "clients": a.clients, "tasks": a.tasks, "seed": a.seed,
                   "gen_length": a.gen_length, "steps": a.steps, "block_length": a.block_length,
                   "cache": a.cache},
        "runs": runs,
        "json": a.json,
    }
    if a.expect_affinity:
        for r in runs:
            if r.get("policy") == "cache_aware" and "served_by" in r:
                spread = {si: n for si, n in r["replicas_per_system_prompt"].items() if n != 1}
                if spread:
                    r["failures"].append(f"system prompts served by more than one replica: {spread}")
                    status = status or 1
                for u, d in r["bicache"]["per_replica"].items():
                    built = d["misses"]
                    owned = sum(1 for c in r["served_by"].values() if u in c)
                    if built != owned:
                        r["failures"].append(f"{u} built {built:.0f} BiCache entries for {owned} system prompts")
                        status = status or 1
    text = json.dumps(result, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(result))
    return status
