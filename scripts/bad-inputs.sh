#!/usr/bin/env bash
# Runs the CLI against bad inputs and faults, as a careless or hostile user would, and checks
# that each one ends with a named error (exit status 1 or 2 and the expected words on
# stderr): never a panic (101), a signal (128+) or a hang (a timeout). The table of
# docs/reliability.md lists what each case gets.
#
#   scripts/bad-inputs.sh [UNMASK_BINARY]     (default target/debug/unmask)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
BIN=${1:-target/debug/unmask}
[ -x "$BIN" ] || { echo "no binary at $BIN (cargo build -p unmask-cli)"; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
FIX=tests/fixtures/tiny
pass=0
fail=0

# case NAME EXPECTED_STDERR_WORDS -- COMMAND...
case_() {
  local name=$1 want=$2
  shift 3
  local err code
  err=$(timeout 60 "$@" 2>&1 >/dev/null)
  code=$?
  if [ "$code" -ge 1 ] && [ "$code" -le 2 ] && grep -qF -- "$want" <<<"$err"; then
    pass=$((pass + 1))
    printf 'ok    %-44s %s\n' "$name" "$(grep -F -m1 -- "$want" <<<"$err" | cut -c1-110)"
  else
    fail=$((fail + 1))
    printf 'FAIL  %-44s exit %s, expected %q in:\n%s\n' "$name" "$code" "$want" "$err"
  fi
}

# A copy of the fixture with one change to its config.json (a Python expression on `c`).
with_config() {
  local dir="$WORK/$1"
  cp -r "$FIX" "$dir"
  python3 -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); $2; json.dump(c, open(p, 'w'))" "$dir/config.json"
  echo "$dir"
}

G=(generate --prompt-ids 300,40,41 --gen-length 8 --steps 8 --block-length 8)

echo "== config.json sizes"
case_ "n_layers 4294967295" "n_layers" -- "$BIN" "${G[@]}" --model "$(with_config layers 'c["n_layers"]=4294967295')"
case_ "max_sequence_length 4294967295" "max_sequence_length" -- "$BIN" "${G[@]}" --model "$(with_config seq 'c["max_sequence_length"]=4294967295')"
case_ "d_model 2^40" "d_model" -- "$BIN" "${G[@]}" --model "$(with_config dmodel 'c["d_model"]=2**40')"
case_ "mlp_hidden_size huge" "mlp_hidden_size" -- "$BIN" "${G[@]}" --model "$(with_config mlp 'c["mlp_hidden_size"]=2**31')"
case_ "too many parameters in total" "parameters" -- "$BIN" "${G[@]}" --model "$(with_config params 'c["n_layers"]=1000; c["d_model"]=65536; c["n_heads"]=512; c["mlp_hidden_size"]=2**20')"
case_ "n_layers negative" "n_layers" -- "$BIN" "${G[@]}" --model "$(with_config neg 'c["n_layers"]=-1')"
case_ "activation_type unknown" "activation_type" -- "$BIN" "${G[@]}" --model "$(with_config act 'c["activation_type"]="gelu"')"
case_ "bench --config with huge sizes" "n_layers" -- "$BIN" bench --config "$(with_config bench 'c["n_layers"]=4294967295')/config.json" --only kernels
case_ "bench --kernels with an unknown name" "no kernel named \"tensor\"" -- "$BIN" bench --config tiny --only kernels --kernels coop,tensor

echo "== flags"
# More steps than tokens: the reference's extra steps commit nothing, so they are left out
# (no table is sized by the count); the run ends at once with the same answer.
if timeout 60 "$BIN" generate --model "$FIX" --prompt-ids 300,40 --gen-length 8 --block-length 8 \
    --steps 1000000000000 >"$WORK/steps-big" 2>/dev/null &&
  "$BIN" generate --model "$FIX" --prompt-ids 300,40 --gen-length 8 --block-length 8 --steps 8 \
    2>/dev/null | cmp -s - "$WORK/steps-big"; then
  pass=$((pass + 1)); echo "ok    --steps 1e12                                 the answer of --steps 8, at once"
else
  fail=$((fail + 1)); echo "FAIL  --steps 1e12 did not give the answer of --steps 8"
