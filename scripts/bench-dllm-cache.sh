#!/usr/bin/env bash
# dLLM-Cache on the bundled model's held-out set, gen 32 in 16 steps, as one block and as
# 8 blocks of 4: none, fast-dllm-dual and dllm-cache over refresh ratios rho x response
# intervals K_r (the reference's defaults rho 0.25, K_r 7, K_p 100 among them), all in one
# run per block length; then the wrong caches at the defaults (V-verify picking the rows
# that moved least; with blocks, the block not pinned: the reference's rule); then the
# work per step at LLaDA-8B's shapes (prompt 1024, gen 256, 256 steps; one block and
# blocks of 32), counted by the mode planner. Writes JSON and markdown under
# docs/benchmarks/ (DIR to change). Extra arguments go to `unmask eval`.
#
#   scripts/bench-dllm-cache.sh
#   SET=data/tasks/heldout.jsonl scripts/bench-dllm-cache.sh --limit 100
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
SET="${SET:-data/tasks/heldout-small.jsonl}"
DIR="${DIR:-docs/benchmarks}"
RATIOS="${RATIOS:-0.1,0.25,0.5}"
INTERVALS="${INTERVALS:-4,7,16}"
mkdir -p "$DIR"
cargo build --release --quiet -p unmask-cli
BIN=target/release/unmask
for block in 32 4; do
  "$BIN" eval --set "$SET" --cache none,fast-dllm-dual,dllm-cache \
    --refresh-ratios "$RATIOS" --response-intervals "$INTERVALS" \
    --gen-length 32 --block-length "$block" --steps 16 \
    --out "$DIR/dllm-cache-block$block.json" --markdown "$DIR/dllm-cache-block$block.md" "$@"
done
"$BIN" eval --set "$SET" --cache dllm-cache --verify-pick highest-cosine \
  --gen-length 32 --block-length 32 --steps 16 \
  --out "$DIR/dllm-cache-wrong-pick.json" --markdown "$DIR/dllm-cache-wrong-pick.md" "$@"
"$BIN" eval --set "$SET" --cache dllm-cache --pin-block false \
  --gen-length 32 --block-length 4 --steps 16 \
  --out "$DIR/dllm-cache-unpinned.json" --markdown "$DIR/dllm-cache-unpinned.md" "$@"
: >"$DIR/dllm-cache-work-llada8b.jsonl"
for block in 256 32; do
  for pin in true false; do
    "$BIN" bench --config llada-8b --only work --prefix-tokens 960 --user-tokens 64 \
      --gen-length 256 --steps 256 --block-length "$block" --pin-block "$pin" \
      --out "$DIR/work.tmp"
    cat "$DIR/work.tmp" >>"$DIR/dllm-cache-work-llada8b.jsonl"
  done
done
rm -f "$DIR/work.tmp"
