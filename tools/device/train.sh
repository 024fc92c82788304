#!/usr/bin/env bash
# Trains the bundled model on a machine with an NVIDIA GPU and PyTorch, exports it and
# checks that it answers, all in one run that fits one device call (under 10 minutes):
#
#   tools/device/train.sh OUT_DIR
#
# Phases (each with a time limit; a failed one is reported and the rest still run):
#   1. tools/train.py on the GPU for TRAIN_MINUTES (default 5); the step count is estimated
#      from the speed of the first steps so the learning-rate schedule ends with the time;
#   2. tools/export.py into a Hugging Face style folder (what models/tiny holds);
#   3. when the unmask binary is there (see lib.sh), `unmask eval` of the exported model on
#      the small held-out set with cache mode none, on whatever adapter wgpu finds;
#   4. tools/py_eval.py (the PyTorch sampler) on the same set, which needs no Vulkan.
#
# OUT_DIR gets: log.txt, train.log, model.tar.gz (the exported folder, to unpack into
# models/), ckpt.pt (weights and optimiser state, to continue with train.py --init),
# eval-unmask.json and eval-torch.json.
#
# Environment:
#   RUN_SCALE=small   a one-minute run on the CPU with a few steps: checks this script
#                     anywhere (the model will not answer).
#   TRAIN_MINUTES     minutes of training (default 5; 1 with RUN_SCALE=small). The phases'
#                     limits add up to TRAIN_MINUTES + 4 minutes at most.
#   TRAIN_ARGS        extra arguments for tools/train.py (they come last, so they win).
#   TORCH_DEVICE      cuda (default when torch sees a GPU) or cpu.
set -uo pipefail

OUT="${1:?usage: tools/device/train.sh OUT_DIR}"
cd "$(dirname "$0")/../.."
SCALE="${RUN_SCALE:-full}"
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
say "unmask device training, scale $SCALE, torch on $TORCH_DEVICE, into $OUT"

WORK=$(mktemp -d)
if [ "$SCALE" = small ]; then
  MINUTES="${TRAIN_MINUTES:-1}"
  # shellcheck disable=SC2206
  ARGS=(--probe-steps 5 --curriculum-steps 20 --bare-steps 10 --valid-items 4 --threads 2)
  SET_ARGS=(--limit 4)
  LIMITS=(120 180 240 120)  # slack for training, export, unmask eval, PyTorch eval on a CPU
else
  MINUTES="${TRAIN_MINUTES:-5}"
  # A GPU step is about 30x a CPU one: the curriculum (small tables, then bare system
  # prompts) is sized for the ten-thousand-odd steps that five minutes give.
  ARGS=(--batch 32 --probe-steps 100 --curriculum-steps 3000 --bare-steps 2000 --valid-items 24 --threads 8)
  SET_ARGS=()
  LIMITS=(60 60 60 60)
fi
# shellcheck disable=SC2206
EXTRA=(${TRAIN_ARGS:-})
LIMIT=$(python3 -c "print(int($MINUTES * 60 + ${LIMITS[0]}))")
phase train "$LIMIT" env PYTHONUNBUFFERED=1 "$PY" tools/train.py --device "$TORCH_DEVICE" --out "$WORK/run" \
  --minutes "$MINUTES" --recall-frac 1 --recall-turns 12 --max-turns 6 --ckpt-minutes 2 "${ARGS[@]}" "${EXTRA[@]}"
cp "$WORK/run/train.log" "$OUT/train.log" 2>/dev/null
cp "$WORK/run/ckpt.pt" "$OUT/ckpt.pt" 2>/dev/null

if [ -f "$WORK/run/ckpt.pt" ]; then
  phase export "${LIMITS[1]}" "$PY" tools/export.py --run "$WORK/run" --out "$WORK/tiny"
  if [ -f "$WORK/tiny/model.safetensors" ]; then
    tar -czf "$OUT/model.tar.gz" -C "$WORK" tiny
    if [ -n "$BIN" ]; then
      phase eval-unmask "${LIMITS[2]}" "$BIN" eval --model "$WORK/tiny" --set data/tasks/heldout-small.jsonl \
        "${SET_ARGS[@]}" --out "$OUT/eval-unmask.json"
    fi
    phase eval-torch "${LIMITS[3]}" "$PY" tools/py_eval.py --model "$WORK/tiny" --set data/tasks/heldout-small.jsonl \
      --sampler torch --out "$OUT/eval-torch.json"
  fi
fi
rm -rf "$WORK"

say "done in $(($(date +%s) - START)) s; failed phases: ${FAILED[*]:-none}"
ls -la "$OUT" >>"$LOG"
[ ${#FAILED[@]} -eq 0 ]
