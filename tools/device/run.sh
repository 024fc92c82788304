#!/usr/bin/env bash
# One run on a Linux machine with an NVIDIA GPU that has PyTorch and CUDA but nothing else:
# parity against the PyTorch references (LLaDA and Dream), the kernel benchmarks at LLaDA-8B's
# shapes and whole requests per cache mode at LLaDA-8B's shape, all written under one folder.
#
#   tools/device/run.sh OUT_DIR
#
# Phases, in order: info; LLaDA parity on tests/fixtures/tiny (f32, f16 weights); Dream
# parity on tests/fixtures/tiny-dream (tools/dream_torch.py: f32 weights with Fast-dLLM's
# block schedule, f16 weights with Dream's own schedule and topk_margin); synthetic LLaDA-8B
# and its logits parity (f16, f32); the kernel and request benchmarks, and the PyTorch
# reference `generate` on the same requests (tools/torch_bench.py); the report; then a
# synthetic Dream-7B of 2 layers (Qwen2 names, full width: hidden 3584, GQA 28/4, vocab
# 152064; 3.1 GB of bf16) and its logits parity (f16, f32). The Dream phases are the ones added
# to the original run; the synthetic Dream parity comes last, so it is what a slow machine
# loses first.
#
# What it needs and brings:
#   * the unmask binary: built with cargo when cargo is there, else $UNMASK_BIN, else
#     target/dist/unmask (make it with `cargo build --profile dist -p unmask-cli` on an
#     x86-64 Linux machine and copy it along);
#   * the Vulkan loader: when `ldconfig -p` has no libvulkan, the .deb files in .gl/ are
#     unpacked (download them with the recipe in tools/device/README.md);
#   * PyTorch for the references (skipped with a message when absent).
#
# Environment:
#   RUN_SCALE=small   tiny shapes everywhere (tests/fixtures/tiny and tiny-dream, scaled
#                     synthetic checkpoints): an end-to-end check of this script on any
#                     adapter, lavapipe included. Default: full (LLaDA-8B / Dream-7B shapes).
#   TORCH_DEVICE      cuda (default when torch sees a GPU) or cpu.
#   BACKEND           wgpu backend for unmask (default vulkan).
#   RUN_BUDGET        seconds the phases may take together, counted from the start (default
#                     520 at full scale, which keeps the run within 9 minutes even when a
#                     phase has to be killed; 3600 at small scale).
#
# OUT_DIR ends up with at most 9 files: log.txt (everything printed), parity.jsonl (one line
# per parity phase, LLaDA and Dream), bench-kernels.jsonl, bench-requests.jsonl (the
# runtime's cache modes and the `pytorch-reference` rows), report.md (with the fastest mode
# over the PyTorch reference), kernels.svg, requests.svg, kernel-choices.json (the kernels
# `auto` measured per shape class on this GPU, with each candidate's time). Each phase has its own time limit (LIMITS below) and gets at most
# what is left of RUN_BUDGET (bench-requests leaves 20 s of it to the report), so the whole
# run stays under 9 minutes; once the budget is spent, the remaining phases get 1 s each and
# report running out of time. A phase that fails or runs out of time is reported and the
# next one still runs. Exit status: 0 when every phase passed.
set -uo pipefail

OUT="${1:?usage: tools/device/run.sh OUT_DIR}"
cd "$(dirname "$0")/../.."
SCALE="${RUN_SCALE:-full}"
BACKEND="${BACKEND:-vulkan}"
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
say "unmask device run, scale $SCALE, into $OUT"
[ -n "$BIN" ] || exit 2

# LIMITS: parity-tiny (each), synth, parity-synth (each), bench-kernels, bench-requests,
# parity-tiny-dream (each), synth-dream, parity-synth-dream (each), torch-requests
if [ "$SCALE" = small ]; then
  SYNTH_CONFIG=tiny
  DREAM_SYNTH=(--config tiny-dream)
  KERNEL_ARGS=(--config tiny --rows 8,96 --kv-lens 96)
  REQ_ARGS=(--gen-length 32 --steps 16 --block-length 8 --groups 1 --per-group 2 --prefix-tokens 48 --user-tokens 16)
  LIMITS=(60 60 120 120 240 60 30 120 120)
  BUDGET="${RUN_BUDGET:-3600}"
