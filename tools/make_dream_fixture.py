"""Build the tiny Dream-format test fixture under tests/fixtures/tiny-dream/.

Everything is derived from one seed (default 0):

* tokenizer.json: byte-level BPE (300 ordinary tokens) trained on the corpus of
  tools/make_fixture.py with Qwen2's pre-tokenizer, followed by seven Qwen2/Dream special
  tokens;
* tokenizer_config.json (Dream's ChatML chat template), special_tokens_map.json,
  generation_config.json, config.json (the Dream/Qwen2 key layout);
* random bf16 weights with the Qwen2 tensor names (q/k/v biases) in two safetensors
  shards plus model.safetensors.index.json;
* goldens/logits.json and goldens/generate.json from tools/dream_ref.py;
* chat_template_cases.json.

The tokenizer training, safetensors and JSON writers and the golden-case search it shares
with tools/make_fixture.py are in tools/fixture_common.py.  This fixture's tokenizer, ids
and chat template are in tools/dream_fixture_chat.py, its logits and generate goldens in
tools/dream_fixture_goldens.py; this script keeps the config files, the weights, the
README and main(), and re-exports the names of both modules.

Usage: tools/.venv/bin/python tools/make_dream_fixture.py [--seed 0] [--out tests/fixtures/tiny-dream]
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_common  # noqa: E402
import dream_ref  # noqa: E402
import fixture_common  # noqa: E402
import llada_ref  # noqa: E402
import make_fixture  # noqa: E402
from fixture_common import MARGIN_FLOOR, encode, to_json, write_text  # noqa: E402

# Every name of the two parts is re-exported: tools/check_dream_fixture.py (and anything
# else that imports this script) reads them as make_dream_fixture.NAME.
from dream_fixture_chat import (  # noqa: E402,F401
    BOS_ID,
    CHAT_CONVERSATIONS,
    CHAT_TEMPLATE,
    DEFAULT_SYSTEM,
    EOS_ID,
    FIM_PREFIX_ID,
    FIM_SUFFIX_ID,
    IM_END_ID,
    IM_START_ID,
    MASK_ID,
    N_ORDINARY,
    PAD_ID,
    QWEN2_PATTERN,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_tokenizer,
    chat_cases,
    prefix_info,
    render_chat,
    render_jinja,
    system_turn,
)
from dream_fixture_goldens import (  # noqa: E402,F401
    ANSWERS,
    CASE_SPECS,
    EPS,
    N_LEFT_PAD,
    QUOTA_FLOOR,
    THRESHOLD_CHOICES,
    case_is_interesting,
    case_record,
    committed_list,
    full_params,
    generate_golden,
    logits_case,
    logits_golden,
    logits_prompts,
    quota_f32,
    quotas_are_robust,
    run_case,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "tiny-dream")

HIDDEN, N_HEADS, N_KV_HEADS, N_LAYERS, INTERMEDIATE = 64, 4, 2, 2, 96
ROPE_THETA = 10000.0

# Standard deviations of the random weights (see tools/make_fixture.py for the reasons of
# the matrix sizes).  The biases are large enough that dropping any one of them changes
# the logits clearly: the q bias adds a per-key term to the scores, the k bias (rotated by
# RoPE) a per-(query, key) one, the v bias shifts every attention output.
STD = {
    "embed": 0.3,
    "q_proj": 0.25,
    "k_proj": 0.25,
    "v_proj": 0.1,
    "o_proj": 0.1,
    "gate_proj": 0.2,
    "up_proj": 0.2,
    "down_proj": 0.05,
    "lm_head": 0.5,
    "q_bias": 0.5,
    "k_bias": 0.5,
    "v_bias": 0.3,
    "norm_jitter": 0.1,
}
EOS_HEAD_SCALE = 1.3  # LM-head rows of <|endoftext|> and <|im_end|>: they win some argmaxes
MASK_HEAD_SCALE = 0.1  # LM-head row of <|mask|>: never predicted

# ---------------------------------------------------------------------------
# config files
# ---------------------------------------------------------------------------


def model_config():
    """config.json in the Dream-v0-Instruct-7B layout (alphabetical, as transformers
    writes it) with this fixture's sizes."""
    cfg = {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "mask_token_id": MASK_ID,
        "max_position_embeddings": 512,
        "max_window_layers": N_LAYERS,
        "model_type": "Dream",
        "num_attention_heads": N_HEADS,
        "num_hidden_layers": N_LAYERS,
        "num_key_value_heads": N_KV_HEADS,
        "pad_token_id": PAD_ID,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }
    return cfg


