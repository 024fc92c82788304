#!/usr/bin/env bash
# ACache on the bundled model's affix set (the table as a shared span after a per-request
# role line, so the span sits at another offset in every request): none, the dual cache
# ACache is built on, and acache over anchor ratios from 0 (the span reused as it is) to 1
# (every span token recomputed), all in one run. Writes JSON and a markdown table under
# docs/benchmarks/ (DIR to change). Extra arguments go to `unmask eval`.
#
#   scripts/bench-acache.sh                      # heldout-affix-small, gen 32 = 8 blocks of 4, 16 steps
#   SET=data/tasks/heldout-affix.jsonl scripts/bench-acache.sh --limit 100
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
SET="${SET:-data/tasks/heldout-affix-small.jsonl}"
NAME="${NAME:-acache}"
DIR="${DIR:-docs/benchmarks}"
RATIOS="${RATIOS:-0,0.05,0.1,0.2,0.3,1}"
mkdir -p "$DIR"
cargo run --release --quiet -p unmask-cli -- eval \
  --set "$SET" --cache none,fast-dllm-dual,acache --anchor-ratios "$RATIOS" \
  --gen-length 32 --block-length 4 --steps 16 \
  --out "$DIR/$NAME.json" --markdown "$DIR/$NAME.md" "$@"
