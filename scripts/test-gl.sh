#!/usr/bin/env bash
# Runs the integration tests on wgpu's OpenGL backend: Mesa llvmpipe's OpenGL 4.5 through
# EGL (no window), the backend of machines without Vulkan, Metal or DX12 drivers. GL has no
# subgroups and, here, no shader-f16, so the kernels' portable paths run (packed f16
# weights, the subgroup-free reductions). It fails on any test that fails there.
#
#   scripts/test-gl.sh            a forward and a generation of every family, the caches
#   scripts/test-gl.sh FILTER...  the tests of tests/all these filters name ('' for all of
#                                 them: far longer, each kernel test compiling its many
#                                 variants through GLSL on the CPU)
#
# One test at a time: wgpu serialises a GL device behind a context lock that panics after
# 6 s, and llvmpipe compiles some shaders for longer than that while another test holds the
# device (with the tests in parallel, 9 of 216 died so). A program that drives one device
# from one thread at a time, as the engine and the server do, never waits on the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

# EGL and Mesa's GL driver, where the machine lacks them.
if command -v dpkg >/dev/null; then
  need=()
  for pkg in libegl1 libegl-mesa0 libgl1-mesa-dri; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if [ ${#need[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi

# First LLaDA's forward in f32 weights, which also shows that wgpu found a GL adapter here:
# the test binary prints the adapter it got ("[gpu] ... backend=Gl"), and a machine without
# one must fail, not test another backend.
status=0
WGPU_BACKEND=gl cargo test --workspace --test all --quiet -- --exact --nocapture \
  model_parity::logits_match_reference_with_f32_weights >target/test-gl.log 2>&1 || status=$?
grep '^\[gpu\]' target/test-gl.log || true
grep -q '^\[gpu\].*backend=Gl' target/test-gl.log || {
  echo "test-gl: no GL adapter (see target/test-gl.log)"
  exit 1
}
if [ "$status" != 0 ]; then
  tail -n 40 target/test-gl.log
  exit "$status"
fi
if [ $# -gt 0 ]; then
  WGPU_BACKEND=gl cargo test --workspace --test all --quiet -- --test-threads=1 "$@"
  exit
fi
# LLaDA's forward in f16 weights and its generation against the reference's goldens,
# Dream's logits and generation, DiffusionGemma's every pass and generation, BiCache,
# ACache and dLLM-Cache against their references.
WGPU_BACKEND=gl cargo test --workspace --test all --quiet -- --test-threads=1 --exact \
  model_parity::logits_match_reference_with_f16_weights \
  generate_goldens::generation_matches_reference_goldens \
  dream::dream_logits_match_the_reference \
  dream::dream_generation_through_the_engine_matches_the_goldens \
  dgemma::logits_match_the_reference_in_every_pass \
  dgemma_generate::generations_replay_the_reference_step_by_step \
  cache_modes::bicache_refreshing_every_step_from_depth_0_equals_none \
  acache::anchors_and_tokens_match_the_numpy_reference \
  dllm_cache::picks_and_tokens_match_the_numpy_reference