def _added(t):
    return {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}


def _entry(t):
    return {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


ADDITIONAL_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_suffix|>"]


def tokenizer_config():
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(N_ORDINARY + i): _added(t) for i, t in enumerate(SPECIAL_TOKENS)},
        "additional_special_tokens": ADDITIONAL_SPECIAL,
        "bos_token": "<|beginoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "mask_token": "<|mask|>",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def special_tokens_map():
    return {
        "additional_special_tokens": ADDITIONAL_SPECIAL,
        "bos_token": _entry("<|beginoftext|>"),
        "eos_token": _entry("<|endoftext|>"),
        "mask_token": _entry("<|mask|>"),
        "pad_token": _entry("<|endoftext|>"),
    }


def generation_config():
    """The keys of Dream-v0-Instruct-7B's generation_config.json; like that file it
    leaves mask_token_id null (the mask id comes from config.json)."""
    return {
        "_from_model_config": True,
        "alg": "origin",
        "alg_temp": None,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "eps": EPS,
        "mask_token_id": None,
        "output_history": False,
        "pad_token_id": PAD_ID,
        "steps": 512,
        "temperature": 0.0,
        "top_k": None,
        "top_p": None,
        "transformers_version": "4.46.2",
    }


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------


def make_weights(rng, dims=None, stds=None, ids=None):
    """name -> float32 array (drawn in float32 order, then rounded to bf16).

    dims = (hidden, heads, kv_heads, layers, intermediate, vocab), stds the standard
    deviations and ids = (eos, im_end, mask); the defaults are this fixture's
    (tools/make_wide_head_fixture.py passes its own)."""
    D, H, Hkv, L, F, V = dims or (HIDDEN, N_HEADS, N_KV_HEADS, N_LAYERS, INTERMEDIATE, VOCAB_SIZE)
    stds = stds or STD
    eos_id, im_end_id, mask_id = ids or (EOS_ID, IM_END_ID, MASK_ID)
    kv = Hkv * (D // H)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_w():
        return (1.0 + rng.standard_normal(D) * stds["norm_jitter"]).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((V, D), stds["embed"])}
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_w()
        w[p + "self_attn.q_proj.weight"] = normal((D, D), stds["q_proj"])
        w[p + "self_attn.q_proj.bias"] = normal((D,), stds["q_bias"])
        w[p + "self_attn.k_proj.weight"] = normal((kv, D), stds["k_proj"])
        w[p + "self_attn.k_proj.bias"] = normal((kv,), stds["k_bias"])
        w[p + "self_attn.v_proj.weight"] = normal((kv, D), stds["v_proj"])
        w[p + "self_attn.v_proj.bias"] = normal((kv,), stds["v_bias"])
        w[p + "self_attn.o_proj.weight"] = normal((D, D), stds["o_proj"])
        w[p + "post_attention_layernorm.weight"] = norm_w()
        w[p + "mlp.gate_proj.weight"] = normal((F, D), stds["gate_proj"])
        w[p + "mlp.up_proj.weight"] = normal((F, D), stds["up_proj"])
        w[p + "mlp.down_proj.weight"] = normal((D, F), stds["down_proj"])
    w["model.norm.weight"] = norm_w()
    head = normal((V, D), stds["lm_head"])
    head[eos_id] *= EOS_HEAD_SCALE
    head[im_end_id] *= EOS_HEAD_SCALE
    head[mask_id] *= MASK_HEAD_SCALE
    w["lm_head.weight"] = head
    return {k: llada_ref.bf16_round(v) for k, v in w.items()}


def shard_of(name):
    """Two shards; every layer is split across both (a projection's weight and bias too)."""
    first = name in ("model.embed_tokens.weight", "model.norm.weight") or name.endswith(
        (
            ".input_layernorm.weight",
            ".self_attn.q_proj.weight",
            ".self_attn.k_proj.bias",
            ".self_attn.o_proj.weight",
            ".mlp.gate_proj.weight",
        )
    )
    return 1 if first else 2


EOS_TARGET_SHARE = 0.15


