#!/usr/bin/env bash
# The cluster check: three `unmask serve` replicas behind the SGLang Model Gateway's cache-aware
# policy (scripts/serve-cluster.sh), a small workload through the router (2 system prompts x 3
# users, streamed, max_tokens 16) by tools/serve_load.py --cluster, then:
#   1. every answer equals `unmask generate --json` for the same request;
#   2. the router sent each system prompt to one replica (its x-smg-routed-worker-id header),
#      and each replica built one BiCache entry per system prompt it served (its /metrics);
#   3. a replica's /metrics carries vLLM's names when the binary has them;
#   4. the cluster comes down (SIGTERM, every part exits).
# Bounded (about a minute here; killed at 170 s). If the router cannot be installed, it says why
# on one line and exits 0.
#
#   scripts/test-cluster.sh [UNMASK_BINARY]     (default target/debug/unmask)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/debug/unmask}
[ -x "$BIN" ] || { echo "no binary at $BIN (cargo build -p unmask-cli)"; exit 2; }

rc=0
why=$(scripts/serve-cluster.sh install 2>&1) || rc=$?
if [ $rc = 3 ]; then
  echo "cluster test skipped: ${why#serve-cluster: }"
  exit 0
elif [ $rc != 0 ]; then
  echo "$why"
  exit $rc
fi
echo "router: $why"
# shellcheck disable=SC1091
source scripts/env.sh

export CLUSTER_DIR=target/cluster-test
trap 'scripts/serve-cluster.sh down >/dev/null 2>&1 || true' EXIT
out=target/cluster-test.json
rm -f "$out"
load_rc=0
timeout 170 python3 tools/serve_load.py --unmask "$BIN" --model models/tiny --cluster cache_aware \
  --systems 2 --users 3 --clients 6 --gen-length 16 --steps 16 --block-length 16 \
  --port 8400 --cluster-dir "$CLUSTER_DIR" --expect-affinity --json "$out" >/dev/null || load_rc=$?
if [ ! -s "$out" ]; then
  echo "FAIL tools/serve_load.py --cluster exited $load_rc without a result (124: past 170 s)"
  echo "test-cluster: 0 passed, 1 failed"
  exit 1
fi

if grep -a -q 'vllm:num_requests_waiting' "$BIN"; then has_vllm=1; else has_vllm=0; fi
python3 - "$out" "$has_vllm" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
has_vllm = sys.argv[2] == "1"
run = result["runs"][0]
checks = []
def check(ok, what):
    checks.append(ok)
    print(("ok   " if ok else "FAIL ") + what)
check(run["completed"] == run["requests"] and run["answers_equal_generate"],
      f"{run['completed']}/{run['requests']} answers through the router equal unmask generate")
check(all(n == 1 for n in run["replicas_per_system_prompt"].values()),
      "cache-aware routing: each system prompt on one replica "
      + str({si: list(c) for si, c in run["served_by"].items()}))
per = run["bicache"]["per_replica"]
check(all(d["misses"] == sum(1 for c in run["served_by"].values() if u in c) for u, d in per.items())
      and run["bicache"]["hits"] == run["requests"] - len(run["served_by"]),
      "BiCache: one miss per system prompt, on its replica; hits "
      + ", ".join(f"{u.rsplit(':', 1)[1]} {d['hits']:.0f}/{d['hits'] + d['misses']:.0f}" for u, d in per.items()))
if has_vllm:
    check(not run["vllm_names_missing"], "the binary has vLLM metric names and a replica's /metrics carries "
          + ", ".join(run["vllm_names_on_replicas"]) + ("; missing: " + ", ".join(run["vllm_names_missing"])
                                                        if run["vllm_names_missing"] else ""))
else:
    print("note the binary has no vLLM metric names (no vllm:num_requests_waiting in it): not checked")
check(not run["failures"], "no failures" + ("" if not run["failures"] else ": " + "; ".join(run["failures"])))
print(f"test-cluster: {sum(checks)} passed, {len(checks) - sum(checks)} failed")
sys.exit(0 if all(checks) else 1)
EOF
