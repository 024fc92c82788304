#!/usr/bin/env bash
# Puts Mesa 26's lavapipe, which has cooperative matrices (VK_KHR_cooperative_matrix,
# 8 x 8 x 8 f16 -> f32 on a CPU with 256-bit vectors), beside the system's Mesa without
# installing it, and prints the path of a runner that starts a program on it:
#
#   runner=$(scripts/lavapipe-coop.sh)
#   "$runner" target/debug/unmask info
#   CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$runner" cargo test --test all -- kernels_matmul
#
# The packages come from Debian trixie-backports with every library they load, glibc
# included, extracted under target/mesa-coop/root; the runner starts the program through that
# glibc's loader, so a Debian 12 machine runs it too. Idempotent: a second call only prints.
# The `coop` matmul kernel runs for real there, which is how it is tested without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="$PWD/target/mesa-coop"
root="$dir/root"
runner="$dir/run"
if [ -x "$runner" ]; then
  echo "$runner"
  exit 0
fi
arch=$(dpkg --print-architecture)
triplet=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
rm -rf "$dir"
mkdir -p "$dir/apt/lists/partial" "$dir/apt/archives/partial" "$dir/debs" "$root"
cat >"$dir/apt/sources.list" <<'EOF'
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie-backports main
EOF
# A private apt state: nothing of the machine's own package lists or status is touched.
apt_opts=(
  -o "Dir::Etc::sourcelist=$dir/apt/sources.list" -o Dir::Etc::sourceparts=/nonexistent
  -o "Dir::State=$dir/apt" -o "Dir::Cache=$dir/apt" -o Dir::State::status=/dev/null
  -o APT::Default-Release=trixie-backports -o "APT::Architecture=$arch"
  -o Debug::NoLocking=1
)
echo "lavapipe-coop: fetching Mesa from trixie-backports into $root" >&2
apt-get "${apt_opts[@]}" -qq update >&2
mapfile -t pkgs < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
  --no-conflicts --no-breaks --no-replaces --no-enhances mesa-vulkan-drivers libvulkan1 |
  grep -v '^ ' | grep -v '<' | sort -u)
(cd "$dir/debs" && apt-get "${apt_opts[@]}" -qq download "${pkgs[@]}" 2>&1 |
  grep -v 'unsandboxed' >&2 || true)
for deb in "$dir"/debs/*.deb; do
  dpkg-deb -x "$deb" "$root"
done
lib="$root/usr/lib/$triplet"
[ -f "$lib/libvulkan_lvp.so" ] || { echo "lavapipe-coop: no libvulkan_lvp.so in $lib" >&2; exit 1; }
loader=$(ls "$lib"/ld-linux*.so.* | head -n 1)
sed "s#\"libvulkan_lvp.so\"#\"$lib/libvulkan_lvp.so\"#" \
  "$root/usr/share/vulkan/icd.d/lvp_icd.json" >"$dir/lvp_icd.json"
cat >"$runner.tmp" <<EOF
#!/bin/sh
# Starts a program on Mesa $(dpkg-deb -f "$dir"/debs/mesa-vulkan-drivers_*.deb Version) lavapipe (scripts/lavapipe-coop.sh).
export VK_ICD_FILENAMES="$dir/lvp_icd.json"
export XDG_RUNTIME_DIR="\${XDG_RUNTIME_DIR:-$dir/xdg}"
mkdir -p "\$XDG_RUNTIME_DIR" && chmod 700 "\$XDG_RUNTIME_DIR"
exec "$loader" --library-path "$lib" "\$@"
EOF
chmod +x "$runner.tmp"
mv "$runner.tmp" "$runner"
rm -rf "$dir/debs" "$dir/apt"
echo "$runner"
