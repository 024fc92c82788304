#!/usr/bin/env bash
# Prepares the one call on the device machine (tools/device/README.md), here, where cargo and
# the network are:
#   1. the stripped, optimized binary (cargo's `dist` profile, no debug info) with the commit
#      stamped in (`UNMASK_COMMIT`, which every benchmark record carries);
#   2. the Vulkan loader packages in .gl/ (git ignores it; the device has no network and
#      may have no loader);
#   3. the carry list with its size (the device takes at most 64 MiB of ignored files beside
#      the working tree) and the exact call.
#
#   tools/device/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh

commit="$(git rev-parse --short=12 HEAD)"
git diff --quiet HEAD || commit="$commit-dirty"
echo "== target/dist/unmask at $commit"
UNMASK_COMMIT="$commit" cargo build --profile dist -p unmask-cli --quiet
BIN=target/dist/unmask
"$BIN" info --model tests/fixtures/tiny >/dev/null

echo "== the Vulkan loader packages in .gl/"
need=(libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
mkdir -p .gl
missing=()
for p in "${need[@]}"; do
  compgen -G ".gl/${p}_*.deb" >/dev/null || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  lists="$(mktemp -d)"
  mkdir -p "$lists/partial"
  o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$lists")
  apt-get "${o[@]}" update -qq
  (cd .gl && apt-get "${o[@]}" download "${missing[@]}" >/dev/null)
  rm -rf "$lists"
fi
ls .gl

carry=(target/dist/unmask .gl)
bytes=$(du -cb "${carry[@]}" | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024))
echo "== carry: ${carry[*]}: $((bytes / 1024)) KiB of the $((limit / 1024)) KiB the device takes"
if [ "$bytes" -gt "$limit" ]; then
  echo "over the device's carry limit" >&2
  exit 1
fi
# timeout_s: run.sh ends within 480 s (its 450 s budget, a phase's kill grace, the summary);
# 540 leaves a minute of margin under the 600 s a call may take.
cat <<CALL
== the call (the device tool's run: command, carry, timeout_s)
  command:   UNMASK_BIN=target/dist/unmask tools/device/run.sh "\$OUT"
  carry:     ["target/dist/unmask", ".gl"]
  timeout_s: 540
CALL
