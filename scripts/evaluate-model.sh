#!/usr/bin/env bash
# Re-measures everything that depends on the bundled model, after the model changes:
#
#   1. held-out accuracy with cache mode none at temperature 0 (data/tasks/heldout.jsonl)
#      -> $MODEL/eval_unmask.json and .md
#   2. BiCache's depth table and similarity heat map (unmask profile on heldout-small)
#      -> $MODEL/profile/, and $MODEL/bicache_depth.json
#   3. every cache mode on heldout-small (scripts/bench-cache.sh)
#      -> $DIR/cache-modes.json and .md
#   4. f16, q8 and q4 weights on heldout-small and their token agreement
#      -> $DIR/quant-heldout.json and .md
#
# About 25 minutes on lavapipe. Run it on an otherwise idle machine: the throughput columns
# are timings. Environment: MODEL (default models/tiny), DIR (default docs/benchmarks),
# LIMIT (only the first N items of each set; default all), STEPS (default "1 2 3 4").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
MODEL="${MODEL:-models/tiny}"
STEPS="${STEPS:-1 2 3 4}"
DIR="${DIR:-docs/benchmarks}"
cargo build --release --quiet -p unmask-cli
UNMASK=target/release/unmask
LIMIT_ARGS=()
[ -n "${LIMIT:-}" ] && LIMIT_ARGS=(--limit "$LIMIT")

for step in $STEPS; do
  case "$step" in
  1)
    echo "== held-out accuracy, cache none"
    "$UNMASK" eval --model "$MODEL" --set data/tasks/heldout.jsonl --cache none "${LIMIT_ARGS[@]}" \
      --out "$MODEL/eval_unmask.json" --markdown "$MODEL/eval_unmask.md"
    ;;
  2)
    echo "== BiCache depth table"
    "$UNMASK" profile --model "$MODEL" --set data/tasks/heldout-small.jsonl --out "$MODEL/profile" \
      --gen-length 32 --user-repeat 1,4 "${LIMIT_ARGS[@]}"
    cp "$MODEL/profile/bicache_depth.json" "$MODEL/bicache_depth.json"
    ;;
  3)
    echo "== cache modes"
    DIR="$DIR" scripts/bench-cache.sh --model "$MODEL" "${LIMIT_ARGS[@]}"
    ;;
  4)
    echo "== quantized weights"
    tmp=$(mktemp -d)
    for w in f16 q8 q4; do
      "$UNMASK" eval --model "$MODEL" --set data/tasks/heldout-small.jsonl --weights "$w" \
        "${LIMIT_ARGS[@]}" --out "$tmp/$w.json"
    done
    python3 tools/eval_agreement.py "$tmp/f16.json" "$tmp/q8.json" "$tmp/q4.json" \
      --json "$DIR/quant-heldout.json" --markdown "$DIR/quant-heldout.md"
    rm -rf "$tmp"
    ;;
  *)
    echo "unknown step $step (expected 1 to 4)" >&2
    exit 2
    ;;
  esac
done
