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
with tools/make_fixture.py are in tools/fixture_common.py.

Usage: tools/.venv/bin/python tools/make_dream_fixture.py [--seed 0] [--out tests/fixtures/tiny-dream]
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_common  # noqa: E402
import dream_ref  # noqa: E402
import fixture_common  # noqa: E402
import llada_ref  # noqa: E402
import make_fixture  # noqa: E402
from fixture_common import MARGIN_FLOOR, Floats, encode, to_json, write_text  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "tiny-dream")

N_ORDINARY = make_fixture.N_ORDINARY  # 300
SPECIAL_TOKENS = [
    "<|endoftext|>",  # EOS = PAD
    "<|im_start|>",
    "<|im_end|>",
    "<|beginoftext|>",  # BOS
    "<|mask|>",  # mask
    "<|fim_prefix|>",
    "<|fim_suffix|>",
]
EOS_ID, IM_START_ID, IM_END_ID, BOS_ID, MASK_ID, FIM_PREFIX_ID, FIM_SUFFIX_ID = range(N_ORDINARY, N_ORDINARY + 7)
PAD_ID = EOS_ID
VOCAB_SIZE = 320  # rows 307..319 have no token

HIDDEN, N_HEADS, N_KV_HEADS, N_LAYERS, INTERMEDIATE = 64, 4, 2, 2, 96
ROPE_THETA = 10000.0

# Qwen2's pre-tokenizer regex (digits one by one, letters with one leading non-letter)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

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

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_SYSTEM = "You are a helpful assistant."

QUOTA_FLOOR = 1e-4  # num_masked * (1 - s/t) must be this far from an integer
EPS = 1e-3

# ---------------------------------------------------------------------------
# tokenizer and chat template
# ---------------------------------------------------------------------------


