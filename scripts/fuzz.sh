#!/usr/bin/env bash
# Coverage-guided fuzzing of model-file loading: config.json (LLaDA/Dream and DiffusionGemma,
# each with its generation_config.json), safetensors headers and data, the shard index,
# tokenizer.json (the targets are in fuzz/fuzz_targets). Builds them with
# libFuzzer and coverage instrumentation, then runs each for a bounded time, starting from
# the committed seeds (fuzz/corpus/<target>) and what earlier runs here found
# (target/fuzz/corpus/<target>). Fails on any crash, panic, timeout or outsized allocation,
# leaving the input in fuzz/artifacts/<target>/ and printing the command that replays it.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET [TARGET...]]    default: 60 s each, every target
#
# A found input, once fixed, goes into fuzz/corpus/<target>/ as regress-<what> so every
# later run replays it first. No cargo-fuzz and no nightly: the flags cargo-fuzz passes
# (bar AddressSanitizer, which only catches what safe Rust cannot do) work on stable.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config dgemma_config safetensors shard_index tokenizer)

# libfuzzer-sys compiles libFuzzer itself.
if ! command -v c++ >/dev/null; then
  echo "== fuzz: installing a C++ compiler for libFuzzer"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ >/dev/null
fi

# Its own target folder: these RUSTFLAGS would otherwise invalidate the main build.
out="$PWD/target/fuzz"
host="$(rustc -vV | sed -n 's/^host: //p')"
# Sanitizer coverage as cargo-fuzz sets it up, and `--cfg fuzzing` for code that wants to
# know. `--target` keeps these flags off build scripts and proc macros, which run on the
# host without libFuzzer's coverage callbacks to link against.
export RUSTFLAGS="-Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares \
--cfg fuzzing"
echo "== fuzz: building ${targets[*]}"
start=$SECONDS
# Not --locked: fuzz/Cargo.lock pins what it lists, and a dependency unmask-core gains
# later is added to it rather than failing the run.
CARGO_TARGET_DIR="$out" nice cargo build --quiet --release \
  --manifest-path fuzz/Cargo.toml --target "$host" $(printf -- '--bin %s ' "${targets[@]}")
echo "   built in $((SECONDS - start)) s"

# Longest input per target: a few times its largest seed, so mutations can grow a file
# without spending the run on megabytes of JSON.
declare -A max_len=([config]=4096 [dgemma_config]=4096 [safetensors]=16384 [shard_index]=4096 [tokenizer]=16384)

run_target() {
  local t="$1"
  local work="$out/corpus/$t" artifacts="fuzz/artifacts/$t/" log="$out/logs/$t.log"
  local dict="$out/dicts/$t.dict"
  mkdir -p "$work" "$artifacts" "$(dirname "$log")" "$(dirname "$dict")"
  cat fuzz/dicts/json.dict "fuzz/dicts/$t.dict" >"$dict"
  # New inputs go to the first folder (the scratch corpus), never to the committed seeds.
  # -rss_limit_mb catches memory that is touched; fuzz/src/lib.rs fails any single
  # allocation over 256 MiB, touched or not.
  if "$out/$host/release/$t" "$work" "fuzz/corpus/$t" \
    -max_total_time="$seconds" -max_len="${max_len[$t]}" -rss_limit_mb=1024 -timeout=10 \
    -dict="$dict" -artifact_prefix="$artifacts" -print_final_stats=1 >"$log" 2>&1; then
    local execs
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")"
    echo "   $t: ${execs:-?} runs in ${seconds} s, no crash ($(grep -o 'cov: [0-9]*' "$log" | tail -1))"
  else
    echo "!! $t: FAILED. The end of its log ($log):"
    tail -n 40 "$log" | sed 's/^/   /'
    local input
    input="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)"
    echo "!! replay it with: $out/$host/release/$t ${input:-fuzz/artifacts/$t/<input>}"
    return 1
  fi
}

# As many targets at once as there are cores.
jobs="$(nproc)"
echo "== fuzz: ${seconds} s per target, ${jobs} at a time"
failed=0
pids=()
for t in "${targets[@]}"; do
  run_target "$t" &
  pids+=("$!")
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
if [ "$failed" != 0 ]; then
  echo "!! fuzz: crashes found (inputs in fuzz/artifacts/)"
  exit 1
fi
echo "== fuzz: no crash"
