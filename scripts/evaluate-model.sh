#!/usr/bin/env bash
# Re-measures everything that depends on the bundled model, after the model changes. Every
# generation uses the BiCache paper's request shape scaled to the model: 32 tokens in
# 8 blocks of 4, 16 steps (2 tokens per step), temperature 0.
#
#   1. accuracy with cache mode none on heldout-small.jsonl and on heldout-small-seed1.jsonl
#      (the same kind of set from another seed) -> $MODEL/eval_unmask{,-seed1}.json and .md
#   2. BiCache's depth table and similarity heat map (unmask profile on the held-out sets
#      from r = 50 % to 95 %: heldout-small-short, heldout-small, -members16 and -members32;
#      per-row statistic p1-low3: the 1st percentile of the K/V similarity up to 300 prefix
#      rows, the third-lowest beyond)
#      -> $MODEL/profile/, and $MODEL/bicache_depth.json
#   3. every cache mode on heldout-small.jsonl, every step run (scripts/bench-cache.sh
#      --full-canvas)
#      -> $DIR/cache-modes.json and .md
#   4. f16, q8 and q4 weights on heldout-small.jsonl and their token agreement
#      -> $DIR/quant-heldout.json and .md
#   5. batched BiCache: the held-out set through bicache-dual one item at a time and
#      5 at a time, compared token by token -> $DIR/bicache-batch-heldout.json and .md
#   6. ACache on heldout-affix-small.jsonl (the table as a shared span after a role line of
#      its own): none, fast-dllm-dual and acache at anchor ratios 0 .. 1
#      (scripts/bench-acache.sh) -> $DIR/acache.json and .md
#   7. dLLM-Cache over rho x K_r, one block and blocks of 4, its wrong caches, and its work
#      at LLaDA-8B's shapes (scripts/bench-dllm-cache.sh) -> $DIR/dllm-cache-*
#
# About 32 minutes on lavapipe. Run it on an otherwise idle machine: the throughput columns
# are timings. Environment: MODEL (default models/tiny), DIR (default docs/benchmarks),
# LIMIT (only the first N items of each set; default all), STEPS (default "1 2 3 4 5 6 7").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
MODEL="${MODEL:-models/tiny}"
STEPS="${STEPS:-1 2 3 4 5 6 7}"
DIR="${DIR:-docs/benchmarks}"
cargo build --release --quiet -p unmask-cli
UNMASK=target/release/unmask
SHAPE=(--gen-length 32 --block-length 4 --steps 16)
LIMIT_ARGS=()
[ -n "${LIMIT:-}" ] && LIMIT_ARGS=(--limit "$LIMIT")

for step in $STEPS; do
  case "$step" in
  1)
    echo "== held-out accuracy, cache none"
    for set in heldout-small heldout-small-seed1; do
      suffix="${set#heldout-small}"
      "$UNMASK" eval --model "$MODEL" --set "data/tasks/$set.jsonl" --cache none "${SHAPE[@]}" "${LIMIT_ARGS[@]}" \
        --out "$MODEL/eval_unmask$suffix.json" --markdown "$MODEL/eval_unmask$suffix.md"
    done
    ;;
  2)
    echo "== BiCache depth table"
    # the held-out questions with one-member system prompts (r = 50), the usual 8-member
    # ones (r = 85), 16- (r = 91) and 32-member ones (r = 95). Not with repeated user turns:
    # those of the long prompts run past the positions the model was trained on, and their
    # drift would set the depth of the buckets they land in (r = 85-93)
    set_file=$(mktemp --suffix=.jsonl)
    cat data/tasks/heldout-small-short.jsonl data/tasks/heldout-small.jsonl \
      data/tasks/heldout-small-members16.jsonl data/tasks/heldout-small-members32.jsonl > "$set_file"
    "$UNMASK" profile --model "$MODEL" --set "$set_file" --out "$MODEL/profile" \
      --gen-length 32 --row-statistic p1-low3 "${LIMIT_ARGS[@]}"
    rm -f "$set_file"
    cp "$MODEL/profile/bicache_depth.json" "$MODEL/bicache_depth.json"
    ;;
  3)
    echo "== cache modes"
    DIR="$DIR" scripts/bench-cache.sh --model "$MODEL" --full-canvas "${LIMIT_ARGS[@]}"
    ;;
  4)
    echo "== quantized weights"
    tmp=$(mktemp -d)
    for w in f16 q8 q4; do
      "$UNMASK" eval --model "$MODEL" --set data/tasks/heldout-small.jsonl --weights "$w" "${SHAPE[@]}" \
        "${LIMIT_ARGS[@]}" --out "$tmp/$w.json"
    done
    python3 tools/eval_agreement.py "$tmp/f16.json" "$tmp/q8.json" "$tmp/q4.json" \
      --json "$DIR/quant-heldout.json" --markdown "$DIR/quant-heldout.md"
    rm -rf "$tmp"
    ;;
  5)
    echo "== batched BiCache against one request at a time"
    tmp=$(mktemp -d)
    for b in 1 5; do
      "$UNMASK" eval --model "$MODEL" --set data/tasks/heldout-small.jsonl --cache bicache-dual --batch "$b" \
        "${SHAPE[@]}" "${LIMIT_ARGS[@]}" --out "$tmp/b$b.json" >/dev/null
    done
    python3 tools/eval_agreement.py --by batch "$tmp/b1.json" "$tmp/b5.json" \
      --json "$DIR/bicache-batch-heldout.json" --markdown "$DIR/bicache-batch-heldout.md"
    rm -rf "$tmp"
    ;;
  6)
    echo "== ACache over anchor ratios"
    DIR="$DIR" scripts/bench-acache.sh --model "$MODEL" "${LIMIT_ARGS[@]}"
    ;;
  7)
    echo "== dLLM-Cache over refresh ratios x response intervals"
    DIR="$DIR" scripts/bench-dllm-cache.sh --model "$MODEL" "${LIMIT_ARGS[@]}"
    ;;
  *)
    echo "unknown step $step (expected 1 to 7)" >&2
    exit 2
    ;;
  esac
done
