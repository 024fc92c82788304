"""Build the tiny LLaDA-format test fixture under tests/fixtures/tiny/.

Everything is derived from one seed (default 0):

* tokenizer.json: byte-level BPE (300 ordinary tokens) trained on the built-in corpus
  below, followed by the six LLaDA special tokens;
* tokenizer_config.json (with the LLaDA-Instruct chat template), special_tokens_map.json,
  generation_config.json, config.json (the LLaDA key layout);
* random bf16 weights in two safetensors shards plus model.safetensors.index.json;
* goldens/logits.json and goldens/generate.json from tools/llada_ref.py;
* chat_template_cases.json.

The tokenizer training, safetensors and JSON writers and the golden-case search it shares
with tools/make_dream_fixture.py are in tools/fixture_common.py.

Usage: tools/.venv/bin/python tools/make_fixture.py [--seed 0] [--out tests/fixtures/tiny]
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_common  # noqa: E402
import llada_common  # noqa: E402
import llada_ref  # noqa: E402
from fixture_common import MARGIN_FLOOR, Floats, to_json, write_text  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "tiny")

N_ORDINARY = 300
SPECIAL_TOKENS = llada_common.SPECIAL_TOKENS
BOS_ID, EOS_ID, SHI_ID, EHI_ID, EOT_ID, MASK_ID = range(N_ORDINARY, N_ORDINARY + 6)
VOCAB_SIZE = 320  # multiple of 64 above 306 tokens; rows 306..319 have no token

D_MODEL, N_HEADS, N_KV_HEADS, N_LAYERS, MLP_HIDDEN = 64, 4, 2, 2, 96

# Standard deviations of the random weights.  The q/k projections are larger than the
# other matrices so that attention is far from uniform (positional and RoPE errors then
# change the logits clearly); the MLP and output matrices are large enough for every
# sub-layer to move the residual stream; the LM head is wide so that argmax decisions
# have clear margins.
STD = {
    "wte": 0.3,
    "q_proj": 0.25,
    "k_proj": 0.25,
    "v_proj": 0.1,
    "attn_out": 0.1,
    "ff_proj": 0.2,
    "up_proj": 0.2,
    "ff_out": 0.05,
    "lm_head": 0.5,
    "norm_jitter": 0.1,  # norm weights are 1 + N(0, 0.1)
}
# The LM-head rows of EOS and EoT get this multiple of the std, so that (as with the
# real model) those tokens win the argmax at some positions and the EOS options of the
# sampler have something to act on.
EOS_EOT_HEAD_SCALE = 1.3
# The LM-head row of the mask token is scaled down by this factor: a trained model never
# predicts the mask token, and a committed mask id would leave a hole in the output.
MASK_HEAD_SCALE = 0.1

CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)

CORPUS = """\
The cat sat on the mat. The dog ran in the park.
A bird can fly over the tall green trees.
It is a sunny day, and the children play outside.
She reads a book every night before she goes to sleep.
He drinks a cup of tea with milk in the morning.
We walked to the station and took the early train.
The river flows past the old mill and into the sea.
They planted tomatoes, beans and potatoes in the garden.
My brother likes to cook pasta for the whole family.
The library opens at nine and closes at five.
Please close the door when you leave the room.
The weather today is cold, wet and windy.
I have two apples, three pears and one orange.
Our teacher asked us to write a short story about a dragon.
The moon rises in the east and sets in the west.
Water boils at one hundred degrees.
The shop sells bread, cheese, fruit and fresh fish.
Can you help me carry these boxes to the car?
The meeting starts at 10:30 and ends at 12:00.
There are 7 days in a week and 12 months in a year.
The train leaves at 8:15 from platform 4.
In 2024 the town had 15,000 people.
The price of the book is 12 dollars and 50 cents.
She ran 5 kilometres in 27 minutes.
Question: What is 2 + 3?
Answer: 2 + 3 = 5.
Question: What is 7 times 8?
Answer: 7 times 8 is 56.
Question: What is 100 minus 37?
Answer: 100 minus 37 is 63.
Question: How many legs does a spider have?
Answer: A spider has 8 legs.
Question: What is the capital of France?
Answer: The capital of France is Paris.
Question: What colour is the sky on a clear day?
Answer: The sky is blue on a clear day.
Question: Which is larger, 9 or 12?
Answer: 12 is larger than 9.
Question: If Tom has 4 apples and eats 1, how many are left?
Answer: Tom has 3 apples left.
Question: What is the square root of 81?
Answer: The square root of 81 is 9.
Question: How many hours are in a day?
Answer: There are 24 hours in a day.
Question: Who wrote the letter?
Answer: The letter was written by my grandmother.
Question: What do bees make?
Answer: Bees make honey and wax.
User: Hello, how are you?
Assistant: I am fine, thank you. How can I help you today?
User: Tell me a fun fact.
Assistant: Octopuses have three hearts and blue blood.
User: Can you add 15 and 27?
Assistant: Sure. 15 + 27 = 42.
User: Write one sentence about the sea.
Assistant: The sea is wide, deep and full of life.
You are a helpful assistant. Answer the question in one short sentence.
Think step by step, then give the final answer.
The first step is to read the problem carefully.
Next, we write down what we know and what we need to find.
Then we solve the problem and check the answer.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.
Counting by tens: 10, 20, 30, 40, 50, 60, 70, 80, 90, 100.
Simple sums: 1 + 1 = 2, 2 + 2 = 4, 3 + 3 = 6, 4 + 4 = 8, 5 + 5 = 10.
The quick brown fox jumps over the lazy dog.
A small boat sails across the quiet lake at dawn.
Good morning! Good night! Thank you very much.
The computer program prints hello world on the screen.
Rain is water that falls from the clouds in the sky.
Every student must bring a pencil, a ruler and a notebook.
"""

# the saved tokenizer.json must encode this as the trained tokenizer does
TOKENIZER_PROBE = CORPUS + "<|startoftext|>x<|mdm_mask|>"

GENERATE_QUESTIONS = [
    "What is 2 + 3?",
    "How many legs does a spider have?",
    "Tell me a fun fact.",
    "What is the capital of France?",
    "Can you add 15 and 27?",
    "Write one sentence about the sea.",
    "What do bees make?",
    "Which is larger, 9 or 12?",
    "How many hours are in a day?",
    "What colour is the sky?",
    "Who wrote the letter?",
    "Hello, how are you?",
    "What is 7 times 8?",
    "Name three fruits.",
    "Where does the river flow?",
    "When does the train leave?",
]

# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------


def build_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fixture_common.train_bpe(tok, CORPUS.splitlines(), N_ORDINARY)
    fixture_common.add_special_tokens(tok, SPECIAL_TOKENS, N_ORDINARY)
    return tok


def render_chat(messages, bos_token="<|startoftext|>"):
    """The LLaDA-Instruct chat template (llada.md 3.2) as plain Python.

    BOS before the first message only; content stripped of surrounding whitespace
    (Jinja `trim`); the assistant header is always appended.
    """
    out = []
    for idx, m in enumerate(messages):
        content = "<|start_header_id|>" + m["role"] + "<|end_header_id|>\n\n" + m["content"].strip() + "<|eot_id|>"
        if idx == 0:
            content = bos_token + content
        out.append(content)
    out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


# ---------------------------------------------------------------------------
# config files
# ---------------------------------------------------------------------------


def model_config():
    """config.json with every key of the LLaDA-8B-Instruct config, in the same order."""
    return {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            "AutoModel": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": D_MODEL,
        "embedding_dropout": 0.0,
        "embedding_size": VOCAB_SIZE,
        "eos_token_id": EOS_ID,
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": MASK_ID,
        "max_sequence_length": 256,
        "mlp_hidden_size": MLP_HIDDEN,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": N_HEADS,
        "n_kv_heads": N_KV_HEADS,
        "n_layers": N_LAYERS,
        "pad_token_id": EOS_ID,
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": VOCAB_SIZE,
        "weight_tying": False,
    }


def tokenizer_config(special_ids=None):
    """tokenizer_config.json as in LLaDA-8B-Instruct.  special_ids: the ids of
    SPECIAL_TOKENS in order (default: this fixture's, after the ordinary tokens);
    tools/export.py passes those of a trained tokenizer."""
    if special_ids is None:
        special_ids = range(N_ORDINARY, N_ORDINARY + len(SPECIAL_TOKENS))
    decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in zip(special_ids, SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": decoder,
        "bos_token": "<|startoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "fast_tokenizer": True,
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map():
    def entry(t):
        return {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

    return {"bos_token": entry("<|startoftext|>"), "eos_token": entry("<|endoftext|>"), "pad_token": entry("<|endoftext|>")}


def generation_config():
    return {"_from_model_config": True, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "transformers_version": "4.38.2"}


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------


def make_weights(rng, dims=None, stds=None, ids=None):
    """name -> float32 array (values drawn in float32 order, then rounded to bf16).

    dims = (d_model, n_heads, n_kv_heads, n_layers, mlp_hidden, vocab), stds the standard
    deviations and ids = (eos, eot, mask); the defaults are this fixture's
    (tools/make_wide_head_fixture.py passes its own)."""
    D, H, Hkv, L, F, V = dims or (D_MODEL, N_HEADS, N_KV_HEADS, N_LAYERS, MLP_HIDDEN, VOCAB_SIZE)
    stds = stds or STD
    eos_id, eot_id, mask_id = ids or (EOS_ID, EOT_ID, MASK_ID)
    kv = Hkv * (D // H)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_w():
        return (1.0 + rng.standard_normal(D) * stds["norm_jitter"]).astype(np.float32)

    w = {"model.transformer.wte.weight": normal((V, D), stds["wte"])}
    for i in range(L):
        p = f"model.transformer.blocks.{i}."
        w[p + "attn_norm.weight"] = norm_w()
        w[p + "q_proj.weight"] = normal((D, D), stds["q_proj"])
        w[p + "k_proj.weight"] = normal((kv, D), stds["k_proj"])
        w[p + "v_proj.weight"] = normal((kv, D), stds["v_proj"])
        w[p + "attn_out.weight"] = normal((D, D), stds["attn_out"])
        w[p + "ff_norm.weight"] = norm_w()
        w[p + "ff_proj.weight"] = normal((F, D), stds["ff_proj"])
        w[p + "up_proj.weight"] = normal((F, D), stds["up_proj"])
        w[p + "ff_out.weight"] = normal((D, F), stds["ff_out"])
    w["model.transformer.ln_f.weight"] = norm_w()
    head = normal((V, D), stds["lm_head"])
    head[eos_id] *= EOS_EOT_HEAD_SCALE
    head[eot_id] *= EOS_EOT_HEAD_SCALE
    head[mask_id] *= MASK_HEAD_SCALE
    w["model.transformer.ff_out.weight"] = head
    return {k: llada_ref.bf16_round(v) for k, v in w.items()}


def shard_of(name):
    """Two shards; every block is split across both, so loading must follow the index."""
    first = (
        name in ("model.transformer.wte.weight", "model.transformer.ln_f.weight")
        or name.endswith((".attn_out.weight", ".attn_norm.weight", ".q_proj.weight"))
        or name == "model.transformer.blocks.0.k_proj.weight"
    )
    return 1 if first else 2


# ---------------------------------------------------------------------------
# goldens
# ---------------------------------------------------------------------------


def logits_case(params, name, ids):
    """One logits golden: the float32 and bf16-rounding paths' logits of `ids`."""
    lf = llada_ref.forward(params, ids, bf16_rounding=False)
    lb = llada_ref.forward(params, ids, bf16_rounding=True)
    top2 = np.sort(lf, axis=-1)[:, -2:]
    return {
        "name": name,
        "ids": [int(i) for i in ids],
        "shape": [int(lf.shape[0]), int(lf.shape[1])],
        "argmax_f32": [int(i) for i in np.argmax(lf, axis=-1)],
        "min_top2_gap_f32": float(np.min(top2[:, 1] - top2[:, 0])),
        "max_abs_diff_f32_vs_bf16": float(np.max(np.abs(lf - lb))),
        "logits_f32": [Floats(row) for row in lf],
        "logits_bf16": [Floats(row, "f32") for row in lb],
    }


def logits_golden(params, tok):
    cases = [logits_case(params, name, ids) for name, ids in fixture_common.logits_prompts(tok, BOS_ID, MASK_ID)]
    return {
        "description": (
            "Golden logits of tools/llada_ref.py forward() on the fixture checkpoint. "
            "logits_f32: float32 storage after every operation (float64 accumulation), "
            "logits_bf16: bf16 rounding at the reference points of llada.md 2.5. "
            "logits_f32 values are written with 7 significant digits; logits_bf16 values are "
            "written exactly (shortest decimal that parses to the same float32). Each row has "
            "embedding_size entries."
        ),
        "vocab_size": VOCAB_SIZE,
        "cases": cases,
    }


CASE_SPECS = [
    ("a_nonblock", "pure diffusion: one block of 16, 16 steps, one token per step",
     dict(gen_length=16, steps=16, block_length=16)),
    ("b_blocks", "4 blocks of 4, 2 steps per block, 2 tokens per step",
     dict(gen_length=16, steps=8, block_length=4)),
    ("c_remainders", "12 masks in 5 steps: quotas 3,3,2,2,2",
     dict(gen_length=12, steps=5, block_length=12)),
    ("d_random", "random remasking; confidences are the stored random_confidences",
     dict(gen_length=16, steps=8, block_length=8, remasking="random", seed=7)),
    ("e_cfg", "classifier-free guidance, cfg_scale 1.0",
     dict(gen_length=16, steps=16, block_length=8, cfg_scale=1.0)),
    ("f_threshold", "Fast-dLLM threshold 0.5 decoding, 2 blocks of 8 (steps is unused)",
     dict(gen_length=16, steps=16, block_length=8, threshold=0.5)),
    ("g_logits_eos_inf", "EOS logit set to -inf before the argmax",
     dict(gen_length=16, steps=16, block_length=16, logits_eos_inf=True)),
    ("h_confidence_eos_eot_inf", "EOS and EoT removed from the confidence softmax after the argmax",
     dict(gen_length=16, steps=16, block_length=16, confidence_eos_eot_inf=True)),
]


def full_params(p):
    out = {
        "gen_length": p["gen_length"],
        "steps": p["steps"],
        "block_length": p["block_length"],
        "temperature": 0.0,
        "remasking": p.get("remasking", "low_confidence"),
        "cfg_scale": float(p.get("cfg_scale", 0.0)),
        "threshold": p.get("threshold"),
        "logits_eos_inf": bool(p.get("logits_eos_inf", False)),
        "confidence_eos_eot_inf": bool(p.get("confidence_eos_eot_inf", False)),
        "seed": int(p.get("seed", 0)),
        "mask_id": MASK_ID,
        "eos_id": EOS_ID,
        "eot_id": EOT_ID,
    }
    return out


def run_case(params, prompt, fp, rng_uniform=None):
    return llada_ref.generate(
        params,
        prompt,
        fp["gen_length"],
        fp["steps"],
        fp["block_length"],
        temperature=fp["temperature"],
        cfg_scale=fp["cfg_scale"],
        remasking=fp["remasking"],
        mask_id=fp["mask_id"],
        logits_eos_inf=fp["logits_eos_inf"],
        confidence_eos_eot_inf=fp["confidence_eos_eot_inf"],
        eos_id=fp["eos_id"],
        eot_id=fp["eot_id"],
        threshold=fp["threshold"],
        seed=fp["seed"],
        rng_uniform=rng_uniform,
    )


def case_is_interesting(name, params, prompt, fp, out, trace):
    """Extra conditions so that each option really changes something."""
    if MASK_ID in list(out[len(prompt):]):
        return False
    if name == "f_threshold":
        sizes = [len(s["committed"]) for s in trace]
        forced = any(
            len(s["committed"]) == 1 and s["conf_margin"] < math.inf for s in trace
        )
        return len(trace) < fp["gen_length"] and max(sizes) >= 3 and forced and 1 in sizes
    if name in ("e_cfg", "g_logits_eos_inf", "h_confidence_eos_eot_inf"):
        base = dict(fp, cfg_scale=0.0, logits_eos_inf=False, confidence_eos_eot_inf=False)
        out0, trace0 = run_case(params, prompt, base)
        same = [s["committed"] for s in trace0] == [s["committed"] for s in trace] and list(out0) == list(out)
        if same:
            return False
        if name == "g_logits_eos_inf":
            return EOS_ID in list(out0[len(prompt):])
        if name == "h_confidence_eos_eot_inf":
            gen = list(out[len(prompt):])
            return EOS_ID in gen or EOT_ID in gen
    return True


def generate_golden(params, tok):
    prompts = [tok.encode(render_chat([{"role": "user", "content": q}]), add_special_tokens=False).ids for q in GENERATE_QUESTIONS]
    cases = []
    for ci, (name, desc, spec) in enumerate(CASE_SPECS):
        fp = full_params(spec)
        chosen = None
        # start each case at a different question so the cases do not share prompts
        for k in range(len(prompts)):
            qi = (ci + k) % len(prompts)
            r = fixture_common.try_case(run_case, case_is_interesting, params, name, prompts[qi], fp)
            if r is not None:
                chosen = (qi,) + r
                break
        if chosen is None:
            raise RuntimeError(f"no prompt satisfies case {name}")
        qi, out, trace, cm, lm = chosen
        case = {
            "name": name,
            "description": desc,
            "question": GENERATE_QUESTIONS[qi],
            "prompt": [int(i) for i in prompts[qi]],
            "params": fp,
            "output": [int(i) for i in out],
            "steps": [
                {"block": s["block"], "step": s["step"], "committed": s["committed"], "tokens": s["tokens"]}
                for s in trace
            ],
            "random_confidences": (
                [Floats(s["uniforms"], "%.9g") for s in trace] if fp["remasking"] == "random" else None
            ),
            "min_margin": cm,
            "min_logit_margin": lm,
            "zero_tie_steps": sum(1 for s in trace if s["zero_tie"]),
        }
        cases.append(case)
        print(f"  {name}: prompt {len(prompts[qi])} tokens, {len(trace)} steps, min_margin {cm:.3g}, min_logit_margin {lm:.3g}")
    return {
        "description": (
            "Golden outputs of tools/llada_ref.py generate() (temperature 0, float32 forward "
            "without bf16 rounding, float64 softmax confidences) on the fixture checkpoint. "
            "output is the whole sequence (prompt + generated). steps lists, per denoising "
            "step in order, the committed positions (ascending, absolute indices) and the "
            "tokens written there. Top-k ties go to the lowest position. random_confidences "
            "(random remasking only) holds, per step, the float32 confidence of every one of "
            "the T positions; they were drawn as float32(Generator(PCG64(seed)).random(T)). "
            "min_margin: smallest gap between a committed confidence and the best "
            "non-committed one (threshold mode: distance to the threshold); min_logit_margin: "
            "smallest top-1 minus top-2 logit gap at any candidate position's argmax; "
            "zero_tie_steps: steps whose top-k boundary fell among exactly-zero confidences "
            "(confidence_eos_eot_inf), which the lowest-position rule decides."
        ),
        "cases": cases,
    }


def chat_cases(tok):
    convs = [
        ("one_turn", [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "  What is 2 + 3?\n"},
        ]),
        ("three_turns", [
            {"role": "system", "content": "\tAnswer in one short sentence. "},
            {"role": "user", "content": "Hello, how are you?"},
            {"role": "assistant", "content": "I am fine, thank you.\n\n"},
            {"role": "user", "content": " Can you add 15 and 27? "},
        ]),
        ("spec_example_hi", [{"role": "user", "content": "Hi"}]),
    ]
    out = []
    for name, msgs in convs:
        text = render_chat(msgs)
        enc = tok.encode(text, add_special_tokens=False)
        out.append(
            {
                "name": name,
                "messages": msgs,
                "rendered": text,
                "ids": [int(i) for i in enc.ids],
                "decoded_skip_special": tok.decode(enc.ids, skip_special_tokens=True),
            }
        )
    return {
        "description": (
            "LLaDA-Instruct chat template rendered by a plain implementation of its rules "
            "(BOS before the first message only, content trimmed, assistant header always "
            "appended) and encoded with the fixture tokenizer, add_special_tokens=False. "
            "decoded_skip_special is tokenizer.decode(ids, skip_special_tokens=True)."
        ),
        "bos_token": "<|startoftext|>",
        "cases": out,
    }


