#!/usr/bin/env bash
# Builds llama.cpp's diffusion example (`llama-diffusion-cli`) with its Vulkan and CPU
# backends, for tools/llama_cpp_compare.py.
#
#   tools/build_llama_cpp.sh [DIR]        # default DIR: target/llama.cpp (from the repo root)
#   -> DIR/src/build/bin/llama-diffusion-cli
#
# The source is the llama.cpp that llama-cpp-python's source package vendors (PyPI, pinned
# below), so a machine that reaches PyPI but not GitHub can build it; LLAMA_CPP_SRC=PATH
# builds a checkout of your own instead, in PATH/build (patched as below when needed). Needs cmake, a C++17 compiler, glslc and the
# Vulkan headers (Debian: cmake g++ glslc libvulkan-dev); VULKAN=OFF builds the CPU
# backend alone.
#
# Vulkan headers older than 1.3.2xx (Debian 12's 1.3.239) lack VK_EXT_layer_settings,
# which ggml-vulkan's instance set-up names for its validation-layer option
# (GGML_VULKAN_VALIDATE, off in release builds). With such headers that one block is
# dropped from the copy built here; nothing else changes.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36 # llama-cpp-python; its vendored llama.cpp is ggml 0.25.3
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
DIR=${1:-target/llama.cpp}
VULKAN=${VULKAN:-ON}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

if [[ -n "${LLAMA_CPP_SRC:-}" ]]; then
  SRC=$(cd "$LLAMA_CPP_SRC" && pwd)
else
  SRC="$DIR/src"
  if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    echo "fetching llama-cpp-python $VERSION's source package from PyPI"
    # The package index's simple page names the file's address.
    url=$(curl -fsSL "https://pypi.org/simple/llama-cpp-python/" |
      grep -o "href=\"[^\"]*llama_cpp_python-$VERSION.tar.gz" | head -1 | cut -d'"' -f2)
    [[ -n "$url" ]] || { echo "no llama_cpp_python-$VERSION.tar.gz on the package index" >&2; exit 1; }
    curl -fsSL -o "$DIR/sdist.tar.gz" "$url"
    echo "$SHA256  $DIR/sdist.tar.gz" | sha256sum -c --quiet
    rm -rf "$SRC" "$DIR/unpacked"
    mkdir -p "$DIR/unpacked"
    tar xzf "$DIR/sdist.tar.gz" -C "$DIR/unpacked"
    mv "$DIR/unpacked/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
    rm -f "$SRC/.git" # a submodule's pointer into a repository that is not here
    rm -rf "$DIR/unpacked" "$DIR/sdist.tar.gz"
  fi
fi

if [[ "$VULKAN" == ON ]] && ! grep -q VK_EXT_layer_settings /usr/include/vulkan/vulkan_core.h 2>/dev/null; then
  python3 - "$SRC/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'EOF'
import sys
path = sys.argv[1]
text = open(path, encoding="utf-8").read()
if "vk::LayerSettingEXT" not in text:
    sys.exit(0)  # dropped by an earlier run
start = text.find("    VkBool32 enable_best_practice = layer_settings;")
call = "layers, extensions, &layer_setting_info);"
end = text.find(call, start)
if start < 0 or end < 0:
    sys.exit(f"{path}: the layer-settings block to drop for old Vulkan headers was not found")
head = text[:start]
line_start = text.rfind("\n", start, end) + 1
tail = text[line_start:end] + "layers, extensions);" + text[end + len(call):]
open(path, "w", encoding="utf-8").write(head + tail)
print(f"{path}: dropped the VK_EXT_layer_settings block (Vulkan headers without it)")
EOF
fi

cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN="$VULKAN" \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=OFF > "$DIR/cmake.log"
cmake --build "$SRC/build" --target llama-diffusion-cli -j "$(nproc)"
echo "built $SRC/build/bin/llama-diffusion-cli"
