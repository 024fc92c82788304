#!/usr/bin/env bash
# A local cluster of `unmask serve` replicas behind the SGLang Model Gateway (smg), on loopback.
#
#   scripts/serve-cluster.sh up       start REPLICAS replicas and the router; prints the router URL
#   scripts/serve-cluster.sh status   what runs, and whether each part answers its health check
#   scripts/serve-cluster.sh down     SIGTERM to every part, then checks that each one exited
#   scripts/serve-cluster.sh install  only install the router into its venv
#
# Settings (environment):
#   UNMASK=target/release/unmask  the binary          MODEL=models/tiny     the model folder
#   POLICY=cache_aware            or round_robin (any policy `smg launch --policy` takes)
#   REPLICAS=3                    replicas            PORT=8100             the router's port;
#   replica i listens on PORT+i and the router's Prometheus metrics on PORT+90
#   CLUSTER_DIR=target/cluster    pids, ports, logs   SERVE_ARGS=""         more `unmask serve` flags
#   CLUSTER_VENV=target/cluster-venv  the router's venv  ROUTER_PKG=smg==1.13.0  what pip installs there
#
# Exit codes: 0 done; 1 a part failed to start or stop (its log is printed); 2 bad usage or a
# missing binary; 3 the router cannot be installed here (the reason is printed).
#
# The router. The SGLang Model Gateway is published on PyPI twice: `sglang-router` (its old
# name, 0.3.x) and `smg` (1.x, the maintained one). We take `smg`: it installs from a
# prebuilt wheel with no compiler, speaks plain HTTP to OpenAI-compatible workers, has the
# cache-aware policy (a radix tree of the request text per worker: a request goes to the
# worker holding the longest match when it covers at least --cache-threshold of the text,
# otherwise to the least loaded one), a Prometheus endpoint of its own, the header
# x-smg-routed-worker-id on every answer, and a load monitor that scrapes each worker's
# /metrics for vLLM's names (vllm:num_requests_waiting, vllm:num_requests_running,
# vllm:kv_cache_usage_perc) when the worker is registered as a vLLM runtime. Unmask names
# itself "unmask" in /v1/models, which smg cannot classify, so the replicas are registered
# through the router's POST /workers with runtime_type "vllm": that is what turns the load
# scrape on (GET /get_loads on the router shows what it read). `vllm-router` (0.1.x) installs
# here too; it comes from the same router code base (the same CLI), and was not chosen: smg is
# the maintained line, and its scrape of the vLLM names, its per-worker load report and its
# routed-worker header were each checked against these replicas.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUTER_PKG=${ROUTER_PKG:-smg==1.13.0}
VENV=${CLUSTER_VENV:-target/cluster-venv}
UNMASK=${UNMASK:-target/release/unmask}
MODEL=${MODEL:-models/tiny}
POLICY=${POLICY:-cache_aware}
REPLICAS=${REPLICAS:-3}
PORT=${PORT:-8100}
CLUSTER_DIR=${CLUSTER_DIR:-target/cluster}
SERVE_ARGS=${SERVE_ARGS:-}
HOST=127.0.0.1

say() { echo "serve-cluster: $*" >&2; }

# install: the router's venv, or exit 3 with the reason.
install_router() {
  if "$VENV/bin/python" -c "import smg.smg_rs" 2>/dev/null; then return 0; fi
  command -v python3 >/dev/null || { say "cannot install the router: python3 is missing"; exit 3; }
  if ! python3 -m venv "$VENV" >/dev/null 2>"$VENV.err"; then
    say "cannot install the router: python3 -m venv failed ($(tail -1 "$VENV.err"); on Debian: apt-get install python3-venv)"
    exit 3
  fi
  local log=$VENV-install.log
  if ! "$VENV/bin/pip" install --disable-pip-version-check --only-binary=:all: "$ROUTER_PKG" >"$log" 2>&1; then
    say "cannot install the router: pip install $ROUTER_PKG failed ($(grep -E '^ERROR' "$log" | tail -1 || true)); full log in $log"
    exit 3
  fi
  if ! "$VENV/bin/python" -c "import smg.smg_rs" 2>"$VENV.err"; then
    say "cannot install the router: $ROUTER_PKG installed but its native module does not load ($(tail -1 "$VENV.err"))"
    exit 3
  fi
  rm -f "$VENV.err"
}

