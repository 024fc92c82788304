#!/usr/bin/env bash
# Tests `unmask serve` with the official `openai` Python client (installed into a venv under
# target/) and raw HTTP: tools/serve_test.py against the bundled model on a loopback port;
# then its KV-cache events, and lm-evaluation-harness through tools/lm_eval_unmask.py.
#
#   scripts/test-server.sh [UNMASK_BINARY]     (default target/debug/unmask)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
BIN=${1:-target/debug/unmask}
[ -x "$BIN" ] || { echo "no binary at $BIN (cargo build -p unmask-cli)"; exit 2; }
VENV=target/server-test-venv
if ! "$VENV/bin/python" -c "import openai, zmq, msgpack" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "openai>=1.40,<3" "pyzmq>=25" "msgpack>=1"
fi
"$VENV/bin/python" -c "import openai; print('openai client', openai.__version__)"
cd tools
"../$VENV/bin/python" serve_test.py --unmask "../$BIN" --model ../models/tiny
# KV-cache events: a ZMQ subscriber reads the prefix store's entries as vLLM's events.
"../$VENV/bin/python" kv_events_test.py --unmask "../$BIN" --model ../models/tiny
# lm-evaluation-harness through tools/lm_eval_unmask.py (lm_eval without PyTorch, its own venv:
# its datasets/scikit-learn stack is large). Local task files only: no hub access.
cd ..
LM_VENV=target/lm-eval-venv
if ! "$LM_VENV/bin/python" -c "import lm_eval" 2>/dev/null; then
  python3 -m venv "$LM_VENV"
  "$LM_VENV/bin/pip" install --quiet --disable-pip-version-check "lm_eval>=0.4.9,<0.5"
fi
"$LM_VENV/bin/python" -c "import importlib.metadata as m; print('lm_eval', m.version('lm_eval'))"
cd tools
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_HOME="$PWD/../target/hf-home"
exec "../$LM_VENV/bin/python" lm_eval_check.py --unmask "../$BIN" --model ../models/tiny
