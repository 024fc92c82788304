#!/usr/bin/env bash
# One run on a Linux machine with an NVIDIA GPU that has PyTorch and CUDA but nothing else:
# kernel benchmarks at LLaDA-8B's shapes, parity against the PyTorch references, whole
# requests per cache mode on a synthetic LLaDA-8B and the PyTorch reference on the same
# requests, written under one folder within 8 minutes.
#
#   tools/device/run.sh OUT_DIR
#
# Order (by value: what a short or failing run loses first comes last):
#   preflight    `unmask info` (20 s): exits at once (status 3, one line on stdout) without an
#                NVIDIA adapter, 16x16x16 f16 cooperative matrices or timestamp queries;
#   kernels      `bench --only kernels` at 8B shapes (rows 32 and 1344), f16 weights, the
#                candidate variants of a GPU (`--kernels`: the tensor-core, gemm and narrow
#                matmuls, the wide and tensor-core attention; the runtime's pick beside
#                them; the tuner's measurements go to kernel-choices.json);
#   tiny parity  LLaDA tests/fixtures/tiny: f32 and f16 on the fixed kernels (--tune off, held
#                to 1e-4), the coop kernel forced (f16, 1e-2); Dream tiny-dream if it fits;
#   requests     synthetic LLaDA-8B, one request per cache mode (quota decoding), `none` last;
#   pytorch      tools/torch_bench.py on the same request (a reserved budget);
#   dgemma       DiffusionGemma-26B-A4B's decoder step kernels (zero weights), f16 and q4,
#                with each format's whole-step estimate;
#   8B parity    logits of the synthetic 8B: f16 as the tuner picks (1e-2), f32 fixed (1e-4);
#   kv-f16       bicache-dual with f16 K/V, merged into bench-requests.jsonl;
#   dream        synthetic Dream-7B of 2 layers, logits parity f16 and f32;
#   report       `bench-report` (a reserved 15 s), then a summary of at most 20 lines.
#
# OUT_DIR holds at most 8 files at every moment (tools/device/lib.sh): log.txt, summary.txt,
# parity.jsonl, bench-kernels.jsonl, bench-requests.jsonl, kernel-choices.json, report.md,
# requests.svg (kernels.svg is not kept: `unmask bench-report` redraws it from the records).
#
# Environment:
#   RUN_SCALE          full (default: 8B shapes), medium (a 47M-parameter LLaDA of 8B's head
#                      size, Dream-7B of 1 layer: for timing this script on a CPU adapter) or
#                      small (tiny shapes: an end-to-end check on any adapter)
#   RUN_BUDGET         seconds for the whole run (default 450 full, 1800 medium, 3600 small)
#   PREFLIGHT_ANY_ADAPTER=1          accept any adapter (default at small and medium scale)
#   PREFLIGHT_COOP=16|any|warn|off   cooperative matrices required: 16x16 fragments (default
#                      full), any fragments, a warning only (default small, medium), no check
#   TORCH_DEVICE       cuda (default when torch sees a GPU) or cpu; PYTHON: the interpreter
#   BACKEND            wgpu backend for unmask (default vulkan); UNMASK_BIN: the binary
# Exit status: 0 when every phase passed, 1 when one did not, 3 when the preflight stopped it.
set -uo pipefail

OUT="${1:?usage: tools/device/run.sh OUT_DIR}"
cd "$(dirname "$0")/../.." || exit 2
SCALE="${RUN_SCALE:-full}"
BACKEND="${BACKEND:-vulkan}"
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
say "unmask device run, scale $SCALE, into $OUT"

REQ_COMMON=(--groups 1 --per-group 1 --decoding quota)
MODES=bicache-dual,fast-dllm-dual,bicache,fast-dllm-prefix,prefix-arm,acache,dllm-cache,none
declare -A LIM
case "$SCALE" in
  small)
    SYNTH_ARGS=(--config tiny)
    DREAM_ARGS=(--config tiny-dream)
    KERNEL_ARGS=(--config tiny --rows "8,96" --kv-lens 96)
    REQ_ARGS=(--gen-length 32 --steps 16 --block-length 8 --prefix-tokens 48 --user-tokens 16)
    DGEMMA_ARGS=(--model tests/fixtures/tiny-dgemma --kv-lens 64 --formats f32,q4)
    LIM=([kernels]=120 [tiny]=60 [synth]=60 [requests]=240 [torch]=120 [dgemma]=120 [psynth16]=120 [psynth32]=120 [kv]=60 [dsynth]=60 [pdream]=120)
    BUDGET="${RUN_BUDGET:-3600}" ;;
  medium)
    # LLaDA's layout at 1/8 of 8B's width: head_dim 128, MLP 3x, vocab 32768, 4 layers
    python3 - "$WORK/medium.json" <<'EOF'
import json, sys
c = json.load(open("tests/fixtures/tiny/config.json"))
c.update(d_model=512, n_heads=4, n_kv_heads=4, mlp_hidden_size=1536, n_layers=4,
         vocab_size=32768, embedding_size=32768, max_sequence_length=2048)