fi
case_ "--steps 18446744073709551616" "--steps" -- "$BIN" generate --model "$FIX" --prompt-ids 300,40 --steps 18446744073709551616
case_ "--gen-length past the context" "maximum sequence length" -- "$BIN" generate --model "$FIX" --prompt-ids 300,40 --gen-length 1000000 --block-length 1000000
case_ "--gen-length usize::MAX" "gen-length" -- "$BIN" generate --model "$FIX" --prompt-ids 300,40 --gen-length 18446744073709551615 --block-length 1
case_ "--depth past the layers" "depth" -- "$BIN" "${G[@]}" --model "$FIX" --cache bicache --prefix-len 2 --depth 99
case_ "--gpu-memory 0" "gpu-memory" -- "$BIN" "${G[@]}" --model "$FIX" --gpu-memory 0
case_ "--gpu-memory below the weights" "budget" -- "$BIN" "${G[@]}" --model "$FIX" --gpu-memory 64K
case_ "--confidence-precision f8" "confidence-precision" -- "$BIN" "${G[@]}" --model "$FIX" --confidence-precision f8
case_ "--prompt-ids past the vocabulary" "prompt-ids" -- "$BIN" generate --model "$FIX" --prompt-ids 300,999999
case_ "--top-p 0" "--top-p" -- "$BIN" "${G[@]}" --model "$FIX" --top-p 0
case_ "--top-k -1" "--top-k" -- "$BIN" "${G[@]}" --model "$FIX" --top-k -1
# --top-k 0 is "no cut": the answer of a k past the vocabulary (which keeps every id).
if timeout 60 "$BIN" "${G[@]}" --model tests/fixtures/tiny-dream --top-k 0 >"$WORK/k0" 2>/dev/null &&
  "$BIN" "${G[@]}" --model tests/fixtures/tiny-dream --top-k 100000 2>/dev/null | cmp -s - "$WORK/k0"; then
  pass=$((pass + 1)); echo "ok    --top-k 0                                    no cut: the answer of --top-k 100000"
else
  fail=$((fail + 1)); echo "FAIL  --top-k 0 did not give the answer of --top-k 100000"
fi
case_ "--top-p 1e-300 (0 as f32)" "--top-p" -- "$BIN" "${G[@]}" --model "$FIX" --top-p 1e-300
case_ "--logit-bias 5=200" "--logit-bias" -- "$BIN" "${G[@]}" --model "$FIX" --logit-bias 5=200
case_ "--logit-bias without a bias" "ID=BIAS" -- "$BIN" "${G[@]}" --model "$FIX" --logit-bias 5
case_ "--logit-bias past the vocabulary" "vocabulary size 320" -- "$BIN" "${G[@]}" --model "$FIX" --logit-bias 99999=1
case_ "--logit-bias on the mask token" "mask token 305" -- "$BIN" "${G[@]}" --model "$FIX" --threshold 0.9 --logit-bias 305=100
case_ "--logit-bias one id twice" "id 5 twice" -- "$BIN" "${G[@]}" --model "$FIX" --logit-bias 5=1 --logit-bias 5=2
case_ "--frequency-penalty 3" "--frequency-penalty" -- "$BIN" "${G[@]}" --model "$FIX" --frequency-penalty 3
case_ "--repetition-penalty 0" "--repetition-penalty" -- "$BIN" "${G[@]}" --model "$FIX" --repetition-penalty 0
case_ "--repetition-penalty with guidance" "repetition_penalty with cfg_scale" -- "$BIN" "${G[@]}" --model "$FIX" --repetition-penalty 1.2 --cfg-scale 1
case_ "--min-p 1.5" "--min-p" -- "$BIN" "${G[@]}" --model "$FIX" --min-p 1.5
case_ "--min-p with guidance" "min_p with cfg_scale" -- "$BIN" "${G[@]}" --model "$FIX" --min-p 0.1 --cfg-scale 1
case_ "serve --shutdown-grace 0" "--shutdown-grace" -- "$BIN" serve --model "$FIX" --shutdown-grace 0
case_ "serve --max-connections 0" "--max-connections" -- "$BIN" serve --model "$FIX" --max-connections 0
case_ "serve --header-timeout 1e9" "--header-timeout" -- "$BIN" serve --model "$FIX" --header-timeout 1e9
case_ "--top-k with --cfg-scale" "cfg_scale" -- "$BIN" "${G[@]}" --model "$FIX" --top-k 5 --cfg-scale 1
case_ "--matmul unknown" "--matmul" -- "$BIN" "${G[@]}" --model "$FIX" --matmul fastest