def build_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    fixture_common.train_bpe(tok, make_fixture.CORPUS.splitlines(), N_ORDINARY)
    # the ByteLevel parts as Qwen2 writes them (trim_offsets only affects offsets)
    data = json.loads(tok.to_str())
    data["pre_tokenizer"]["pretokenizers"][1]["trim_offsets"] = False
    data["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tok = Tokenizer.from_str(json.dumps(data))
    fixture_common.add_special_tokens(tok, SPECIAL_TOKENS, N_ORDINARY)
    return tok


def system_turn(messages):
    """The rendered system turn every ChatML prompt starts with."""
    content = messages[0]["content"] if messages and messages[0]["role"] == "system" else DEFAULT_SYSTEM
    return "<|im_start|>system\n" + content + "<|im_end|>\n"


def render_chat(messages, add_generation_prompt=True):
    """Dream's chat template as plain Python: the default system turn when the first
    message is not a system message; contents are not stripped."""
    out = []
    if messages and messages[0]["role"] != "system":
        out.append(system_turn([]))
    for m in messages:
        out.append("<|im_start|>" + m["role"] + "\n" + m["content"] + "<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def render_jinja(messages, add_generation_prompt=True):
    """The template string rendered as transformers does (sandboxed jinja2)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def prefix_info(tok, messages, ids):
    """Byte length and token count of the rendered system turn, which is a token prefix."""
    prefix = system_turn(messages)
    pids = encode(tok, prefix)
    if ids[: len(pids)] != pids:
        raise RuntimeError("the system turn is not a token prefix of the prompt")
    return {"bytes": len(prefix.encode("utf-8")), "tokens": len(pids)}


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


def make_weights(rng):
    """name -> float32 array (drawn in float32 order, then rounded to bf16)."""
    D, F, V = HIDDEN, INTERMEDIATE, VOCAB_SIZE
    kv = N_KV_HEADS * (HIDDEN // N_HEADS)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_w():
        return (1.0 + rng.standard_normal(D) * STD["norm_jitter"]).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((V, D), STD["embed"])}
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_w()
        w[p + "self_attn.q_proj.weight"] = normal((D, D), STD["q_proj"])
        w[p + "self_attn.q_proj.bias"] = normal((D,), STD["q_bias"])
        w[p + "self_attn.k_proj.weight"] = normal((kv, D), STD["k_proj"])
        w[p + "self_attn.k_proj.bias"] = normal((kv,), STD["k_bias"])
        w[p + "self_attn.v_proj.weight"] = normal((kv, D), STD["v_proj"])
        w[p + "self_attn.v_proj.bias"] = normal((kv,), STD["v_bias"])
        w[p + "self_attn.o_proj.weight"] = normal((D, D), STD["o_proj"])
        w[p + "post_attention_layernorm.weight"] = norm_w()
        w[p + "mlp.gate_proj.weight"] = normal((F, D), STD["gate_proj"])
        w[p + "mlp.up_proj.weight"] = normal((F, D), STD["up_proj"])
        w[p + "mlp.down_proj.weight"] = normal((D, F), STD["down_proj"])
    w["model.norm.weight"] = norm_w()
    head = normal((V, D), STD["lm_head"])
    head[EOS_ID] *= EOS_HEAD_SCALE
    head[IM_END_ID] *= EOS_HEAD_SCALE
    head[MASK_ID] *= MASK_HEAD_SCALE
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
# goldens: logits
# ---------------------------------------------------------------------------


def logits_prompts(tok):
    return fixture_common.logits_prompts(tok, BOS_ID, MASK_ID)


N_LEFT_PAD = 4


def logits_case(name, ids, logits):
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return {
        "name": name,
        "ids": [int(i) for i in ids],
        "shape": [int(logits.shape[0]), int(logits.shape[1])],
        "argmax_f32": [int(i) for i in np.argmax(logits, axis=-1)],
        "min_top2_gap_f32": float(np.min(top2[:, 1] - top2[:, 0])),
        "logits_f32": [Floats(row) for row in logits],
    }


def logits_golden(params, tok):
    cases, by_name = [], {}
    for name, ids in logits_prompts(tok):
        lf = dream_ref.forward(params, ids)
        by_name[name] = lf
        cases.append(logits_case(name, ids, lf))
    ids = logits_prompts(tok)[1][1]
    padded = [PAD_ID] * N_LEFT_PAD + ids
    am = [0] * N_LEFT_PAD + [1] * len(ids)
    lp = dream_ref.forward(params, padded, am)[N_LEFT_PAD:]
    diff = np.max(np.abs(lp.astype(np.float64) - by_name["len12_bos"]) / np.maximum(1.0, np.abs(lp)))
    print(f"  left_padded vs len12_bos: max relative difference {diff:.3g}")
    if diff > 1e-6:
        raise RuntimeError("the left-padded forward differs from the unpadded one")
    case = logits_case("left_padded", ids, lp)
    case = dict(list(case.items())[:2] + [("padded_ids", padded), ("attention_mask", am)] + list(case.items())[2:])
    cases.append(case)
    return {
        "description": (
            "Golden logits of tools/dream_ref.py forward() on the fixture checkpoint: the "
            "unshifted model output, row i = output at position i (the sampler reads the "
            "prediction for position i from row i-1, row 0 for position 0). Float32 storage "
            "after every operation, float64 accumulation; values written with 7 significant "
            "digits. Each row has vocab_size entries. left_padded: padded_ids (the len12_bos "
            "ids after 4 pad tokens) run with attention_mask (positions cumsum(mask)-1, pad "
            "keys masked out); logits_f32 holds only the rows of the real tokens and equals "
            "len12_bos within float32 rounding."
        ),
        "vocab_size": VOCAB_SIZE,
        "cases": cases,
    }


# ---------------------------------------------------------------------------
# goldens: generate
# ---------------------------------------------------------------------------

CASE_SPECS = [
    ("a_maskgit_plus", "original schedule, maskgit_plus (max probability), 16 steps for 16 tokens",
     dict(gen_length=16, steps=16, block_length=16, alg="maskgit_plus")),
    ("b_topk_margin", "original schedule, topk_margin (top1 - top2 probability), 8 steps",
     dict(gen_length=16, steps=8, block_length=16, alg="topk_margin")),
    ("c_entropy", "original schedule, entropy (negative entropy), 5 steps",
     dict(gen_length=16, steps=5, block_length=16, alg="entropy")),
    ("d_origin", "original schedule, origin: each masked position is committed when its draw < 1 - s/t",
     dict(gen_length=16, steps=8, block_length=16, alg="origin", seed=7)),
    ("e_alg_temp", "original schedule, maskgit_plus with alg_temp 0.5: positions sampled from softmax(conf/0.5)",
     dict(gen_length=16, steps=8, block_length=16, alg="maskgit_plus", alg_temp=0.5, seed=11)),
    ("f_blocks_entropy", "block schedule: 2 blocks of 8, 4 steps per block, entropy",
     dict(gen_length=16, steps=8, block_length=8, alg="entropy")),
    ("g_blocks_maskgit", "block schedule: 4 blocks of 4, 2 steps per block, maskgit_plus",
     dict(gen_length=16, steps=8, block_length=4, alg="maskgit_plus")),
    ("h_threshold", "block schedule with a confidence threshold: 2 blocks of 8 (steps only checked)",
     dict(gen_length=16, steps=16, block_length=8, alg="maskgit_plus", threshold=0.3)),
    ("i_long_shared_prefix", "original schedule, maskgit_plus, 32 steps for 32 tokens; the prompt "
     "continues case a's conversation, so case a's whole prompt is its prefix",
     dict(gen_length=32, steps=32, block_length=32, alg="maskgit_plus")),
    ("j_top_p", "original schedule, maskgit_plus with top_p 0.9: the confidence is the chosen "
     "token's share of its nucleus, 8 steps",
     dict(gen_length=16, steps=8, block_length=16, alg="maskgit_plus", top_p=0.9)),
    ("k_top_k_entropy", "original schedule, entropy over each row's top_k 3 tokens, 5 steps",
     dict(gen_length=16, steps=5, block_length=16, alg="entropy", top_k=3)),
]
THRESHOLD_CHOICES = [0.3, 0.25, 0.35, 0.2, 0.4, 0.5]
ANSWERS = ["5.", "It is 5.", "2 + 3 = 5.", "The answer is 5.", "Sure. 2 + 3 = 5."]


def full_params(p):
    return {
        "gen_length": p["gen_length"],
        "steps": p["steps"],
        "block_length": p["block_length"],
        "alg": p["alg"],
        "alg_temp": p.get("alg_temp"),
        "eps": EPS,
        "temperature": 0.0,
        "top_p": p.get("top_p"),
        "top_k": p.get("top_k"),
        "threshold": p.get("threshold"),
        "mask_id": MASK_ID,
        "eos_id": EOS_ID,
        "seed": int(p.get("seed", 0)),
    }


def run_case(params, prompt, fp, draws=None):
    return dream_ref.generate(
        params,
        prompt,
        fp["gen_length"],
        fp["steps"],
        block_length=fp["block_length"],
        alg=fp["alg"],
        alg_temp=fp["alg_temp"],
        eps=fp["eps"],
        temperature=fp["temperature"],
        top_p=fp["top_p"],
        top_k=fp["top_k"],
        threshold=fp["threshold"],
        mask_id=fp["mask_id"],
        seed=fp["seed"],
        draws=draws,
    )


def quota_f32(fp, num_masked, i, table_len, last):
    """The quota as Dream computes it in PyTorch (float32 timesteps and products)."""
    import torch

    ts = torch.linspace(1, fp["eps"], table_len)
    if last:
        return int(num_masked)
    num = torch.tensor(num_masked) / 1  # Dream: mask_index.sum() / batch size, float32
    return int(num * (1 - ts[i + 1] / ts[i]))


def quotas_are_robust(fp, trace):
    """float32 and float64 give the same quotas, and no product is near an integer."""
    for s in trace:
        if "quota_args" not in s:
            continue
        nm, i, table_len, last = s["quota_args"]
        if last:
            continue
        t64 = np.linspace(1.0, fp["eps"], table_len)
        v = nm * (1.0 - t64[i + 1] / t64[i])
        if abs(v - round(v)) < QUOTA_FLOOR:
            return False
        if quota_f32(fp, nm, i, table_len, last) != int(v):
            return False
    return True


def committed_list(trace):
    return [(s["committed"], s["tokens"]) for s in trace]


def case_is_interesting(name, params, prompt, fp, out, trace):
    """Extra conditions so that each option really changes something."""
    if MASK_ID in list(out[len(prompt):]):
        return False
    if not quotas_are_robust(fp, trace):
        return False
    if name in ("b_topk_margin", "c_entropy", "f_blocks_entropy", "e_alg_temp"):
        # the alg (or the sampling of positions) must decide differently from plain maskgit_plus
        base = dict(fp, alg="maskgit_plus", alg_temp=None)
        _, trace0 = run_case(params, prompt, base)
        if committed_list(trace0) == committed_list(trace):
            return False
    if fp["top_p"] is not None or fp["top_k"] is not None:
        # the cut must decide differently from the same alg without it, and a top_p must
        # not sit next to a nucleus boundary (the same trace at p within 0.1 %)
        _, trace0 = run_case(params, prompt, dict(fp, top_p=None, top_k=None))
        if committed_list(trace0) == committed_list(trace):
            return False
        if fp["top_p"] is not None:
            for q in (fp["top_p"] * 0.999, fp["top_p"] * 1.001):
                _, tq = run_case(params, prompt, dict(fp, top_p=q))
                if committed_list(tq) != committed_list(trace):
                    return False
    if name == "d_origin":
        # some step must commit part, but not all, of the masks
        partial = any(0 < len(s["committed"]) < len(s["draws"]) for s in trace if "draws" in s)
        return partial
    if name == "h_threshold":
        sizes = [len(s["committed"]) for s in trace if s["step"] > 0]
        forced = any(len(s["committed"]) == 1 and s["conf_margin"] < math.inf for s in trace if s["step"] > 0)
        return sum(1 for n in sizes if n >= 2) >= 2 and forced
    return True


def case_record(name, desc, messages, prompt, fp, out, trace, cm, lm, tok):
    steps = []
    for s in trace:
        st = {"block": s["block"], "step": s["step"], "committed": s["committed"], "tokens": s["tokens"]}
        if "draws" in s:
            st["draws"] = Floats(s["draws"], "f32")
        steps.append(st)
    return {
        "name": name,
        "description": desc,
        "messages": messages,
        "prompt": [int(i) for i in prompt],
        "system_prefix_tokens": prefix_info(tok, messages, list(prompt))["tokens"],
        "params": fp,
        "output": [int(i) for i in out],
        "steps": steps,
        "min_margin": cm,
        "min_logit_margin": lm,
    }


def generate_golden(params, tok):
    questions = make_fixture.GENERATE_QUESTIONS
    conv = {q: [{"role": "user", "content": q}] for q in questions}
    prompts = {q: encode(tok, render_chat(conv[q])) for q in questions}
    cases, by_name = [], {}
    for ci, (name, desc, spec) in enumerate(CASE_SPECS):
        chosen = None
        if name == "i_long_shared_prefix":
            qa = by_name["a_maskgit_plus"]["messages"][0]["content"]
            a_prompt = by_name["a_maskgit_plus"]["prompt"]
            fp = full_params(spec)
            for k in range(len(questions) * len(ANSWERS)):
                ans, q2 = ANSWERS[k % len(ANSWERS)], questions[(ci + k) % len(questions)]
                if q2 == qa:
                    continue
                msgs = [{"role": "user", "content": qa}, {"role": "assistant", "content": ans}, {"role": "user", "content": q2}]
                prompt = encode(tok, render_chat(msgs))
                if prompt[: len(a_prompt)] != a_prompt:
                    raise RuntimeError("case a's prompt is not a prefix of case i's")
                r = fixture_common.try_case(run_case, case_is_interesting, params, name, prompt, fp)
                if r is not None:
                    chosen = (msgs, prompt, fp) + r
                    break
        else:
            thresholds = THRESHOLD_CHOICES if "threshold" in spec else [None]
            seeds = [spec.get("seed", 0) + j for j in range(4)] if "seed" in spec else [0]
            for th in thresholds:
                for k in range(len(questions)):
                    q = questions[(ci + k) % len(questions)]  # each case starts at another question
                    for seed in seeds:
                        fp = full_params(dict(spec, seed=seed, threshold=th))
                        r = fixture_common.try_case(run_case, case_is_interesting, params, name, prompts[q], fp)
                        if r is not None:
                            chosen = (conv[q], prompts[q], fp) + r
                            break
                    if chosen:
                        break
                if chosen:
                    break
        if chosen is None:
            raise RuntimeError(f"no prompt satisfies case {name}")
        msgs, prompt, fp, out, trace, cm, lm = chosen
        case = case_record(name, desc, msgs, prompt, fp, out, trace, cm, lm, tok)
        if name == "i_long_shared_prefix":
            case = dict(
                list(case.items())[:5]
                + [("shared_prefix_with", "a_maskgit_plus"), ("shared_prefix_tokens", len(by_name["a_maskgit_plus"]["prompt"]))]
                + list(case.items())[5:]
            )
        if name == "h_threshold":
            case["description"] += f", threshold {fp['threshold']}"
        by_name[name] = case
        cases.append(case)
        sizes = [len(s["committed"]) for s in trace]
        gen = [int(t) for t in out[len(prompt):]]
        print(
            f"  {name}: prompt {len(prompt)} tokens, {len(trace)} steps, commits {sizes}, seed {fp['seed']}, "
            f"min_margin {cm:.3g}, min_logit_margin {lm:.3g}, eos {gen.count(EOS_ID)}, im_end {gen.count(IM_END_ID)}"
        )
    return {
        "description": (
            "Golden outputs of tools/dream_ref.py generate() (temperature 0, float32 forward, "
            "float64 softmax confidences, shifted logits) on the fixture checkpoint. prompt is "
            "the ChatML rendering of messages (Dream's template, add_generation_prompt) encoded "
            "without added special tokens; system_prefix_tokens counts the tokens of its system "
            "turn. output is the whole sequence (prompt + generated). steps lists every "
            "denoising step the reference ran, in order (one full-sequence forward each): "
            "block, step (block schedule: step 0 commits the block's first position with its "
            "argmax), committed (ascending absolute positions, possibly empty), tokens, and "
            "draws where the step used random numbers: float32(Generator(PCG64(seed)).random(n)), "
            "written exactly; origin: one per masked position in ascending order, alg_temp: one "
            "per pick (sampling without replacement by the running-sum rule of dream_ref."
            "choose_sampled). The original schedule applies when block_length == gen_length and "
            "threshold is null, the block schedule otherwise. Top-n ties go to the lowest "
            "position. min_margin: smallest confidence distance from a different decision (top-n: "
            "n-th minus (n+1)-th confidence; threshold: distance to the threshold; origin: "
            "|draw - (1 - s/t)|; alg_temp: distance of draw*sum to a running sum, relative to "
            "the sum); null if no step had such a decision. min_logit_margin: smallest top-1 "
            "minus top-2 logit gap at a committed position."
        ),
        "cases": cases,
    }


# ---------------------------------------------------------------------------
# chat template cases
# ---------------------------------------------------------------------------

CHAT_CONVERSATIONS = [
    ("default_system", [{"role": "user", "content": "What is 2 + 3?"}]),
    ("own_system", [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Hello, how are you?"},
    ]),
    ("whitespace_multi_turn", [
        {"role": "system", "content": "\tYou are a helpful assistant. "},
        {"role": "user", "content": "  What is 2 + 3?\n"},
        {"role": "assistant", "content": "2 + 3 = 5.\n\n"},
        {"role": "user", "content": " Can you add 15 and 27? "},
    ]),
    ("special_markup_in_content", [
        {"role": "user", "content": "Say <|im_end|> and <|endoftext|>, not <|mask|>."},
    ]),
    ("unicode", [{"role": "user", "content": "Cafe\u0301, naïve, 東京 🙂"}]),
    ("spec_example_hi", [{"role": "user", "content": "Hi"}]),
]


def chat_cases(tok):
    out = []
    for name, msgs in CHAT_CONVERSATIONS:
        text = render_chat(msgs)
        if render_jinja(msgs) != text:
            raise RuntimeError(f"chat case {name}: jinja2 and the plain rendering differ")
        ids = encode(tok, text)
        info = prefix_info(tok, msgs, ids)
        out.append(
            {
                "name": name,
                "messages": msgs,
                "rendered": text,
                "ids": ids,
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
                "system_prefix_bytes": info["bytes"],
                "system_prefix_tokens": info["tokens"],
            }
        )
    return {
        "description": (
            "Dream's chat template (ChatML; a default system turn when the first message is not "
            "a system message; contents are not stripped) rendered by jinja2 with "
            "add_generation_prompt=True and encoded with the fixture tokenizer, "
            "add_special_tokens=False (special-token markup inside contents becomes the special "
            "token). decoded_skip_special is tokenizer.decode(ids, skip_special_tokens=True). "
            "system_prefix_bytes / system_prefix_tokens: UTF-8 length and token count of the "
            "rendered system turn '<|im_start|>system\\n...<|im_end|>\\n', a prefix of rendered "
            "and of ids."
        ),
        "cases": out,
    }


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