else
  SYNTH_CONFIG=llada-8b
  DREAM_SYNTH=(--config dream-7b --layers 2)
  # rows: a 32-token block (dual cache) and a whole 1024 + 64 + 256 request
  KERNEL_ARGS=(--config llada-8b --rows 32,1344 --kv-lens 1344)
  REQ_ARGS=(--gen-length 256 --steps 128 --block-length 32 --groups 1 --per-group 2 --prefix-tokens 1024 --user-tokens 64)
  LIMITS=(60 90 150 90 200 45 45 75 70)
  BUDGET="${RUN_BUDGET:-520}"
fi

# left N [KEEP]: N, or the seconds left of BUDGET (less KEEP, kept for later phases) when
# fewer; at least 1, so that a phase past the budget reports running out of time instead of
# starting without a limit
left() {
  local rest=$((BUDGET - ($(date +%s) - START) - ${2:-0}))
  [ "$rest" -lt 1 ] && rest=1
  echo $(($1 < rest ? $1 : rest))
}

# The measured kernel choices of this run, kept with its results.
export UNMASK_TUNE_FILE="$OUT/kernel-choices.json"

phase info "$(left 30)" "$BIN" info --model tests/fixtures/tiny --backend "$BACKEND"

# --- parity against PyTorch ---------------------------------------------------------------
for dtype in f32 f16; do
  phase "parity-tiny-$dtype" "$(left "${LIMITS[0]}")" "$PY" tools/parity.py --against torch --device "$TORCH_DEVICE" \
    --ref-dtype f32 --dtype "$dtype" --backend "$BACKEND" --model tests/fixtures/tiny --unmask "$BIN" \
    --json "$OUT/parity-tiny-$dtype.json"
done
# The cooperative-matrix (tensor-core) matmul forced through the whole forward; `unmask info`
# above says whether this GPU has cooperative matrices (without them it runs `gemm`). Its
# inputs are rounded to f16, so its logits are held to coop's 1e-2 of the largest (Mesa 26
# lavapipe measures 2.7e-3 against the f32 goldens, every generation equal).
phase parity-tiny-coop "$(left "${LIMITS[0]}")" "$PY" tools/parity.py --against torch --device "$TORCH_DEVICE" \
  --ref-dtype f32 --dtype f16 --matmul coop --rtol 1e-2 --backend "$BACKEND" --model tests/fixtures/tiny \
  --unmask "$BIN" --json "$OUT/parity-tiny-coop.json"
# Dream (tools/dream_torch.py): f32 with the default Fast-dLLM blocks (gen 32, block 16,
# maskgit_plus), f16 with Dream's own schedule over the whole canvas (topk_margin)
declare -A DREAM_GEN=([f32]="" [f16]="--block-length 32 --steps 16 --remasking topk_margin")
for dtype in f32 f16; do
  # shellcheck disable=SC2086  # DREAM_GEN holds several flags
  phase "parity-tiny-dream-$dtype" "$(left "${LIMITS[5]}")" "$PY" tools/parity.py --against torch \
    --device "$TORCH_DEVICE" --ref-dtype f32 --dtype "$dtype" --backend "$BACKEND" \
    --model tests/fixtures/tiny-dream --unmask "$BIN" --json "$OUT/parity-tiny-dream-$dtype.json" ${DREAM_GEN[$dtype]}
