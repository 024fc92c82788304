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
# bench-kernels.jsonl, bench-requests.jsonl, report.md, kernels.png, requests.png.
# Each phase has a time limit so the whole run stays under 9 minutes; a phase that fails
# or runs out of time is reported and the next one still runs. Exit status: 0 when every
# phase passed.
set -uo pipefail

OUT="${1:?usage: tools/device/run.sh OUT_DIR}"
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/log.txt"
: >"$LOG"
SCALE="${RUN_SCALE:-full}"
BACKEND="${BACKEND:-vulkan}"
START=$(date +%s)
FAILED=()

say() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$LOG" >&2; }

# phase NAME SECONDS COMMAND...: runs the command with a time limit, its output into the log.
phase() {
  local name="$1" limit="$2"
  shift 2
  say "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then
    say "   $name: ok"
  else
    [ $rc -eq 124 ] && say "   $name: out of time" || say "   $name: failed (exit $rc)"
    FAILED+=("$name")
  fi
  return 0
}

say "unmask device run, scale $SCALE, into $OUT"
{
  echo "== machine"
  uname -a
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  python3 -c 'import sys; print("python", sys.version.split()[0])' 2>/dev/null
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>/dev/null \
    || echo "torch: not installed"
} >>"$LOG" 2>&1

# --- the Vulkan loader and the NVIDIA ICD --------------------------------------------------
if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan.so.1'; then
  if compgen -G ".gl/*.deb" >/dev/null; then
    say "no Vulkan loader installed: unpacking .gl/*.deb"
    for f in .gl/*.deb; do dpkg -x "$f" / >>"$LOG" 2>&1; done
    ldconfig
  else
    say "no Vulkan loader and no .gl/*.deb to unpack: wgpu may find no adapter"
  fi
fi
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] \
  && [ ! -e /usr/share/vulkan/icd.d/nvidia_icd.json ] && [ ! -e /etc/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  say "using the NVIDIA Vulkan ICD at $VK_DRIVER_FILES"
fi
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"

# --- the binary ---------------------------------------------------------------------------
if [ -n "${UNMASK_BIN:-}" ]; then
  BIN="$UNMASK_BIN"
elif command -v cargo >/dev/null 2>&1; then
  phase build 400 cargo build --profile dist -p unmask-cli --quiet
  BIN=target/dist/unmask
else
  BIN=target/dist/unmask
fi
if [ ! -x "$BIN" ]; then
  say "no unmask binary at $BIN (no cargo here): build it with cargo build --profile dist -p unmask-cli and copy it"
  exit 2
fi
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
say "binary: $BIN ($("$BIN" --version 2>/dev/null))"

# --- the reference's device ---------------------------------------------------------------
if [ -z "${TORCH_DEVICE:-}" ]; then
  if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    TORCH_DEVICE=cuda
  else
    TORCH_DEVICE=cpu
  fi
fi
PY=python3
[ -x tools/.venv/bin/python ] && ! python3 -c 'import torch' 2>/dev/null && PY=tools/.venv/bin/python

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
for f in report.md kernels.png requests.png; do
  [ -f "$OUT/report/$f" ] && mv "$OUT/report/$f" "$OUT/$f"
done
rm -rf "$OUT/report"

say "done in $(($(date +%s) - START)) s; failed phases: ${FAILED[*]:-none}"
ls -la "$OUT" >>"$LOG"
[ ${#FAILED[@]} -eq 0 ]
