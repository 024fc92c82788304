#!/usr/bin/env bash
# One run on a Linux machine with an NVIDIA GPU that has PyTorch and CUDA but nothing else:
# parity against the PyTorch reference, the kernel benchmarks at LLaDA-8B's shapes and whole
# requests per cache mode at LLaDA-8B's shape, all written under one folder.
#
#   tools/device/run.sh OUT_DIR
#
# What it needs and brings:
#   * the unmask binary: built with cargo when cargo is there, else $UNMASK_BIN, else
#     target/dist/unmask (make it with `cargo build --profile dist -p unmask-cli` on an
#     x86-64 Linux machine and copy it along);
#   * the Vulkan loader: when `ldconfig -p` has no libvulkan, the .deb files in .gl/ are
#     unpacked (download them with the recipe in tools/device/README.md);
#   * PyTorch for the reference (skipped with a message when absent).
#
# Environment:
#   RUN_SCALE=small   tiny shapes everywhere (tests/fixtures/tiny, a scaled synthetic
#                     checkpoint): an end-to-end check of this script on any adapter,
#                     lavapipe included. Default: full (LLaDA-8B shapes).
#   TORCH_DEVICE      cuda (default when torch sees a GPU) or cpu.
#   BACKEND           wgpu backend for unmask (default vulkan).
#
# OUT_DIR ends up with at most 8 files: log.txt (everything printed), parity.jsonl,
# bench-kernels.jsonl, bench-requests.jsonl, report.md, kernels.svg, requests.svg.
# Each phase has a time limit so the whole run stays under 9 minutes; a phase that fails
# or runs out of time is reported and the next one still runs. Exit status: 0 when every
# phase passed.
set -uo pipefail

OUT="${1:?usage: tools/device/run.sh OUT_DIR}"
cd "$(dirname "$0")/../.."
SCALE="${RUN_SCALE:-full}"
BACKEND="${BACKEND:-vulkan}"
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
say "unmask device run, scale $SCALE, into $OUT"
[ -n "$BIN" ] || exit 2

if [ "$SCALE" = small ]; then
  SYNTH_CONFIG=tiny
  KERNEL_ARGS=(--config tiny --rows 8,96 --kv-lens 96)
  REQ_ARGS=(--gen-length 32 --steps 16 --block-length 8 --groups 1 --per-group 2 --prefix-tokens 48 --user-tokens 16)
  LIMITS=(60 60 120 120 240)
else
  SYNTH_CONFIG=llada-8b
  # rows: a 32-token block (dual cache) and a whole 1024 + 64 + 256 request
  KERNEL_ARGS=(--config llada-8b --rows 32,1344 --kv-lens 1344)
  REQ_ARGS=(--gen-length 256 --steps 128 --block-length 32 --groups 1 --per-group 2 --prefix-tokens 1024 --user-tokens 64)
  LIMITS=(60 90 150 90 200)
fi

phase info 60 "$BIN" info --model tests/fixtures/tiny --backend "$BACKEND"

# --- parity against PyTorch ---------------------------------------------------------------
: >"$OUT/parity.jsonl"
for dtype in f32 f16; do
  phase "parity-tiny-$dtype" "${LIMITS[0]}" "$PY" tools/parity.py --against torch --device "$TORCH_DEVICE" \
    --ref-dtype f32 --dtype "$dtype" --backend "$BACKEND" --model tests/fixtures/tiny --unmask "$BIN" \
    --json "$OUT/parity-tiny-$dtype.json"
done
SYNTH=$(mktemp -d)/synth
phase synth "${LIMITS[1]}" "$BIN" synth --config "$SYNTH_CONFIG" --seed 0 --dtype bf16 --out "$SYNTH"
for dtype in f16 f32; do
  phase "parity-synth-$SYNTH_CONFIG-$dtype" "${LIMITS[2]}" "$PY" tools/parity.py --against torch \
    --device "$TORCH_DEVICE" --ref-dtype f32 --dtype "$dtype" --backend "$BACKEND" --model "$SYNTH" \
    --unmask "$BIN" --json "$OUT/parity-synth-$dtype.json" --no-generate
done
for f in "$OUT"/parity-*.json; do
  [ -f "$f" ] && { tr -d '\n' <"$f"; echo; } >>"$OUT/parity.jsonl" && rm -f "$f"
done

# --- benchmarks ---------------------------------------------------------------------------
phase bench-kernels "${LIMITS[3]}" "$BIN" bench --only kernels --backend "$BACKEND" "${KERNEL_ARGS[@]}" \
  --out "$OUT/bench-kernels.jsonl"
phase bench-requests "${LIMITS[4]}" "$BIN" bench --only requests --backend "$BACKEND" --model "$SYNTH" \
  "${REQ_ARGS[@]}" --out "$OUT/bench-requests.jsonl"
rm -rf "$(dirname "$SYNTH")"

phase report 30 "$BIN" bench-report "$OUT/bench-kernels.jsonl" "$OUT/bench-requests.jsonl" --out "$OUT/report"
for f in report.md kernels.svg requests.svg; do
  [ -f "$OUT/report/$f" ] && mv "$OUT/report/$f" "$OUT/$f"
done
rm -rf "$OUT/report"

say "done in $(($(date +%s) - START)) s; failed phases: ${FAILED[*]:-none}"
ls -la "$OUT" >>"$LOG"
[ ${#FAILED[@]} -eq 0 ]