README = """\
# Tiny LLaDA fixture

A 2-layer LLaDA-format checkpoint with random weights, a byte-level BPE tokenizer and
golden outputs of an independent numpy reference. The Rust tests read these files;
they never run Python.

Made with (from the repository root):

    python3 -m venv tools/.venv
    tools/.venv/bin/pip install -r tools/requirements.txt
    tools/.venv/bin/python tools/make_fixture.py --seed {seed}
    tools/.venv/bin/python tools/check_fixture.py

`make_fixture.py` is deterministic for a given seed; `check_fixture.py` reloads every
file, re-runs the reference (`tools/llada_ref.py`) and compares it with the goldens.

## Files

| file | what |
|---|---|
| `config.json` | every key of the LLaDA-8B-Instruct config; d_model 64, 4 heads, 2 KV heads (GQA), 2 layers, mlp_hidden_size 96, vocab_size = embedding_size = {vocab}, rope_theta 500000 |
| `model-0000{{1,2}}-of-00002.safetensors`, `model.safetensors.index.json` | bf16 weights with the HF tensor names; each block is split over both shards, so load by the index |
| `tokenizer.json` | byte-level BPE, {n_ord} ordinary tokens (ids 0..{last_ord}) then the special tokens below; no post-processor (nothing is added by `add_special_tokens`) |
| `tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json` | as in the LLaDA-Instruct repository, with this fixture's ids; the chat template is the LLaDA-Instruct one verbatim |
| `chat_template_cases.json` | rendered chat prompts and their token ids |
| `goldens/logits.json` | logits [T, {vocab}] for three prompts (lengths 5, 12, 23; the last has mask tokens), float32 path and bf16-rounding path |
| `goldens/generate.json` | sampler cases (blocks, remainders, random remasking, CFG, threshold, EOS flags) with per-step committed positions |

## Token ids

| id | token |
|---|---|
| {bos} | `<|startoftext|>` (BOS) |
| {eos} | `<|endoftext|>` (EOS = PAD) |
| {shi} | `<|start_header_id|>` |
| {ehi} | `<|end_header_id|>` |
| {eot} | `<|eot_id|>` (EoT) |
| {mask} | `<|mdm_mask|>` (mask) |
| {first_empty}..{last_row} | embedding rows without a token |

## Weights

Normal random values rounded to bf16, with standard deviations chosen so that attention
is far from uniform and every sub-layer moves the residual stream: embedding {swte},
q_proj/k_proj {sq}, v_proj/attn_out {sv}, ff_proj/up_proj {sf}, blocks.ff_out {sfo}, LM head
{sh}. The LM-head rows of EOS and EoT are {scale}x larger, so those tokens win some
argmaxes; the mask row is {mscale}x smaller, so the mask token is never predicted. Norm
weights are 1 + N(0, {sn}). Rows {first_empty}..{last_row} have weights but no token; they
still produce logits and can win an argmax, so nothing may truncate the logits to the
tokenizer's size.

## Numerics of the goldens

`logits_f32` stores every intermediate as float32 (computed in float64); `logits_bf16`
rounds to bf16 at the points of the PyTorch bf16 reference. The generate goldens use the
float32 path and float64 softmax confidences; each case records `min_margin` and
`min_logit_margin` (all are >= {floor:g}), so an f32 implementation decides every step the
same way. With `confidence_eos_eot_inf`, positions whose argmax is EOS or EoT get a
confidence of exactly 0; ties among them go to the lowest position (`zero_tie_steps`
counts the steps where that rule decided the commit).
"""


