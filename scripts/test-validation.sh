#!/usr/bin/env bash
# Runs the integration tests (tests/all: kernels, forward passes, BiCache, the caches, the
# step program) and the server tests (scripts/test-server.sh) under the Khronos Vulkan
# validation layers with synchronization validation, and fails on any message they report:
# missing barriers, hazards between dispatches, missing usage flags — what lavapipe forgives
# and a real driver may not. First it shows the check fails on two mistakes made on purpose
# (tests/all/validation.rs: two writes with no barrier between them, a copy out of a buffer
# without COPY_SRC).
#
#   scripts/test-validation.sh [UNMASK_BINARY]     (default target/debug/unmask)
#
# The layers' messages of each step are kept in target/validation/<step>.log.
#
# How the messages are caught: the layers' own log, not wgpu's. With VK_INSTANCE_LAYERS the
# loader puts the layers under every Vulkan instance of the step, whatever the build (wgpu
# asks for them only in debug builds) and whichever process (the test binary, the servers
# the Python harness starts). A settings file (VK_LAYER_SETTINGS_PATH; the Debian 12 layers,
# 1.3.239, read the log file's name from it, not from the environment) turns on
# synchronization validation and logs errors and warnings to a file. Each instance opens
# that file for writing and truncates it, so it is a FIFO: one reader appends everything
# written to it to the step's log. Any line the layers log fails the check, unless its
# message ID is in KNOWN_BENIGN below.
#
# WGPU_DEBUG=0: wgpu's debug flag (on in debug builds) has naga write the WGSL source into
# each SPIR-V module (OpSource WGSL, source language 10). The SPIR-V validator inside the
# 1.3.239 layers predates that value, so it fails every module with
# UNASSIGNED-CoreValidation-Shader-InconsistentSpirv ("Invalid source language operand:
# 10") and the layers then skip their checks of the shader. Without the debug info they
# check every module in full. (The flag is read by unmask-gpu's context; see context.rs.)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
BIN=${1:-target/debug/unmask}
[ -x "$BIN" ] || { echo "no binary at $BIN (cargo build -p unmask-cli)"; exit 2; }

# Message IDs the check lets pass, each with the reason. None: the suite runs clean.
KNOWN_BENIGN=()

# The layers, from Debian's package where there is one (elsewhere: the Vulkan SDK's).
if command -v dpkg >/dev/null && ! dpkg -s vulkan-validationlayers >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq vulkan-validationlayers >/dev/null
fi

LOGS=target/validation
mkdir -p "$LOGS"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fifo=$work/messages
printf '%s\n' \
  "khronos_validation.enables = VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT" \
  "khronos_validation.report_flags = error,warn" \
  "khronos_validation.debug_action = VK_DBG_LAYER_ACTION_LOG_MSG" \
  "khronos_validation.log_filename = $fifo" \
  >"$work/vk_layer_settings.txt"
END_MARK="@@ end of the validation messages @@"

# under_layers LOG COMMAND...: runs COMMAND under the layers, their messages into LOG.
under_layers() {
  local log=$1 rc=0 reader
  shift
  rm -f "$fifo"
  mkfifo "$fifo"
  # Opened read-write, so the reader holds a writer itself and never sees end-of-file
  # between the step's processes; it stops at the mark written after the step.
  sed -u -n "/^$END_MARK\$/q; p" 0<>"$fifo" >"$log" &
  reader=$!
  VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation VK_LAYER_SETTINGS_PATH="$work" WGPU_DEBUG=0 \
    "$@" || rc=$?
  echo "$END_MARK" >"$fifo"
  wait "$reader"
  return "$rc"
}

# reported LOG: the ID of each message in LOG that is not known to be benign, one a line.
# A message starts at an unindented line, "<ID>(<SEVERITY> / <TYPE>): msgNum: ...", and its
# objects follow indented; an unindented line of any other form counts too.
reported() {
  local ids benign
  ids=$(grep -v -e '^[[:space:]]' -e '^$' "$1" | sed -E 's/^([^ (]+)\(.*/\1/') || true
  for benign in "${KNOWN_BENIGN[@]}"; do
    ids=$(grep -v -x -F -e "$benign" <<<"$ids") || true
  done
  [ -z "$ids" ] || echo "$ids"
}

# check STEP LOG: passes when the layers reported nothing in LOG; else prints the messages.
check() {
  local ids
  ids=$(reported "$2")
  if [ -n "$ids" ]; then
    echo "the Vulkan validation layers reported, in $1 ($2):"
    sort <<<"$ids" | uniq -c
    head -n 200 "$2"
    return 1
  fi
  echo "$1: no validation message"
}

echo "-- the mistakes made on purpose are caught (tests/all/validation.rs)"
under_layers "$LOGS/broken.log" cargo test --workspace --test all --quiet -- --ignored validation::
if check "the broken cases" "$LOGS/broken.log" >"$work/broken.out"; then
  echo "the check let the broken cases pass:"
  cat "$work/broken.out"
  exit 1
fi
for id in SYNC-HAZARD-WRITE-AFTER-WRITE VUID-vkCmdCopyBuffer-srcBuffer-00118; do
  reported "$LOGS/broken.log" | grep -q -x -F -e "$id" || {
    echo "the check missed $id:"
    cat "$work/broken.out"
    exit 1
  }
done
echo "caught: $(reported "$LOGS/broken.log" | sort -u | tr '\n' ' ')"

echo "-- the integration tests (tests/all) under the layers"
under_layers "$LOGS/tests.log" cargo test --workspace --test all --quiet
check "the integration tests" "$LOGS/tests.log"

echo "-- the server tests (scripts/test-server.sh) under the layers"
under_layers "$LOGS/server.log" scripts/test-server.sh "$BIN"
check "the server tests" "$LOGS/server.log"
