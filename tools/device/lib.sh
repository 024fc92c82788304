# shellcheck shell=bash
# Shared by the tools/device scripts: logging, time-limited phases, the Vulkan loader, the
# unmask binary, Python, the preflight and the closing summary. Source it after setting OUT
# (the output folder); it sets LOG, WORK (scratch outside OUT), START, BIN, PY, TORCH_DEVICE,
# and defines `say`, `phase`, `left`, `preflight` and `summary`.
#
# OUT only ever holds the files the device call brings back (at most 8): log.txt,
# summary.txt, parity.jsonl, bench-kernels.jsonl, bench-requests.jsonl, kernel-choices.json,
# report.md, requests.svg. Everything else (parity JSON per phase, the tuner's file while it is
# written, the report folder) lives in WORK and is merged into OUT as each phase ends.

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/log.txt"
: >"$LOG"
: >"$OUT/summary.txt"
WORK="$(mktemp -d)"
START=$(date +%s)
FAILED=()
OUT_FILES=(log.txt summary.txt parity.jsonl bench-kernels.jsonl bench-requests.jsonl
  kernel-choices.json report.md requests.svg)
# The kernels the tuner measures on this GPU, copied to OUT after every phase.
export UNMASK_TUNE_FILE="$WORK/kernel-choices.json"

say() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$LOG" >&2; }

# left N [KEEP]: N, or the seconds left of BUDGET less KEEP (kept for later phases) when
# fewer; at least 1, so a phase past the budget reports running out of time at once.
left() {
  local rest=$((BUDGET - ($(date +%s) - START) - ${2:-0}))
  [ "$rest" -lt 1 ] && rest=1
  echo $(($1 < rest ? $1 : rest))
}

# phase NAME SECONDS COMMAND...: runs the command with a time limit, its output into the
# log; the outcome goes to summary.txt (and WORK/phases.tsv) as soon as it ends.
phase() {
  local name="$1" limit="$2" t0 rc status
  shift 2
  t0=$(date +%s)
  say "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="out of time" ;;
    *) status="failed (exit $rc)" ;;
  esac
  [ $rc -ne 0 ] && FAILED+=("$name")
  say "   $name: $status"
  printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" >>"$WORK/phases.tsv"
  printf '%-28s %s, %ss\n' "$name" "$status" "$(($(date +%s) - t0))" >>"$OUT/summary.txt"
  [ -f "$UNMASK_TUNE_FILE" ] && cp "$UNMASK_TUNE_FILE" "$OUT/kernel-choices.json"
  return 0
}

