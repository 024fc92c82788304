#!/usr/bin/env bash
# Serves the demo page on http://127.0.0.1:${PORT:-8080}/ (build it first with
# scripts/build-web.sh). WebGPU needs a secure context: localhost counts as one.
set -euo pipefail
cd "$(dirname "$0")/../web"
if [ ! -f pkg/unmask_wasm.js ]; then
  echo "web/pkg is missing: run scripts/build-web.sh first" >&2
  exit 1
fi
port="${PORT:-8080}"
echo "open http://127.0.0.1:$port/ in a browser with WebGPU (Chrome, Edge)"
exec python3 -m http.server "$port" --bind 127.0.0.1