done
SYNTH=$(mktemp -d)/synth
phase synth "$(left "${LIMITS[1]}")" "$BIN" synth --config "$SYNTH_CONFIG" --seed 0 --dtype bf16 --out "$SYNTH"
for dtype in f16 f32; do
  phase "parity-synth-$SYNTH_CONFIG-$dtype" "$(left "${LIMITS[2]}")" "$PY" tools/parity.py --against torch \
    --device "$TORCH_DEVICE" --ref-dtype f32 --dtype "$dtype" --backend "$BACKEND" --model "$SYNTH" \
    --unmask "$BIN" --json "$OUT/parity-synth-$dtype.json" --no-generate
done

# --- benchmarks ---------------------------------------------------------------------------
phase bench-kernels "$(left "${LIMITS[3]}")" "$BIN" bench --only kernels --backend "$BACKEND" "${KERNEL_ARGS[@]}" \
  --out "$OUT/bench-kernels.jsonl"
phase bench-requests "$(left "${LIMITS[4]}" 90)" "$BIN" bench --only requests --backend "$BACKEND" --model "$SYNTH" \
  "${REQ_ARGS[@]}" --out "$OUT/bench-requests.jsonl"
# the best-placed mode again with the K/V arena and prefix entries in f16 (records say "kv")
phase bench-requests-kv-f16 "$(left 60 110)" "$BIN" bench --only requests --backend "$BACKEND" --model "$SYNTH" \
  "${REQ_ARGS[@]}" --cache bicache-dual --kv f16 --out "$OUT/bench-requests-kv-f16.jsonl"
# the PyTorch reference on the same workload, as rows of the same file (bf16, as it runs)
phase torch-requests "$(left "${LIMITS[8]}" 20)" "$PY" tools/torch_bench.py --model "$SYNTH" \
  --like "$OUT/bench-requests.jsonl" --out "$OUT/bench-requests.jsonl" --device "$TORCH_DEVICE" \
  --dtype bf16 --max-requests 2
rm -rf "$(dirname "$SYNTH")"

[ -f "$OUT/bench-requests-kv-f16.jsonl" ] && cat "$OUT/bench-requests-kv-f16.jsonl" >> "$OUT/bench-requests.jsonl"
phase report "$(left 30)" "$BIN" bench-report "$OUT/bench-kernels.jsonl" "$OUT/bench-requests.jsonl" --out "$OUT/report"
for f in report.md kernels.svg requests.svg; do
  [ -f "$OUT/report/$f" ] && mv "$OUT/report/$f" "$OUT/$f"
done
rm -rf "$OUT/report"

# --- synthetic Dream: logits parity at Dream-7B's width (last: the first to lose time) -----
DREAM_DIR=$(mktemp -d)/synth-dream
DREAM_NAME="${DREAM_SYNTH[1]}"
phase "synth-$DREAM_NAME" "$(left "${LIMITS[6]}")" "$BIN" synth "${DREAM_SYNTH[@]}" --seed 0 --dtype bf16 \
  --out "$DREAM_DIR"
for dtype in f16 f32; do
  phase "parity-synth-$DREAM_NAME-$dtype" "$(left "${LIMITS[7]}")" "$PY" tools/parity.py --against torch \
    --device "$TORCH_DEVICE" --ref-dtype f32 --dtype "$dtype" --backend "$BACKEND" --model "$DREAM_DIR" \
    --unmask "$BIN" --json "$OUT/parity-synth-dream-$dtype.json" --no-generate
done
rm -rf "$(dirname "$DREAM_DIR")"

# one line per parity phase, in the order they ran
: >"$OUT/parity.jsonl"
for name in tiny-f32 tiny-f16 tiny-coop tiny-dream-f32 tiny-dream-f16 synth-f16 synth-f32 synth-dream-f16 synth-dream-f32; do
  f="$OUT/parity-$name.json"
  [ -f "$f" ] && { tr -d '\n' <"$f"; echo; } >>"$OUT/parity.jsonl" && rm -f "$f"
done

say "done in $(($(date +%s) - START)) s; failed phases: ${FAILED[*]:-none}"
ls -la "$OUT" >>"$LOG"
[ ${#FAILED[@]} -eq 0 ]
