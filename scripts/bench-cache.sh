#!/usr/bin/env bash
# Cache-mode benchmark on the bundled model's held-out set: every cache mode over the same
# items in one run, with the BiCache paper's request shape scaled to the model (8 blocks,
# 2 tokens committed per step, refresh at every block start). Writes JSON and a markdown
# table under docs/benchmarks/ (DIR to change). Extra arguments go to `unmask eval`.
#
#   scripts/bench-cache.sh                      # heldout-small, gen 32 = 8 blocks of 4, 16 steps
#   SET=data/tasks/heldout.jsonl scripts/bench-cache.sh --limit 100
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
SET="${SET:-data/tasks/heldout-small.jsonl}"
NAME="${NAME:-cache-modes}"
DIR="${DIR:-docs/benchmarks}"
mkdir -p "$DIR"
cargo run --release --quiet -p unmask-cli -- eval \
  --set "$SET" --cache all \
  --gen-length 32 --block-length 4 --steps 16 \
  --out "$DIR/$NAME.json" --markdown "$DIR/$NAME.md" "$@"