def boost_eos(weights, tok):
    """Make <|endoftext|> a frequent prediction, as in the real model (which fills the
    tail of the canvas with it): add to its LM-head row the smallest multiple of the mean
    final hidden state (over the masked positions of the question canvases) for which it
    is the argmax at EOS_TARGET_SHARE of those positions.  A random row alone never wins."""
    params = {"config": dream_common.resolve_config(model_config()), "tensors": weights}
    rows = []
    for q in make_fixture.GENERATE_QUESTIONS:
        prompt = encode(tok, render_chat([{"role": "user", "content": q}]))
        canvas = prompt + [MASK_ID] * 16
        _, hid = dream_ref.forward(params, canvas, return_hidden=True)
        rows.append(hid[len(prompt) - 1 : len(canvas) - 1])  # shifted: row i-1 predicts i
    H = np.concatenate(rows).astype(np.float64)
    head = weights["lm_head.weight"].astype(np.float64)
    logits = H @ head.T
    others = np.delete(logits, EOS_ID, axis=1).max(axis=1)
    u = H.mean(axis=0)
    u /= np.linalg.norm(u)
    gain = H @ u
    for c in np.arange(0.0, 20.0, 0.01):
        share = np.mean(logits[:, EOS_ID] + c * gain > others)
        if share >= EOS_TARGET_SHARE:
            break
    else:
        raise RuntimeError("no EOS boost reaches the target share")
    w = dict(weights)
    new_head = weights["lm_head.weight"].copy()
    new_head[EOS_ID] = llada_ref.bf16_round((head[EOS_ID] + c * u).astype(np.float32))
    w["lm_head.weight"] = new_head
    print(f"  EOS row + {c:.2f} x mean hidden direction: argmax at {share:.0%} of {H.shape[0]} probe positions")
    return w, float(c), float(share)


def check_biases_matter(params, ids):
    """Dropping any one kind of bias must move the logits clearly."""
    base = dream_ref.forward(params, ids).astype(np.float64)
    scale = np.max(np.abs(base))
    for kind in ("q_proj", "k_proj", "v_proj"):
        W = dict(params["tensors"])
        for i in range(N_LAYERS):
            name = f"model.layers.{i}.self_attn.{kind}.bias"
            W[name] = np.zeros_like(W[name])
        other = dream_ref.forward(dict(params, tensors=W), ids).astype(np.float64)
        rel = np.max(np.abs(other - base)) / scale
        flips = int(np.sum(np.argmax(other, -1) != np.argmax(base, -1)))
        print(f"  without the {kind} bias: max logit change {rel:.3f} of the scale, {flips}/{len(ids)} argmax flips")
        if rel < 0.02:
            raise RuntimeError(f"the {kind} bias barely matters")



# ---------------------------------------------------------------------------
# README
# ---------------------------------------------------------------------------