# tidy: only the files of OUT_FILES stay in OUT (never more than 8).
tidy() {
  local f keep
  for f in "$OUT"/* "$OUT"/.[!.]*; do
    [ -e "$f" ] || continue
    keep=0
    for k in "${OUT_FILES[@]}"; do [ "$(basename "$f")" = "$k" ] && keep=1; done
    [ $keep -eq 1 ] || { echo "dropped from OUT: $(basename "$f")" >>"$LOG"; rm -rf "$f"; }
  done
}

{
  echo "== machine"
  uname -a
  nproc
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  python3 -c 'import sys; print("python", sys.version.split()[0])' 2>/dev/null || echo "no python3"
} >>"$LOG" 2>&1

# --- the Vulkan loader and the NVIDIA ICD --------------------------------------------------
LOADER=yes
if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan.so.1'; then
  if compgen -G ".gl/*.deb" >/dev/null; then
    say "no Vulkan loader installed: unpacking .gl/*.deb"
    for f in .gl/*.deb; do dpkg -x "$f" / >>"$LOG" 2>&1; done
    ldconfig
  else
    LOADER=no
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
  say "no unmask binary at $BIN: build it with cargo build --profile dist -p unmask-cli and copy it"
  BIN=""
fi

# --- Python and PyTorch ($PYTHON, else python3, else tools/.venv when python3 lacks torch) --
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x tools/.venv/bin/python ] && ! python3 -c 'import torch' 2>/dev/null \
  && PY=tools/.venv/bin/python
# One probe (in the background, beside the adapter's): torch's version, CUDA and its GPU.
timeout 20 "$PY" -c 'import torch; c = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", c, torch.cuda.get_device_name(0) if c else "-")' \
  >"$WORK/torch.txt" 2>>"$LOG" &
TORCH_PROBE=$!

# preflight: stops the run at once (exit 3, one line on stdout) where the numbers cannot be
# had; PREFLIGHT_ANY_ADAPTER=1 accepts any adapter, PREFLIGHT_COOP=16|any|warn|off says what
# cooperative matrices must be there (16: 16x16x16 f16 fragments, NVIDIA's tensor cores).
preflight() {
  local out rc adapter coop name kind t0
  t0=$(date +%s)
  stop() {
    echo "PREFLIGHT FAILED: $*"
    echo "PREFLIGHT FAILED: $*" >>"$LOG"
    printf 'preflight: FAILED in %ss: %s\n' "$(($(date +%s) - t0))" "$*" >>"$OUT/summary.txt"
    kill "$TORCH_PROBE" 2>/dev/null
    tidy
    rm -rf "$WORK"
    exit 3
  }
  [ -n "$BIN" ] || stop "no unmask binary (target/dist/unmask: run tools/device/prepare.sh and carry it)"
  out=$(timeout --kill-after=5 20 "$BIN" info --model tests/fixtures/tiny --backend "$BACKEND" 2>&1)
  rc=$?
  printf '== preflight: unmask info (exit %s)\n%s\n' "$rc" "$out" >>"$LOG"
  adapter=$(grep -m1 '^adapter:' <<<"$out")
  if [ $rc -ne 0 ] || [ -z "$adapter" ]; then
    [ $rc -eq 124 ] && stop "unmask info did not answer within 20 s (adapter or driver hangs)"
    [ "$LOADER" = no ] && stop "no Vulkan loader (libvulkan.so.1) and no .gl/*.deb to unpack"
    stop "no $BACKEND adapter (unmask info exit $rc: $(tail -1 <<<"$out"))"
  fi
  if [ "${PREFLIGHT_ANY_ADAPTER:-0}" != 1 ] && ! grep -qi nvidia <<<"$adapter"; then
    name=${adapter#*adapter=\"} kind=${adapter##*type=}
    stop "no NVIDIA adapter (wgpu found \"${name%%\"*}\", type ${kind%% *}); PREFLIGHT_ANY_ADAPTER=1 runs anyway"
  fi
  coop=$(grep -m1 '^kernel features:' <<<"$out" | sed -n 's/.*cooperative matrices \(.*\)$/\1/p')
  case "${PREFLIGHT_COOP:-16}:$coop" in
    off:* | 16:yes,\ 16x16* | any:yes* | warn:yes*) ;;
    warn:*) say "preflight warning: no usable cooperative matrices (${coop:-not reported}); the coop phase runs gemm" ;;
    16:*) stop "no 16x16x16 f16 cooperative matrices (tensor cores): ${coop:-not reported}; PREFLIGHT_COOP=any|warn|off relaxes this" ;;
    *) stop "no cooperative matrices: ${coop:-not reported}; PREFLIGHT_COOP=warn|off relaxes this" ;;
  esac
  grep -q '^device features:.*TIMESTAMP_QUERY' <<<"$out" \
    || stop "no TIMESTAMP_QUERY in the device features (kernel times would be wall clock)"
  wait "$TORCH_PROBE"
  TORCH_INFO=$(cat "$WORK/torch.txt" 2>/dev/null)
  CUDA=no
  grep -q 'cuda True' <<<"$TORCH_INFO" && CUDA=yes
  [ -n "${TORCH_DEVICE:-}" ] || TORCH_DEVICE=$([ $CUDA = yes ] && echo cuda || echo cpu)
  if [ -z "$TORCH_INFO" ]; then
    say "preflight warning: no PyTorch for $PY: the parity phases skip, no PyTorch row"
  elif [ "$TORCH_DEVICE" != cpu ] && [ $CUDA = no ]; then
    say "preflight warning: $TORCH_INFO: PyTorch sees no CUDA GPU, the references run on the CPU"
    TORCH_DEVICE=cpu
  fi
  if [ "$SCALE" = full ] && [ "$(df -Pk "$WORK" | awk 'NR == 2 { print $4 }')" -lt $((24 << 20)) ]; then
    say "preflight warning: under 24 GiB free at $WORK for the synthetic checkpoints (16 + 3.1 GB); set TMPDIR"
  fi
  ADAPTER="${adapter#adapter: }"
  COOP="${coop:-?}"
  say "preflight ok in $(($(date +%s) - t0))s: $ADAPTER; coop $COOP; ${TORCH_INFO:-no torch} (references on $TORCH_DEVICE)"
  printf '%s\t%s\t%s\n' preflight ok "$(($(date +%s) - t0))" >>"$WORK/phases.tsv"
  printf '%-28s ok, %ss\n' preflight "$(($(date +%s) - t0))" >>"$OUT/summary.txt"
}

# summary: at most 20 lines on stdout (and summary.txt): each phase's outcome and time, the
# parity errors, the fastest matmul per case, tokens/s per cache mode and PyTorch's row.
summary() {
  local py=python3
  command -v python3 >/dev/null || py="$PY"
  tidy
  "$py" - "$OUT" "$WORK/phases.tsv" "$(($(date +%s) - START))" "${ADAPTER:-?}" "${COOP:-?}" \
    "$SCALE" >"$WORK/summary.txt" 2>>"$LOG" <<'EOF'
import json, os, sys
out, phases, total, adapter, coop, scale = sys.argv[1:7]
def records(name):
    try:
        with open(os.path.join(out, name)) as f:
            return [json.loads(l) for l in f if l.strip()]
    except (OSError, ValueError):
        return []
def wrap(head, items, width=118):
    lines, cur = [], head
    for it in items:
        fresh = cur in (head, " ")
        if not fresh and len(cur) + 2 + len(it) > width:
            lines.append(cur + ",")
            cur, fresh = " ", True
        cur += (" " if fresh else ", ") + it
    return lines + [cur] if items else []
name = adapter.split(" backend=")[0].removeprefix("adapter=").strip('"')
L = [f"== summary: scale {scale}, {total} s in all, {name}, cooperative matrices {coop.split(' (')[0]}"]
ph = [l.rstrip("\n").split("\t") for l in open(phases)] if os.path.exists(phases) else []
L += wrap("phases:", [f"{n} {s} {t}s" for n, s, t in ph])
par = []
for r in records("parity.jsonl"):
    rel = [c["max_abs"] / c["scale"] for c in r.get("logits", []) if c.get("scale")]
    gen = [f"gen {g['tokens_agree']}/{g['gen_length']}" for g in r.get("generation", []) if "tokens_agree" in g]
    par.append(f"{r.get('phase')} {max(rel) if rel else float('nan'):.1e} " + " ".join(gen + ["ok" if r.get("pass") else "FAIL"]))
L += wrap("parity max|err|/scale:", par) or ["parity: no records"]
kr = records("bench-kernels.jsonl")
ker = [r for r in kr if r.get("kernel") == "matmul" and "variant" in r and r.get("agrees", True)]
for m in sorted({r["m"] for r in ker}):
    best = {}
    for r in ker:
        if r["m"] == m and not r["variant"].startswith("unfused") and r["ms"] < best.get(r["case"], {"ms": 1e30})["ms"]:
            best[r["case"]] = r
    # the share of the peak that bounds the case: bandwidth at a block's rows, FLOP/s above
    key = "peak_gbs_share" if m <= 64 else "peak_gflops_share"
    share = lambda r: f" {100 * r[key]:.0f}%{'BW' if m <= 64 else 'FLOP'}" if r.get(key) else ""
    auto = sum(r["ms"] for r in ker if r["m"] == m and r["variant"].startswith("auto"))
    items = [f"{c} {r['variant']} {r['ms']:.3g}ms{share(r)}" for c, r in best.items()]
    L += wrap(f"matmul m={m} best ({sum(r['ms'] for r in best.values()):.3g} ms; auto {auto:.3g} ms):", items)
dg = [r for r in kr if r.get("record") == "step"]
L += wrap(f"dgemma decoder step ({dg[0]['layers']} layers, {dg[0]['m']} rows):" if dg else "",
          [f"{r['format']} {r['ms']:.4g}ms (experts {r['experts_ms']:.3g}, attention {r['attention_ms']:.3g})" for r in dg])
req = [r for r in records("bench-requests.jsonl") if r.get("record") == "request"]
items = []
for r in req:
    name = r["cache"] + (" kv-f16" if r.get("kv") == "f16" else "") + (f" b{r['batch']}" if r.get("batch", 1) > 1 else "")
    items.append(f"{name} {r['throughput_canvas']:.4g}")
L += wrap("tokens/s (canvas):", items) or ["requests: no records"]
# each layer type's attention per kernel (the tensor cores against the wide kernel), last:
# the line the 19-line cut drops first
da = [r for r in kr if str(r.get("case", "")).endswith(".attention") and "requested" in r]
L += wrap("dgemma attention:", [f"{r['case'].split('.')[0]} hd{r['head_dim']} {r['requested']}"
                                + ("" if r["requested"] == r["kernel"] else f"={r['kernel']}")
                                + f" {r['ms']:.3g}ms" for r in da])
print("\n".join(L[:19]))  # and the line of files: 20
EOF
  [ -s "$WORK/summary.txt" ] || cat "$OUT/summary.txt" >"$WORK/summary.txt"
  cp "$WORK/summary.txt" "$OUT/summary.txt"
  { echo "== files in $OUT"; ls -la "$OUT"; cat "$WORK/summary.txt"; } >>"$LOG"
  cat "$WORK/summary.txt"
  local files=("$OUT"/*)
  echo "files in OUT (${#files[@]}): ${files[*]##*/}"
}
