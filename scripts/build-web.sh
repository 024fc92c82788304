#!/usr/bin/env bash
# Builds the browser demo in web/: the wasm module (profile `web`: release, opt-level s)
# with its JavaScript glue in web/pkg/, and links web/models/tiny to the bundled model (and
# web/models/tiny-dgemma to the DiffusionGemma fixture) so the page can fetch them.
# Installs what is missing: the wasm32 target, and wasm-bindgen-cli at exactly the
# wasm-bindgen version in Cargo.lock (the glue must match the crate).
set -euo pipefail
cd "$(dirname "$0")/.."

rustup target list --installed | grep -qx wasm32-unknown-unknown \
  || rustup target add wasm32-unknown-unknown

want=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
have=$(wasm-bindgen --version 2>/dev/null | awk '{ print $2 }' || true)
if [ "$have" != "$want" ]; then
  echo "== installing wasm-bindgen-cli $want (found: ${have:-none})"
  # --locked builds the tool with its published lockfile; when a crate pinned there can no
  # longer be fetched (yanked), resolve its dependencies afresh at the same tool version.
  cargo install wasm-bindgen-cli --version "$want" --locked \
    || cargo install wasm-bindgen-cli --version "$want"
fi

echo "== wasm build (profile web)"
cargo build --quiet --profile web --target wasm32-unknown-unknown -p unmask-wasm
rm -rf web/pkg
wasm-bindgen --target web --no-typescript --out-dir web/pkg \
  target/wasm32-unknown-unknown/web/unmask_wasm.wasm

mkdir -p web/models
ln -sfn ../../models/tiny web/models/tiny
# A DiffusionGemma folder too (the test fixture): index.html?model=tiny-dgemma&weights=f32.
ln -sfn ../../tests/fixtures/tiny-dgemma web/models/tiny-dgemma
echo "built web/ ($(du -h web/pkg/unmask_wasm_bg.wasm | cut -f1) wasm); serve it with scripts/serve-web.sh"
