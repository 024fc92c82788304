#!/usr/bin/env bash
# The run command: sets up a fresh machine, then generates text with the bundled model.
# Extra arguments go to `unmask generate` (e.g. --prompt "..." --model DIR --json).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ $# -eq 0 ]; then
  set -- --prompt "What is the capital of France?" --gen-length 32 --steps 32 --block-length 16
fi
exec cargo run --release --quiet -p unmask-cli -- generate "$@"