# A process we started and recorded: alive, and still the program we started under that pid.
alive() {
  local pid=$1 what=$2
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$what"
}

http_ok() { curl -s -o /dev/null -m 3 -w '%{http_code}' "$1" 2>/dev/null | grep -q '^200$'; }

port_free() {
  python3 -c "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('$HOST', int(sys.argv[1])))" "$1" 2>/dev/null
}

# Waits until `$1` answers 200 (up to $2 s) while pid $3 lives.
wait_ok() {
  local url=$1 limit=$2 pid=$3 what=$4 t=0
  while ! http_ok "$url"; do
    alive "$pid" "$what" || return 1
    sleep 0.5; t=$((t + 1))
    [ $t -lt $((limit * 2)) ] || return 1
  done
}

# Stops one recorded process: SIGTERM, wait up to $3 s, then SIGKILL and report.
stop_one() {
  local name=$1 pidfile=$2 grace=$3 what=$4 pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if ! alive "$pid" "$what"; then rm -f "$pidfile"; return 0; fi
  kill -TERM "$pid"
  local t=0
  while alive "$pid" "$what" && [ $t -lt $((grace * 4)) ]; do sleep 0.25; t=$((t + 1)); done
  if alive "$pid" "$what"; then
    say "$name (pid $pid) did not exit within ${grace} s of SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.5
    rm -f "$pidfile"
    return 1
  fi
  say "$name (pid $pid) exited"
  rm -f "$pidfile"
}

load_state() {
  [ -f "$CLUSTER_DIR/cluster.env" ] || return 1
  # shellcheck disable=SC1091
  source "$CLUSTER_DIR/cluster.env"
}

down() {
  local failed=0
  if ! load_state; then say "no cluster recorded in $CLUSTER_DIR"; return 0; fi
  # The router first, so that no new request reaches a replica that is stopping.
  stop_one router "$CLUSTER_DIR/router.pid" 30 "smg" || failed=1
  local i
  for i in $(seq 1 "$CLUSTER_REPLICAS"); do
    stop_one "replica $i" "$CLUSTER_DIR/replica-$i.pid" 30 "serve" || failed=1
  done
  rm -f "$CLUSTER_DIR/cluster.env"
  [ $failed = 0 ] && say "down: every part exited"
  return $failed
}

# "healthy", "running" (alive, health check failing) or "down".
state_of() {
  local pid=$1 what=$2 url=$3
  if ! alive "$pid" "$what"; then echo down
  elif http_ok "$url/health"; then echo healthy
  else echo running; fi
}

status() {
  if ! load_state; then say "no cluster recorded in $CLUSTER_DIR"; return 1; fi
  local bad=0 i pid state url
  pid=$(cat "$CLUSTER_DIR/router.pid" 2>/dev/null || true)
  state=$(state_of "$pid" smg "$ROUTER_URL")
  [ "$state" = healthy ] || bad=1
  echo "router     $ROUTER_URL  pid ${pid:-?}  $state  (policy $CLUSTER_POLICY, metrics $ROUTER_METRICS_URL/metrics)"
  for i in $(seq 1 "$CLUSTER_REPLICAS"); do
    pid=$(cat "$CLUSTER_DIR/replica-$i.pid" 2>/dev/null || true)
    url=$(echo "$REPLICA_URLS" | cut -d' ' -f"$i")
    state=$(state_of "$pid" serve "$url")
    [ "$state" = healthy ] || bad=1
    echo "replica $i  $url  pid ${pid:-?}  $state"
  done
  return $bad
}

