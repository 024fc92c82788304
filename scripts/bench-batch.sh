#!/usr/bin/env bash
# Batched BiCache benchmark: requests that share a system prompt, run one at a time and in
# batches that share one forward pass per step, with the paper's request shape scaled to
# the bundled model (8 blocks of 4, 2 tokens per step, shared prefix ~85 % of the request).
# Then the held-out set through bicache-dual one item at a time and up to 5 at a time
# (continuous batching), compared token by token. Writes JSON lines, a report and the
# comparison under docs/benchmarks/ (DIR to change); extra arguments go to `unmask bench`.
#
#   scripts/bench-batch.sh                         # models/tiny, batches 1, 2, 4, 8
#   MODEL=/path/to/LLaDA-8B-Instruct scripts/bench-batch.sh --prefix-tokens 1024
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
MODEL="${MODEL:-models/tiny}"
NAME="${NAME:-bicache-batch}"
DIR="${DIR:-docs/benchmarks}"
mkdir -p "$DIR"
cargo build --release --quiet -p unmask-cli
target/release/unmask bench --model "$MODEL" --only requests \
  --cache fast-dllm-dual,bicache-dual --decoding quota --batch 1,2,4,8 \
  --gen-length 32 --block-length 4 --steps 16 \
  --prefix-tokens 300 --user-tokens 20 --groups 2 --per-group 8 \
  --out "$DIR/$NAME.jsonl" "$@"
target/release/unmask bench-report "$DIR/$NAME.jsonl" --out "$DIR/$NAME-report"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for b in 1 5; do
  target/release/unmask eval --model "$MODEL" --set "${SET:-data/tasks/heldout-small.jsonl}" \
    --cache bicache-dual --batch "$b" --gen-length 32 --block-length 4 --steps 16 \
    --out "$tmp/b$b.json" >/dev/null
done
python3 tools/eval_agreement.py --by batch "$tmp/b1.json" "$tmp/b5.json" \
  --json "$DIR/$NAME-heldout.json" --markdown "$DIR/$NAME-heldout.md"