README = """\
# Tiny Dream fixture

A 2-layer Dream-format checkpoint (Qwen2 layout, bidirectional attention) with random
weights, a byte-level BPE tokenizer with Qwen2's pre-tokenizer and golden outputs of an
independent numpy reference. The Rust tests read these files; they never run Python.

Made with (from the repository root):

    python3 -m venv tools/.venv
    tools/.venv/bin/pip install -r tools/requirements.txt
    tools/.venv/bin/python tools/make_dream_fixture.py --seed {seed}
    tools/.venv/bin/python tools/check_dream_fixture.py

`make_dream_fixture.py` is deterministic for a given seed; `check_dream_fixture.py`
reloads every file, re-runs the reference (`tools/dream_ref.py`) and compares it with the
goldens.

## Files

| file | what |
|---|---|
| `config.json` | the Dream-v0-Instruct-7B config keys; hidden_size {hidden}, {heads} heads, {kv} KV heads (GQA), {layers} layers, intermediate_size {inter}, vocab_size {vocab}, rope_theta {theta:g}, rms_norm_eps 1e-6, untied LM head |
| `model-0000{{1,2}}-of-00002.safetensors`, `model.safetensors.index.json` | bf16 weights with the HF Qwen2 tensor names (q/k/v have biases); each layer is split over both shards (q_proj.weight and q_proj.bias too), so load by the index |
| `tokenizer.json` | byte-level BPE, {n_ord} ordinary tokens (ids 0..{last_ord}) trained on the corpus of `tools/make_fixture.py`; NFC normalizer, Qwen2's `Split` regex (Isolated) then ByteLevel without its own regex, ByteLevel decoder, no post-processor (nothing is added by `add_special_tokens`) |
| `tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json` | in the Dream-v0-Instruct-7B layout with this fixture's ids; the chat template is Dream's ChatML template with the default system prompt; `generation_config.json` leaves `mask_token_id` null like the original, so the mask id comes from `config.json` |
| `chat_template_cases.json` | rendered chat prompts (default and own system turn, multi-turn, untrimmed whitespace, special-token markup inside content, Unicode), their token ids and the length of the system-turn prefix |
| `goldens/logits.json` | unshifted logits [T, {vocab}] for three prompts (lengths 5, 12, 23; the last has mask tokens) and the 12-token prompt left-padded with 4 pad tokens (rows of the real tokens only), float32 path |
| `goldens/generate.json` | sampler cases with every step's committed positions and tokens (and random draws) |

## Token ids

| id | token |
|---|---|
| {eos} | `<|endoftext|>` (EOS = PAD) |
| {im_start} | `<|im_start|>` |
| {im_end} | `<|im_end|>` (end of turn) |
| {bos} | `<|beginoftext|>` (BOS; config.json and generation_config.json say {bos} too, where the real Dream files give the EOS id) |
| {mask} | `<|mask|>` (mask) |
| {fim_prefix} | `<|fim_prefix|>` |
| {fim_suffix} | `<|fim_suffix|>` |
| {first_empty}..{last_row} | embedding rows without a token |

## Weights

Normal random values rounded to bf16: embedding {s_embed}, q_proj/k_proj {s_q}, v_proj/o_proj
{s_v}, gate_proj/up_proj {s_gate}, down_proj {s_down}, LM head {s_head}; biases q {s_qb}, k {s_kb},
v {s_vb}. Norm weights are 1 + N(0, {s_norm}). Dropping any one kind of bias changes the logits
clearly: the k bias matters only through RoPE (unrotated it would add a per-query
constant to the scores), so forgetting to rotate it also shows. The LM-head rows of
`<|endoftext|>` and `<|im_end|>` are {eos_scale}x larger, and the `<|endoftext|>` row also gets
{eos_boost:.2f} times the unit mean final hidden state of the question canvases, so that, as
with the real model, EOS is the argmax at about {eos_share:.0%} of masked positions and shows up
in the generate goldens; the mask row is {mask_scale}x smaller, so the mask token is never
predicted. Rows {first_empty}..{last_row} have weights but no token; they still produce logits
and can win an argmax, so nothing may truncate the logits to the tokenizer's size.

rope_theta is {theta:g} rather than Dream's 1e6: with head_dim 16 and sequences under 100
tokens, theta 1e6 would rotate all but the first few dimension pairs by almost nothing,
and a RoPE bug would hardly show.

## Numerics of the goldens

`logits_f32` stores every intermediate as float32 (computed in float64; a biased linear
layer is rounded once). The sampler reads shifted logits: the prediction for position i
is output row i-1 (row 0 for position 0). The generate goldens use float64 softmax
confidences; each case records `min_margin` and `min_logit_margin` (all are >= {floor:g}
where present), so an f32 implementation decides every step the same way. The step quotas
`int(num_masked * (1 - s/t))` were checked to come out the same in float32 (PyTorch) and
float64 and to be at least {qfloor:g} from an integer.

## Left padding

The `left_padded` logits case follows Dream's batched path: positions are
`cumsum(attention_mask) - 1` (pads get position 1) and pad keys are masked out. The
reference lets pad rows attend to the real keys (PyTorch's all-masked rows would give
NaN); only the rows of real tokens are stored, and they equal the unpadded case.

## Samplers (goldens/generate.json)

All cases are temperature 0, one full-sequence forward per step. top_p / top_k (cases j
and k) cut each row before its softmax as Dream's `top_p_logits` / `top_k_logits` do: the
confidence is over the kept tokens only.

* Original schedule (`block_length == gen_length`, no threshold): canvas = prompt +
  gen_length masks, `ts = linspace(1, eps, steps + 1)`; step i commits
  `n = int(num_masked * (1 - ts[i+1]/ts[i]))` positions (all at the last step, so a step
  may commit none). Confidence: maskgit_plus = top probability, topk_margin = top1 - top2
  probability, entropy = sum(p log(p + 1e-10)); the n most confident masked positions
  win, ties to the lowest position. With `alg_temp` the n positions are drawn without
  replacement from `softmax(confidence / alg_temp)`: per draw u, over the remaining
  masked positions in ascending order, the first whose running weight sum exceeds
  u * (remaining sum). `origin` commits each masked position whose draw is
  `< 1 - ts[i+1]/ts[i]` (1 at the last step).
* Block schedule (`block_length < gen_length` or a threshold): per block a step 0
  commits the block's first position with its argmax; then steps 1..steps_per_block-1
  with `ts = linspace(1, eps, steps_per_block + 1)` and the quota above over the
  block's masks, or, with a threshold, steps that commit the most confident masked
  position of the block and every other one whose top probability is >= threshold,
  until the block is full.
* `draws` are `float32(numpy Generator(PCG64(seed)).random(n))`, one generator per case:
  origin draws one per masked position (ascending) every step, alg_temp one per pick.

## Generate cases

{case_table}
"""