json.dump(c, open(sys.argv[1], "w"), indent=1)
EOF
    SYNTH_ARGS=(--config "$WORK/medium.json")
    DREAM_ARGS=(--config dream-7b --layers 1)
    KERNEL_ARGS=(--config "$WORK/medium.json" --rows "32,352" --kv-lens 352)
    REQ_ARGS=(--gen-length 64 --steps 32 --block-length 32 --prefix-tokens 256 --user-tokens 32)
    DGEMMA_ARGS=(--config diffusiongemma-26b-a4b --rows 8 --kv-lens 256 --formats f16,q4)
    LIM=([kernels]=300 [tiny]=60 [synth]=120 [requests]=600 [torch]=300 [dgemma]=120 [psynth16]=300 [psynth32]=300 [kv]=200 [dsynth]=120 [pdream]=300)
    BUDGET="${RUN_BUDGET:-1800}" ;;
  *)
    SYNTH_ARGS=(--config llada-8b)
    DREAM_ARGS=(--config dream-7b --layers 2)
    # rows: a 32-token block (dual cache) and a whole 1024 + 64 + 256 request
    KERNEL_ARGS=(--config llada-8b --rows "32,1344" --kv-lens 1344)
    REQ_ARGS=(--gen-length 256 --steps 128 --block-length 32 --prefix-tokens 1024 --user-tokens 64)
    # one decoder step of a 256-token canvas after 1024 cached positions, zero weights
    DGEMMA_ARGS=(--config diffusiongemma-26b-a4b --kv-lens 1024 --formats f16,q4)
    LIM=([kernels]=75 [tiny]=25 [synth]=75 [requests]=170 [torch]=90 [dgemma]=30 [psynth16]=75 [psynth32]=100 [kv]=45 [dsynth]=30 [pdream]=45)
    BUDGET="${RUN_BUDGET:-450}" ;;
esac
if [ "$SCALE" != full ]; then
  PREFLIGHT_ANY_ADAPTER="${PREFLIGHT_ANY_ADAPTER:-1}"
  PREFLIGHT_COOP="${PREFLIGHT_COOP:-warn}"
fi
R_REPORT=15                             # kept for the report by every phase
R_TORCH=$((LIM[torch] + R_REPORT))      # kept for the PyTorch row by every phase before it
R_CORE=$((LIM[synth] + LIM[requests] / 2 + R_TORCH)) # kept by tiny Dream ("if it fits")

preflight

# skip NAME WHY: a phase that cannot run here, reported as such
skip() {
  say "   $1: skipped ($2)"
  printf '%s\tskipped\t0\n' "$1" >>"$WORK/phases.tsv"
  printf '%-28s skipped (%s)\n' "$1" "$2" >>"$OUT/summary.txt"
}

# parity NAME LIMIT ARGS...: tools/parity.py against PyTorch; its JSON joins parity.jsonl
# (one line, the phase's name first) as soon as the phase ends.
parity() {
  local name="$1" limit="$2"
  shift 2
  if [ -z "${TORCH_INFO:-}" ]; then skip "$name" "no PyTorch"; return; fi
  rm -f "$WORK/parity.json"
  phase "$name" "$limit" "$PY" tools/parity.py --against torch --device "$TORCH_DEVICE" --ref-dtype f32 \
    --backend "$BACKEND" --unmask "$BIN" --quiet --json "$WORK/parity.json" "$@"
  [ -f "$WORK/parity.json" ] && python3 -c 'import json, sys
d = {"phase": sys.argv[2], **json.load(open(sys.argv[1]))}
open(sys.argv[3], "a").write(json.dumps(d, separators=(",", ":")) + "\n")' \
    "$WORK/parity.json" "$name" "$OUT/parity.jsonl"
}

# --- a: the kernels at the model's shapes (f16 weights, a GPU's candidate variants) ---------
# naive, tiled and tiled-shared are CPU-adapter or baseline kernels; tiled still runs once per
# shape as the reference every record's error is measured against.
CANDIDATES=coop,coop-split,gemm,gemm-f16,narrow,wide,wide-split
phase bench-kernels "$(left "${LIM[kernels]}" "$R_TORCH")" "$BIN" bench --only kernels --backend "$BACKEND" \
  "${KERNEL_ARGS[@]}" --formats f16 --kernels "$CANDIDATES" --out "$OUT/bench-kernels.jsonl"

# --- b: parity on the fixtures ----------------------------------------------------------------
TINY=(--model tests/fixtures/tiny)
parity parity-tiny-f32 "$(left "${LIM[tiny]}" "$R_TORCH")" "${TINY[@]}" --dtype f32 --tune off
# The cooperative-matrix (tensor-core) matmul forced through the whole forward: its inputs are
# rounded to f16, so it is held to coop's 1e-2 of the largest logit (Mesa 26 lavapipe: 2.6e-3),
# and its generation to 90% of the tokens: the rounding reorders near-tied commits of a step.
parity parity-tiny-coop "$(left "${LIM[tiny]}" "$R_TORCH")" "${TINY[@]}" --dtype f16 --matmul coop --rtol 1e-2 \
  --gen-min-agreement 0.9
