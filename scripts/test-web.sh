#!/usr/bin/env bash
# The browser tests, in headless Chromium with WebGPU (SwiftShader on a machine without a
# GPU). Installs what is missing (Chromium and chromedriver, the wasm32 target,
# wasm-bindgen-cli at the Cargo.lock version), builds the demo (scripts/build-web.sh), then:
#   1. lints the browser-only code of crates/unmask-wasm (built for wasm32 alone);
#   2. wasm-bindgen tests of crates/unmask-wasm: the tiny fixture, streamed into the page,
#      generates exactly the native goldens;
#   3. the page test: the demo page answers a held-out question exactly as
#      `unmask generate` does, and a screenshot is saved to target/web-demo.png.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
need=()
dpkg -s chromium >/dev/null 2>&1 || need+=(chromium)
dpkg -s chromium-driver >/dev/null 2>&1 || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
export CHROMEDRIVER="${CHROMEDRIVER:-/usr/bin/chromedriver}"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"

echo "== browser: build the demo page"
scripts/build-web.sh

echo "== browser: lints of the wasm32-only code"
cargo clippy --quiet --target wasm32-unknown-unknown -p unmask-wasm --all-targets -- -D warnings

echo "== browser: wasm-bindgen tests (headless Chromium, WebGPU)"
CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
  WASM_BINDGEN_TEST_WEBDRIVER_JSON="$PWD/crates/unmask-wasm/webdriver.json" \
  WASM_BINDGEN_TEST_TIMEOUT=600 \
  cargo test --target wasm32-unknown-unknown -p unmask-wasm --test browser

echo "== browser: the demo page against \`unmask generate\`"
# scripts/test.sh passes the binary its tests built; alone, this script builds one.
BIN="${UNMASK_BIN:-}"
if [ -z "$BIN" ]; then
  cargo build --quiet -p unmask-cli
  BIN=target/debug/unmask
fi
python3 crates/unmask-wasm/tests/page.py --unmask "$BIN" \
  --screenshot target/web-demo.png