def case_table(gen):
    rows = ["| case | schedule | steps run | commits per step | min_margin | min_logit_margin |", "|---|---|---|---|---|---|"]
    for c in gen["cases"]:
        p = c["params"]
        if p["threshold"] is not None:
            sched = f"blocks of {p['block_length']}, threshold {p['threshold']}"
        elif p["block_length"] < p["gen_length"]:
            sched = f"blocks of {p['block_length']}, {p['steps']} steps, {p['alg']}"
        else:
            sched = f"original, {p['steps']} steps, {p['alg']}" + (f", alg_temp {p['alg_temp']}" if p["alg_temp"] else "")
            sched += "".join(f", {k} {p[k]}" for k in ("top_p", "top_k") if p.get(k) is not None)
        sizes = ",".join(str(len(s["committed"])) for s in c["steps"])
        mm = "-" if not math.isfinite(c["min_margin"]) else f"{c['min_margin']:.3g}"
        rows.append(f"| `{c['name']}` | {sched} | {len(c['steps'])} | {sizes} | {mm} | {c['min_logit_margin']:.3g} |")
    return "\n".join(rows)


def main():
    args = fixture_common.maker_args(__doc__.splitlines()[0], DEFAULT_OUT)
    out = args.out

    print("tokenizer")
    tok = build_tokenizer()
    fixture_common.save_tokenizer(tok, os.path.join(out, "tokenizer.json"), make_fixture.CORPUS + "<|beginoftext|>x<|mask|>")
    fixture_common.write_json_files(out, {
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": special_tokens_map(),
        "generation_config.json": generation_config(),
        "config.json": model_config(),
    })

    print("weights")
    rng = np.random.Generator(np.random.PCG64(args.seed))
    weights, eos_boost, eos_share = boost_eos(make_weights(rng), tok)
    fixture_common.write_checkpoint(out, weights, shard_of)

    params = dream_ref.load_checkpoint(out)
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    check_biases_matter(params, logits_prompts(tok)[1][1])
    print("logits goldens")
    write_text(os.path.join(out, "goldens", "logits.json"), to_json(logits_golden(params, tok)) + "\n")
    print("generate goldens")
    gen = generate_golden(params, tok)
    write_text(os.path.join(out, "goldens", "generate.json"), to_json(gen) + "\n")
    write_text(os.path.join(out, "chat_template_cases.json"), to_json(chat_cases(tok)) + "\n")
    write_text(
        os.path.join(out, "README.md"),
        README.format(
            seed=args.seed, hidden=HIDDEN, heads=N_HEADS, kv=N_KV_HEADS, layers=N_LAYERS, inter=INTERMEDIATE,
            vocab=VOCAB_SIZE, theta=ROPE_THETA, n_ord=N_ORDINARY, last_ord=N_ORDINARY - 1,
            eos=EOS_ID, im_start=IM_START_ID, im_end=IM_END_ID, bos=BOS_ID, mask=MASK_ID,
            fim_prefix=FIM_PREFIX_ID, fim_suffix=FIM_SUFFIX_ID, first_empty=FIM_SUFFIX_ID + 1, last_row=VOCAB_SIZE - 1,
            s_embed=STD["embed"], s_q=STD["q_proj"], s_v=STD["v_proj"], s_gate=STD["gate_proj"],
            s_down=STD["down_proj"], s_head=STD["lm_head"], s_qb=STD["q_bias"], s_kb=STD["k_bias"],
            s_vb=STD["v_bias"], s_norm=STD["norm_jitter"], eos_scale=EOS_HEAD_SCALE, mask_scale=MASK_HEAD_SCALE,
            floor=MARGIN_FLOOR, qfloor=QUOTA_FLOOR, case_table=case_table(gen),
            eos_boost=eos_boost, eos_share=eos_share,
        ),
    )
    fixture_common.report_size(out)


if __name__ == "__main__":
    main()