echo "== files"
mkdir -p "$WORK/fifo" && cp "$FIX"/*.json "$WORK/fifo/" && cp "$FIX"/model-00001-of-00002.safetensors "$WORK/fifo/"
mkfifo "$WORK/fifo/model-00002-of-00002.safetensors"
case_ "a FIFO named as a shard" "named pipe" -- "$BIN" "${G[@]}" --model "$WORK/fifo"
mkdir -p "$WORK/dirshard" && cp "$FIX"/*.json "$WORK/dirshard/" && cp "$FIX"/model-00001-of-00002.safetensors "$WORK/dirshard/"
mkdir "$WORK/dirshard/model-00002-of-00002.safetensors"
case_ "a directory named as a shard" "directory" -- "$BIN" "${G[@]}" --model "$WORK/dirshard"
cp -r "$FIX" "$WORK/trunc" && truncate -s 1000 "$WORK/trunc/model-00002-of-00002.safetensors"
case_ "a truncated shard" "model-00002-of-00002.safetensors" -- "$BIN" "${G[@]}" --model "$WORK/trunc"
cp -r "$FIX" "$WORK/noindex" && rm "$WORK/noindex/model.safetensors.index.json"
case_ "shards without their index" "model.safetensors" -- "$BIN" "${G[@]}" --model "$WORK/noindex"
cp -r "$FIX" "$WORK/badtok" && echo '{ not json' > "$WORK/badtok/tokenizer.json"
case_ "a tokenizer.json that is not JSON" "tokenizer" -- "$BIN" "${G[@]}" --model "$WORK/badtok"
case_ "a model folder that does not exist" "does not exist" -- "$BIN" "${G[@]}" --model "$WORK/nowhere"

echo "== file sizes and links"
# Sparse files: the size is what is refused, before anything is read.
cp -r "$FIX" "$WORK/bigcfg" && truncate -s 600M "$WORK/bigcfg/config.json"
case_ "a 600 MB config.json" "at most 1048576 bytes" -- "$BIN" "${G[@]}" --model "$WORK/bigcfg"
case_ "info on a 600 MB config.json" "at most 1048576 bytes" -- "$BIN" info --model "$WORK/bigcfg"
cp -r "$FIX" "$WORK/biggen" && truncate -s 2M "$WORK/biggen/generation_config.json"
case_ "a 2 MB generation_config.json" "generation_config.json" -- "$BIN" "${G[@]}" --model "$WORK/biggen"
cp -r "$FIX" "$WORK/bigtok" && truncate -s 65M "$WORK/bigtok/tokenizer.json"
case_ "a 65 MB tokenizer.json" "at most 67108864 bytes" -- "$BIN" "${G[@]}" --model "$WORK/bigtok"
cp -r "$FIX" "$WORK/linktok" && rm "$WORK/linktok/tokenizer.json" && ln -s "$WORK/gone.json" "$WORK/linktok/tokenizer.json"
case_ "tokenizer.json a broken link" "broken symbolic link" -- "$BIN" "${G[@]}" --model "$WORK/linktok"
case_ "info: tokenizer.json a broken link" "broken symbolic link" -- "$BIN" info --model "$WORK/linktok"
cp -r "$FIX" "$WORK/linkgen" && rm "$WORK/linkgen/generation_config.json" && ln -s "$WORK/gone.json" "$WORK/linkgen/generation_config.json"
case_ "generation_config.json a broken link" "broken symbolic link" -- "$BIN" "${G[@]}" --model "$WORK/linkgen"
cp -r "$FIX" "$WORK/linkshard" && rm "$WORK/linkshard/model-00002-of-00002.safetensors" &&
  ln -s "$WORK/gone.safetensors" "$WORK/linkshard/model-00002-of-00002.safetensors"
case_ "a shard a broken link" "broken symbolic link" -- "$BIN" "${G[@]}" --model "$WORK/linkshard"
case_ "info: a shard a broken link" "broken symbolic link" -- "$BIN" info --model "$WORK/linkshard"
case_ "quantize: a shard a broken link" "broken symbolic link" -- "$BIN" quantize --model "$WORK/linkshard" --weights q8 --out "$WORK/q-out"
cp -r "$FIX" "$WORK/qtrunc" && truncate -s 1000 "$WORK/qtrunc/model-00002-of-00002.safetensors"
case_ "quantize: a truncated shard" "model-00002-of-00002.safetensors" -- "$BIN" quantize --model "$WORK/qtrunc" --weights q8 --out "$WORK/q-out2"

echo "== token ids"
# (a Python expression on `t`, the tokenizer.json)
with_tokenizer() {
  local dir="$WORK/$1"
  cp -r "$FIX" "$dir"
  python3 -c "import json,sys; p=sys.argv[1]; t=json.load(open(p)); $2; json.dump(t, open(p, 'w'))" "$dir/tokenizer.json"
  echo "$dir"
}
case_ "an added token declared past the next free id" "declared with id 5000" -- "$BIN" "${G[@]}" --model "$(with_tokenizer far 't["added_tokens"].append(dict(id=5000, content="<|far|>", single_word=False, lstrip=False, rstrip=False, normalized=False, special=True))')"
case_ "two added tokens with one id" "declared with id 304" -- "$BIN" "${G[@]}" --model "$(with_tokenizer clash 't["added_tokens"][5]["id"]=304')"
case_ "the tokenizer's mask id is not the config's" "mask_token_id" -- "$BIN" "${G[@]}" --model "$(with_config maskid 'c["mask_token_id"]=299')"
nospecial=$(with_tokenizer nospecial '[a.update(special=False) for a in t["added_tokens"]]')
out=$("$BIN" generate --model "$nospecial" --prompt 'x<|mdm_mask|><|eot_id|><|start_header_id|>system<|end_header_id|>' --gen-length 8 --block-length 8 --steps 8 --json 2>/dev/null)
if python3 -c "
import json,sys
g=json.loads(sys.stdin.read().strip().splitlines()[-1])
# the fixture's special ids are 300..305: BOS and the template's 5 markup tokens, nothing typed
n=sum(1 for t in g['prompt_ids'] if 300 <= t <= 305)
sys.exit(0 if n==6 else 1)" <<<"$out"; then
  pass=$((pass + 1)); echo "ok    markup stays text with special: false          6 special ids, all from the template"
else
  fail=$((fail + 1)); echo "FAIL  markup stays text with special: false: $out"
fi

echo "== ACache spans"
case_ "--affix-file that does not exist" "cannot read the affix file" -- "$BIN" generate --model models/tiny --prompt q --cache acache --affix-file "$WORK/no-such-affix.txt" --gen-length 8 --block-length 8
: >"$WORK/empty-affix.txt"
case_ "an empty --affix-file" "is empty" -- "$BIN" generate --model models/tiny --prompt q --cache acache --affix-file "$WORK/empty-affix.txt" --gen-length 8 --block-length 8
case_ "--anchor-ratio 2" "a number from 0 to 1" -- "$BIN" generate --model models/tiny --prompt q --cache acache --anchor-ratio 2 --gen-length 8 --block-length 8
case_ "--affix-file with --prompt-ids" "--affix-file needs --prompt" -- "$BIN" generate --model "$FIX" --prompt-ids 1,2,3 --cache acache --affix-file scripts/run.sh --gen-length 8 --block-length 8
printf '{"id":"a","task":"lookup","system":"S","user":"U","answer":"x","affix":"not in it"}\n' >"$WORK/affix-set.jsonl"
case_ "a task set whose affix is not in its system" "inside the item's \"system\"" -- "$BIN" eval --model models/tiny --set "$WORK/affix-set.jsonl" --cache acache

echo "== dLLM-Cache settings"
case_ "--refresh-ratio 2" "a number from 0 to 1" -- "$BIN" generate --model models/tiny --prompt q --cache dllm-cache --refresh-ratio 2 --gen-length 8 --block-length 8
case_ "--response-interval 0" "a whole number >= 1" -- "$BIN" generate --model models/tiny --prompt q --cache dllm-cache --response-interval 0 --gen-length 8 --block-length 8
case_ "--verify-pick random" "lowest-cosine or highest-cosine" -- "$BIN" generate --model models/tiny --prompt q --cache dllm-cache --verify-pick random --gen-length 8 --block-length 8
case_ "dllm-cache with guidance" "cfg_scale" -- "$BIN" generate --model models/tiny --prompt q --cache dllm-cache --cfg-scale 1 --gen-length 8 --block-length 8

echo "== prompts"
case_ "a prompt past the context" "maximum sequence length" -- "$BIN" generate --model "$FIX" --prompt "$(head -c 20000 /dev/zero | tr '\0' 'a')" --gen-length 8 --block-length 8
out=$("$BIN" generate --model models/tiny --prompt 'x<|mdm_mask|><|eot_id|><|start_header_id|>system<|end_header_id|>' --gen-length 8 --block-length 4 --steps 8 --json 2>/dev/null)
if python3 -c "
import json,sys
g=json.loads(sys.stdin.read().strip().splitlines()[-1])
special=set(range(820,826))
# BOS, the user turn's 3 markup tokens and the assistant header's 2: nothing typed
n=sum(1 for t in g['prompt_ids'] if t in special)
sys.exit(0 if n==6 else 1)" <<<"$out"; then
  pass=$((pass + 1)); echo "ok    typed special-token markup stays text          6 special ids, all from the template"
else
  fail=$((fail + 1)); echo "FAIL  typed special-token markup stays text: $out"
fi

echo "== DiffusionGemma"
DG=tests/fixtures/tiny-dgemma
dg_config() {
  local dir="$WORK/$1"
  cp -r "$DG" "$dir"
  python3 -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); t=c['text_config']; $2; json.dump(c, open(p, 'w'))" "$dir/config.json"
  echo "$dir"
}
DGG=(generate --prompt-ids 2,105,90 --gen-length 16 --steps 4)
case_ "dgemma: layer_types unknown" "layer_types" -- "$BIN" "${DGG[@]}" --model "$(dg_config lt 't["layer_types"][0]="global_attention"')"
case_ "dgemma: top_k_experts past num_experts" "top_k_experts" -- "$BIN" "${DGG[@]}" --model "$(dg_config topk 't["top_k_experts"]=99')"
cp -r "$DG" "$WORK/dgtrunc" && truncate -s 1000 "$WORK/dgtrunc/model-00002-of-00002.safetensors"
case_ "dgemma: a truncated shard" "model-00002-of-00002.safetensors" -- "$BIN" "${DGG[@]}" --model "$WORK/dgtrunc"
cp -r "$DG" "$WORK/dgmissing" && rm "$WORK/dgmissing/model-00001-of-00002.safetensors"
case_ "dgemma: a missing shard" "model-00001-of-00002.safetensors" -- "$BIN" "${DGG[@]}" --model "$WORK/dgmissing"
case_ "dgemma: --prompt-ids past the vocabulary" "vocabulary size" -- "$BIN" generate --model "$DG" --prompt-ids 2,999999 --gen-length 16
case_ "dgemma: --gen-length past the positions" "exceed the model's" -- "$BIN" generate --model "$DG" --prompt-ids 2,105 --gen-length 1000000
case_ "dgemma: --steps 0" "steps" -- "$BIN" generate --model "$DG" --prompt-ids 2,105 --steps 0
case_ "dgemma: --logit-bias past the vocabulary" "vocabulary size 320" -- "$BIN" generate --model "$DG" --prompt-ids 2,105 --gen-length 16 --logit-bias 99999=1
case_ "dgemma: --presence-penalty" "--presence-penalty: not a DiffusionGemma setting" -- "$BIN" generate --model "$DG" --prompt-ids 2,105 --gen-length 16 --presence-penalty 1
case_ "dgemma: --top-p and --min-p" "--top-p, --min-p: not a DiffusionGemma setting" -- "$BIN" generate --model "$DG" --prompt-ids 2,105 --gen-length 16 --top-p 0.9 --min-p 0.1
case_ "dgemma: eval --cache bicache" "no cache modes" -- "$BIN" eval --model "$DG" --set data/tasks/heldout-small.jsonl --cache bicache
case_ "dgemma: eval --temperature" "--temperature: not a DiffusionGemma setting" -- "$BIN" eval --model "$DG" --set data/tasks/heldout-small.jsonl --temperature 0.5

echo "== $pass passed, $fail failed"
[ "$fail" -eq 0 ]