parity parity-tiny-f16 "$(left "${LIM[tiny]}" "$R_TORCH")" "${TINY[@]}" --dtype f16 --tune off
# Dream: f32 with Fast-dLLM's blocks (gen 32, block 16, maskgit_plus), f16 with Dream's own
# schedule over the canvas (topk_margin)
DREAM=(--model tests/fixtures/tiny-dream --tune off)
parity parity-tiny-dream-f32 "$(left "${LIM[tiny]}" "$R_CORE")" "${DREAM[@]}" --dtype f32
parity parity-tiny-dream-f16 "$(left "${LIM[tiny]}" "$R_CORE")" "${DREAM[@]}" --dtype f16 \
  --block-length 32 --steps 16 --remasking topk_margin

# --- c, d: requests per cache mode, then the PyTorch reference on the same request ---------
SYNTH="$WORK/synth"
phase synth "$(left "${LIM[synth]}" "$R_TORCH")" "$BIN" synth "${SYNTH_ARGS[@]}" --seed 0 --dtype bf16 --out "$SYNTH"
phase bench-requests "$(left "${LIM[requests]}" "$R_TORCH")" "$BIN" bench --only requests --backend "$BACKEND" \
  --model "$SYNTH" "${REQ_ARGS[@]}" "${REQ_COMMON[@]}" --cache "$MODES" --out "$OUT/bench-requests.jsonl"
if [ -z "${TORCH_INFO:-}" ]; then
  skip torch-requests "no PyTorch"
elif ! grep -q '"record": *"request"' "$OUT/bench-requests.jsonl" 2>/dev/null; then
  skip torch-requests "no request record to copy the workload from"
else
  # (bf16, as the official code runs; its rows join the same file)
  phase torch-requests "$(left "${LIM[torch]}" "$R_REPORT")" "$PY" tools/torch_bench.py --model "$SYNTH" \
    --like "$OUT/bench-requests.jsonl" --out "$OUT/bench-requests.jsonl" --device "$TORCH_DEVICE" \
    --dtype bf16 --max-requests 1
fi

# --- DiffusionGemma's decoder step at its published shapes (zero weights: nothing to load or
# write), its records and per-format step estimates merged into bench-kernels.jsonl --------
phase bench-dgemma "$(left "${LIM[dgemma]}" "$R_REPORT")" "$BIN" bench --only kernels --backend "$BACKEND" \
  "${DGEMMA_ARGS[@]}" --out "$WORK/dgemma.jsonl"
[ -f "$WORK/dgemma.jsonl" ] && cat "$WORK/dgemma.jsonl" >>"$OUT/bench-kernels.jsonl"

# --- e: logits parity of the synthetic checkpoint (the canvas only: one load each) ----------
parity parity-synth-f16 "$(left "${LIM[psynth16]}" "$R_REPORT")" --model "$SYNTH" --dtype f16 --rtol 1e-2 \
  --no-generate --canvas-only
parity parity-synth-f32 "$(left "${LIM[psynth32]}" "$R_REPORT")" --model "$SYNTH" --dtype f32 --tune off \
  --no-generate --canvas-only
# the best-placed mode again with the K/V arena and prefix entries in f16 (records say "kv")
phase bench-requests-kv-f16 "$(left "${LIM[kv]}" "$R_REPORT")" "$BIN" bench --only requests --backend "$BACKEND" \
  --model "$SYNTH" "${REQ_ARGS[@]}" "${REQ_COMMON[@]}" --cache bicache-dual --kv f16 --out "$WORK/kv.jsonl"
[ -f "$WORK/kv.jsonl" ] && cat "$WORK/kv.jsonl" >>"$OUT/bench-requests.jsonl"
rm -rf "$SYNTH"

# --- the synthetic Dream (last: the first to lose time) -------------------------------------
DSYNTH="$WORK/synth-dream"
phase synth-dream "$(left "${LIM[dsynth]}" "$R_REPORT")" "$BIN" synth "${DREAM_ARGS[@]}" --seed 0 --dtype bf16 \
  --out "$DSYNTH"
for dtype in f16 f32; do
  parity "parity-synth-dream-$dtype" "$(left "${LIM[pdream]}" "$R_REPORT")" --model "$DSYNTH" --dtype "$dtype" \
    --tune off --no-generate --canvas-only
done
rm -rf "$DSYNTH"

# --- the report -----------------------------------------------------------------------------
reports=()
for f in bench-kernels.jsonl bench-requests.jsonl; do [ -s "$OUT/$f" ] && reports+=("$OUT/$f"); done
if [ ${#reports[@]} -gt 0 ]; then
  phase report "$(left 30)" "$BIN" bench-report "${reports[@]}" --out "$WORK/report"
  for f in report.md requests.svg; do [ -f "$WORK/report/$f" ] && mv "$WORK/report/$f" "$OUT/$f"; done
else
  skip report "no benchmark records"
fi

say "done in $(($(date +%s) - START)) s; failed phases: ${FAILED[*]:-none}"
summary
rm -rf "$WORK"
[ ${#FAILED[@]} -eq 0 ]
