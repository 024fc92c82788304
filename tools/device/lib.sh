# Shared by the tools/device scripts: logging, time-limited phases, the Vulkan loader and
# the unmask binary. Source it after setting OUT (the output folder); it sets LOG, START,
# FAILED, BIN and PY, and defines `say` and `phase`.

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/log.txt"
: >"$LOG"
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
if [ -x "$BIN" ]; then
  BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
  say "binary: $BIN ($("$BIN" --version 2>/dev/null))"
else
  say "no unmask binary at $BIN (no cargo here): build it with cargo build --profile dist -p unmask-cli and copy it"
  BIN=""
fi

# --- Python and PyTorch's device ----------------------------------------------------------
PY=python3
[ -x tools/.venv/bin/python ] && ! python3 -c 'import torch' 2>/dev/null && PY=tools/.venv/bin/python
if [ -z "${TORCH_DEVICE:-}" ]; then
  if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    TORCH_DEVICE=cuda
  else
    TORCH_DEVICE=cpu
  fi
fi