def main():
    args = fixture_common.maker_args(__doc__.splitlines()[0], DEFAULT_OUT)
    out = args.out

    print("tokenizer")
    tok = build_tokenizer()
    fixture_common.save_tokenizer(tok, os.path.join(out, "tokenizer.json"), TOKENIZER_PROBE)
    fixture_common.write_json_files(out, {
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": special_tokens_map(),
        "generation_config.json": generation_config(),
        "config.json": model_config(),
    })

    print("weights")
    rng = np.random.Generator(np.random.PCG64(args.seed))
    fixture_common.write_checkpoint(out, make_weights(rng), shard_of)

    params = llada_ref.load_checkpoint(out)
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    print("logits goldens")
    write_text(os.path.join(out, "goldens", "logits.json"), to_json(logits_golden(params, tok)) + "\n")
    print("generate goldens")
    write_text(os.path.join(out, "goldens", "generate.json"), to_json(generate_golden(params, tok)) + "\n")
    write_text(os.path.join(out, "chat_template_cases.json"), to_json(chat_cases(tok)) + "\n")
    write_text(
        os.path.join(out, "README.md"),
        README.format(
            seed=args.seed, vocab=VOCAB_SIZE, n_ord=N_ORDINARY, last_ord=N_ORDINARY - 1,
            bos=BOS_ID, eos=EOS_ID, shi=SHI_ID, ehi=EHI_ID, eot=EOT_ID, mask=MASK_ID,
            first_empty=MASK_ID + 1, last_row=VOCAB_SIZE - 1,
            swte=STD["wte"], sq=STD["q_proj"], sv=STD["v_proj"], sf=STD["ff_proj"], sfo=STD["ff_out"],
            sh=STD["lm_head"], floor=MARGIN_FLOOR,
            scale=EOS_EOT_HEAD_SCALE, mscale=MASK_HEAD_SCALE, sn=STD["norm_jitter"],
        ),
    )
    fixture_common.report_size(out)


if __name__ == "__main__":
    main()