up() {
  [ -x "$UNMASK" ] || { say "no unmask binary at $UNMASK (set UNMASK=, or cargo build --release -p unmask-cli)"; exit 2; }
  [ -d "$MODEL" ] || { say "no model folder at $MODEL"; exit 2; }
  install_router
  mkdir -p "$CLUSTER_DIR"
  if load_state && alive "$(cat "$CLUSTER_DIR/router.pid" 2>/dev/null || true)" smg; then
    say "a cluster is already up ($ROUTER_URL); scripts/serve-cluster.sh down first"
    exit 1
  fi
  local metrics_port=$((PORT + 90)) p i
  for p in "$PORT" "$metrics_port" $(seq $((PORT + 1)) $((PORT + REPLICAS))); do
    port_free "$p" || { say "port $p on $HOST is taken (set PORT= to move the cluster)"; exit 1; }
  done
  # shellcheck disable=SC1091
  source scripts/env.sh

  local urls=""
  for i in $(seq 1 "$REPLICAS"); do
    p=$((PORT + i))
    # setsid: a replica outlives this shell and gets no signal meant for it (ctrl-c here).
    # shellcheck disable=SC2086
    setsid "$UNMASK" serve --model "$MODEL" --host "$HOST" --port "$p" $SERVE_ARGS \
      >"$CLUSTER_DIR/replica-$i.log" 2>&1 </dev/null &
    echo $! >"$CLUSTER_DIR/replica-$i.pid"
    urls="$urls http://$HOST:$p"
  done
  urls=${urls# }
  cat >"$CLUSTER_DIR/cluster.env" <<EOF
CLUSTER_REPLICAS=$REPLICAS
CLUSTER_POLICY=$POLICY
ROUTER_URL=http://$HOST:$PORT
ROUTER_METRICS_URL=http://$HOST:$metrics_port
REPLICA_URLS="$urls"
EOF
  for i in $(seq 1 "$REPLICAS"); do
    local url
    url=$(echo "$urls" | cut -d' ' -f"$i")
    if ! wait_ok "$url/health" 120 "$(cat "$CLUSTER_DIR/replica-$i.pid")" serve; then
      say "replica $i ($url) did not become healthy; its log:"
      tail -20 "$CLUSTER_DIR/replica-$i.log" >&2
      down || true
      exit 1
    fi
  done

  # The cache-aware policy's warm-up slice (sending a share of cache misses, and one cache hit
  # in 8, to a replica whose tree is still thin) is off: these replicas start together, and
  # the slice would only split a system prompt's entry over several of them.
  setsid "$VENV/bin/smg" launch --host "$HOST" --port "$PORT" --policy "$POLICY" \
    --prometheus-host "$HOST" --prometheus-port "$metrics_port" \
    --load-monitor-interval 1 --worker-warmup-secs 0 --worker-warmup-divert-every 0 \
    --health-check-interval-secs 5 --log-level info \
    >"$CLUSTER_DIR/router.log" 2>&1 </dev/null &
  echo $! >"$CLUSTER_DIR/router.pid"
  local rpid
  rpid=$(cat "$CLUSTER_DIR/router.pid")
  if ! wait_ok "http://$HOST:$PORT/health" 60 "$rpid" smg; then
    say "the router did not answer /health; its log:"
    tail -20 "$CLUSTER_DIR/router.log" >&2
    down || true
    exit 1
  fi
  for url in $urls; do
    if ! curl -s -f -m 10 -X POST "http://$HOST:$PORT/workers" -H 'Content-Type: application/json' \
        -d "{\"url\": \"$url\", \"runtime_type\": \"vllm\"}" >/dev/null; then
      say "the router refused to register $url"
      down || true
      exit 1
    fi
  done
  # Ready when the router lists every replica as healthy and ready.
  local t=0
  until curl -s -m 3 "http://$HOST:$PORT/workers" | python3 -c '
import json, sys
ws = json.load(sys.stdin).get("workers", [])
sys.exit(0 if len(ws) == int(sys.argv[1]) and all(w.get("is_healthy") and w.get("status") == "ready" for w in ws) else 1)
' "$REPLICAS" 2>/dev/null; do
    sleep 0.5; t=$((t + 1))
    if [ $t -ge 120 ] || ! alive "$rpid" smg; then
      say "the router did not list the $REPLICAS replicas as ready; its log:"
      tail -20 "$CLUSTER_DIR/router.log" >&2
      down || true
      exit 1
    fi
  done
  say "up: $REPLICAS replicas ($urls), router policy $POLICY, router metrics http://$HOST:$metrics_port/metrics, state in $CLUSTER_DIR"
  echo "http://$HOST:$PORT"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  install) install_router; "$VENV/bin/python" -c "import importlib.metadata as m; print('smg', m.version('smg'))" ;;
  *) echo "usage: scripts/serve-cluster.sh up|down|status|install   (POLICY=cache_aware|round_robin)" >&2; exit 2 ;;
esac
