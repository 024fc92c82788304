"""Build the tiny DiffusionGemma fixture under tests/fixtures/tiny-dgemma/ with the
reference itself (transformers' DiffusionGemmaForBlockDiffusion, PyTorch, CPU, float32).

Everything follows from one seed (default 0):

* config.json (with text_config and a tiny vision_config), generation_config.json;
* random weights drawn by a seeded torch.Generator, rounded to bf16, loaded into the
  reference model, and written in bf16 with the names `save_pretrained` gives them (checked
  against it), vision tower left out, in two safetensors shards plus the index;
* tokenizer.json, tokenizer_config.json (chat template), special_tokens_map.json and
  chat_template_cases.json (tools/dgemma_tokenizer.py);
* goldens/logits.safetensors + goldens/logits.json: encoder, commit and decoder logits;
* goldens/generate.json: whole generations by the reference's `generate`, with every
  random draw it made and every step's outcome recorded (tools/dgemma_generate.py).

The goldens are what the reference computes; tools/dgemma_ref.py (numpy) reproduces them.

Usage: tools/.venv/bin/python tools/make_dgemma_fixture.py [--seed 0] [--out tests/fixtures/tiny-dgemma]
(needs torch and transformers >= 5.23; CI does not run it).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dgemma_common  # noqa: E402
import dgemma_generate  # noqa: E402
import dgemma_tokenizer as dtok  # noqa: E402
import fixture_common  # noqa: E402
import llada_ref  # noqa: E402
from dgemma_common import DEC, ENC_SCALAR, FULL, SLIDING  # noqa: E402
from fixture_common import encode, to_json, write_text  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "tiny-dgemma")

VOCAB, HIDDEN, INTERMEDIATE = 320, 48, 64
N_HEADS, HEAD_DIM, KV_HEADS = 4, 16, 2  # sliding layers
GLOBAL_HEAD_DIM, GLOBAL_KV_HEADS = 32, 1  # full layers
LAYER_TYPES = [SLIDING, FULL, SLIDING, FULL]
WINDOW = 8
N_EXPERTS, TOP_K, EXPERT_SIZE = 8, 2, 16
CANVAS = 16

# Standard deviations of the random weights.  Every sub-layer output is RMS-normed before
# it reaches the residual, so the projections' scales matter only inside the MLPs (gelu)
# and in the router, whose scores are made wide enough for a clear top-k.  The decoder's
# input is RMS-normed too; the post-norm gain below sets how much each sub-layer moves it,
# and the self-conditioning MLP how much the previous step does.  That MLP is kept weak
# (gate/up): a strong one amplifies a rounding difference from step to step until float32
# and float64 runs part (tools/dgemma_generate.py checks every case in float64).  With these
# values generations at the published settings converge in a few dozen steps.
STD = {
    "embed": 0.3, "q_proj": 0.2, "k_proj": 0.2, "v_proj": 0.2, "o_proj": 0.2,
    "gate": 0.25, "up": 0.25, "down": 0.25, "router": 2.0, "expert_gate_up": 0.25, "expert_down": 0.25,
    "sc_gate": 0.07, "sc_up": 0.07, "sc_down": 0.15, "norm_jitter": 0.15,
}
LAYER_SCALAR_RANGE = (0.8, 1.0)
PER_EXPERT_SCALE_RANGE = (0.5, 1.5)
FINAL_NORM_GAIN = 3.0  # the LM head is the embedding: the final norm gives the logits their spread
POST_NORM_GAIN = 0.5  # post_attention_layernorm and post_feedforward_layernorm


def text_config_kwargs():
    return dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=N_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        global_head_dim=GLOBAL_HEAD_DIM, num_global_key_value_heads=GLOBAL_KV_HEADS, layer_types=list(LAYER_TYPES),
        sliding_window=WINDOW, use_bidirectional_attention="vision", num_experts=N_EXPERTS,
        top_k_experts=TOP_K, moe_intermediate_size=EXPERT_SIZE, max_position_embeddings=1024,
        rope_parameters={k: dict(v) for k, v in dgemma_common.DEFAULT_ROPE.items()},
        pad_token_id=dtok.PAD_ID, bos_token_id=dtok.BOS_ID, eos_token_id=dtok.EOS_ID,
    )


def build_model():
    """The reference model (float32) with a tiny vision tower the fixture does not store."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
    from transformers import Gemma4VisionConfig

    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, global_head_dim=8)
    cfg = DiffusionGemmaConfig(text_config=DiffusionGemmaTextConfig(**text_config_kwargs()), vision_config=vision,
                               canvas_length=CANVAS, eos_token_id=[dtok.EOS_ID, dtok.TURN_END_ID])
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    return model


def make_weights(seed, shapes):
    """name -> float32 tensor (bf16-exact) for every text tensor, drawn from one seeded
    torch.Generator in the sorted order of the names."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=g) * std

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g)

    w = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.startswith("model.encoder."):
            continue  # the encoder's layer_scalar copies the decoder's (as the conversion does)
        if name.endswith("layer_scalar"):
            w[name] = uniform(shape, *LAYER_SCALAR_RANGE)
        elif name.endswith("per_expert_scale"):
            w[name] = uniform(shape, *PER_EXPERT_SCALE_RANGE)
        elif name == DEC + "norm.weight":
            w[name] = FINAL_NORM_GAIN * (1.0 + normal(shape, STD["norm_jitter"]))
        elif name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
            w[name] = POST_NORM_GAIN * (1.0 + normal(shape, STD["norm_jitter"]))
        elif name.endswith(("norm.weight", "layernorm.weight", "_1.weight", "_2.weight", "router.scale")):
            w[name] = 1.0 + normal(shape, STD["norm_jitter"])
        elif name.endswith("embed_tokens.weight"):
            w[name] = normal(shape, STD["embed"])
        else:
            key = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
                   "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down", "router.proj": "router",
                   "gate_up_proj": "expert_gate_up", "experts.down_proj": "expert_down",
                   "self_conditioning.gate_proj": "sc_gate", "self_conditioning.up_proj": "sc_up",
                   "self_conditioning.down_proj": "sc_down"}
            std = next(STD[v] for k, v in key.items() if k in name)
            w[name] = normal(shape, std)
    w = {k: torch.from_numpy(llada_ref.bf16_round(v.numpy())) for k, v in w.items()}
    for i in range(len(LAYER_TYPES)):
        w[ENC_SCALAR.format(i)] = w[f"{DEC}layers.{i}.layer_scalar"].clone()
    return w


def load_weights(model, w):
    """Copy the weights into the reference model; the encoder's tied parameters follow."""
    state = model.state_dict()
    with torch.no_grad():
        for name, value in w.items():
            if name not in state:
                raise KeyError(f"the reference has no tensor {name}")
            if tuple(state[name].shape) != tuple(value.shape):
                raise ValueError(f"{name}: reference shape {tuple(state[name].shape)}, made {tuple(value.shape)}")
        model.load_state_dict(w, strict=False)  # the encoder's tied weights and lm_head follow
    enc = model.model.encoder.language_model
    for i, layer in enumerate(model.model.decoder.layers):
        if not torch.equal(enc.layers[i].self_attn.q_proj.weight, layer.self_attn.q_proj.weight):
            raise RuntimeError("the encoder's weights are not tied to the decoder's")
    if not torch.equal(model.lm_head.weight, model.model.decoder.embed_tokens.weight):
        raise RuntimeError("lm_head is not tied to the embedding")


def published_names(model):
    """The text tensor names `save_pretrained` writes (the vision tower left out)."""
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        names = set()
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "pt") as st:
                    names.update(st.keys())
    return {n for n in names if not dgemma_common.is_vision_tensor(n)}


def shard_of(name):
    """Two shards; every layer is split across both, so a loader must follow the index."""
    first = name.endswith(("embed_tokens.weight", "q_proj.weight", "k_norm.weight", "mlp.up_proj.weight",
                           "router.proj.weight", "experts.down_proj", "post_feedforward_layernorm_1.weight"))
    return 1 if first or name.startswith("model.encoder.") else 2


def write_config_files(model, out):
    cfg = json.loads(model.config.to_json_string(use_diff=True))  # as save_pretrained writes it
    cfg["dtype"] = "bfloat16"
    cfg["text_config"]["dtype"] = "bfloat16"
    cfg["text_config"]["final_logit_softcapping"] = 30.0  # the published file has it
    cfg["vision_config"]["dtype"] = "bfloat16"
    gen = {
        "confidence_threshold": 0.005, "eos_token_id": dtok.EOS_IDS, "max_denoising_steps": 48,
        "max_new_tokens": 256, "pad_token_id": dtok.PAD_ID, "return_dict_in_generate": True,
        "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
        "stability_threshold": 1, "t_max": 0.8, "t_min": 0.4, "transformers_version": cfg["transformers_version"],
    }
    cfg = json.loads(json.dumps(cfg, sort_keys=True))
    fixture_common.write_json_files(out, {
        "config.json": cfg, "generation_config.json": gen,
        "tokenizer_config.json": dtok.tokenizer_config(), "special_tokens_map.json": dtok.special_tokens_map(),
    })


# ---------------------------------------------------------------------------
# logits goldens
# ---------------------------------------------------------------------------


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config.get_text_config(decoder=True))


def softcapped(model, hidden):
    """The LM head and final soft-cap as the reference's forward applies them to the decoder
    (float32 after the head); its own cap, which is 30 unless a config sets another."""
    cap = model.final_logit_softcapping
    logits = model.lm_head(hidden).float()
    return torch.tanh(logits / cap) * cap


@torch.no_grad()
def encode_pass(model, ids, cache, start):
    """Encoder (or commit) pass over `ids` at positions start.., appending to `cache`;
    returns the soft-capped logits of its final hidden states [T, V]."""
    # on the model's device, so that tools/dgemma_torch.py can run these passes on a GPU
    t = torch.tensor([ids], device=model.device)
    pos = torch.arange(start, start + len(ids), device=model.device).unsqueeze(0)
    out = model.model.encoder(input_ids=t, cache=cache, position_ids=pos)
    return softcapped(model, out.last_hidden_state)[0]


@torch.no_grad()
def decode_pass(model, canvas, cache, start, sc_logits=None):
    """Decoder pass over the canvas at positions start.. (cache read only): logits [L, V]."""
    dev = model.device
    pos = torch.arange(start, start + len(canvas), device=dev).unsqueeze(0)
    # the dtype of a given tensor is kept: the bf16 reference feeds bf16 self-conditioning logits
    sc = None if sc_logits is None else torch.as_tensor(sc_logits).to(dev).unsqueeze(0)
    out = model(decoder_input_ids=torch.tensor([canvas], device=dev), cache=cache, decoder_position_ids=pos,
                self_conditioning_logits=sc)
    return out.logits[0]


def logits_prompts(tok):
    text = encode(tok, "The quick brown fox jumps over the lazy dog. Question: What is 7 times 8? Answer: 56.")
    p1 = [dtok.BOS_ID] + text[:5]
    p2 = encode(tok, dtok.render_chat([{"role": "user", "content": "What is 2 + 3?"}]))[:13]
    p3 = [dtok.BOS_ID] + text[:23]
    assert (len(p1), len(p2), len(p3)) == (6, 13, 24)
    return {"p6": p1, "p13": p2, "p24": p3}


def logits_golden(model, tok, seed):
    """Encoder logits of three prompts, the commit pass of a canvas, and decoder logits of
    canvases with and without self-conditioning, before and after a commit."""
    g = np.random.Generator(np.random.PCG64(seed + 1))
    canvases = {n: [int(x) for x in g.integers(0, VOCAB, CANVAS)] for n in ("c1", "c2", "c3", "c4")}
    prompts = logits_prompts(tok)
    tensors, cases = {}, []
    for name, ids in prompts.items():
        tensors[f"enc.{name}"] = encode_pass(model, ids, new_cache(model), 0)
        cases.append({"name": f"enc.{name}", "pass": "encoder", "prompt": ids})

    def decoder_case(name, prompt, commits, canvas, sc_name=None, desc=""):
        cache = new_cache(model)
        encode_pass(model, prompt, cache, 0)
        start = len(prompt)
        for c in commits:
            encode_pass(model, c, cache, start)
            start += len(c)
        sc = None if sc_name is None else tensors[sc_name]
        tensors[name] = decode_pass(model, canvas, cache, start, sc)
        cases.append({"name": name, "pass": "decoder", "prompt": prompt, "commits": commits, "canvas": canvas,
                      "start": start, "self_conditioning": sc_name, "description": desc})

    # the commit pass alone: prompt p13 then canvas c3 appended at positions 13..28
    cache = new_cache(model)
    encode_pass(model, prompts["p13"], cache, 0)
    tensors["commit.p13_c3"] = encode_pass(model, canvases["c3"], cache, 13)
    cases.append({"name": "commit.p13_c3", "pass": "commit", "prompt": prompts["p13"], "canvas": canvases["c3"],
                  "start": 13})
    decoder_case("dec.p6_c1", prompts["p6"], [], canvases["c1"], desc="prompt shorter than the window, no SC")
    decoder_case("dec.p24_c2", prompts["p24"], [], canvases["c2"], desc="sliding layers see 7 of 24 prompt keys")
    tensors["sc.p24_c2"] = tensors["dec.p24_c2"] / np.float32(0.8)
    decoder_case("dec.p24_c2_sc", prompts["p24"], [], canvases["c2"], "sc.p24_c2",
                 desc="as dec.p24_c2 with its own logits / 0.8 as self-conditioning")
    decoder_case("dec.p13_c3_c4_sc", prompts["p13"], [canvases["c3"]], canvases["c4"], "sc.p24_c2",
                 desc="after committing c3; self-conditioning from sc.p24_c2")
    return {k: v.detach().float().numpy() for k, v in tensors.items()}, cases


def check_window_matters(model, tok):
    """After the 24-token prompt the reference's cache holds only the last W-1 positions in
    sliding layers (all that the decoder sees there) and all 24 in full layers."""
    cache = new_cache(model)
    encode_pass(model, logits_prompts(tok)["p24"], cache, 0)
    for i, kind in enumerate(LAYER_TYPES):
        n = cache.layers[i].keys.shape[-2]
        want = WINDOW - 1 if kind == SLIDING else 24
        if n != want:
            raise RuntimeError(f"layer {i} ({kind}) caches {n} positions, expected {want}")


def router_margin(model, tok):
    """Smallest gap between the k-th and (k+1)-th router probability over the logits
    goldens' encoder passes (a near tie could pick another expert under other rounding)."""
    gaps = []

    def hook(_mod, _inp, out):
        p = out[0].detach().double().sort(dim=-1, descending=True).values
        gaps.append(float((p[:, TOP_K - 1] - p[:, TOP_K]).min()))

    hs = [layer.router.register_forward_hook(hook) for layer in model.model.decoder.layers]
    hs += [layer.router.register_forward_hook(hook) for layer in model.model.encoder.language_model.layers]
    for ids in logits_prompts(tok).values():
        encode_pass(model, ids, new_cache(model), 0)
    for h in hs:
        h.remove()
    return min(gaps)


def write_logits(out, tensors, cases, margin):
    import safetensors.numpy

    safetensors.numpy.save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sorted(tensors.items())},
                                os.path.join(out, "goldens", "logits.safetensors"), metadata={"format": "np"})
    os.chmod(os.path.join(out, "goldens", "logits.safetensors"), 0o644)
    meta = {
        "description": (
            "Soft-capped logits [T, vocab] in goldens/logits.safetensors (float32), computed by "
            "transformers' DiffusionGemmaForBlockDiffusion in float32 on CPU. enc.*: encoder pass over "
            "a prompt from position 0, the LM head applied to its final normed hidden states. commit.*: "
            "the encoder pass over a canvas appended after a prompt (positions start..). dec.*: decoder "
            "pass over a canvas at positions start.. after encoding the prompt and committing `commits`; "
            "self_conditioning names the tensor passed as the previous step's logits (sc.* are inputs)."
        ),
        "min_router_margin": margin,
        "cases": cases,
    }
    write_text(os.path.join(out, "goldens", "logits.json"), to_json(meta) + "\n")


def check_reload(out, tensors, cases):
    """The reference loads the written folder (bf16 files, vision tower absent) and gives
    the decoder goldens again: the names and layout are what it reads."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging

    logging.set_verbosity_error()  # the absent vision tower is reported as newly initialised
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(out, dtype=torch.float32).eval()
    for c in cases:
        if c["pass"] != "decoder":
            continue
        cache = new_cache(model)
        encode_pass(model, c["prompt"], cache, 0)
        start = len(c["prompt"])
        for canvas in c["commits"]:
            encode_pass(model, canvas, cache, start)
            start += len(canvas)
        sc = None if c["self_conditioning"] is None else tensors[c["self_conditioning"]]
        got = decode_pass(model, c["canvas"], cache, start, sc).numpy()
        if not np.array_equal(got, tensors[c["name"]]):
            raise RuntimeError(f"{c['name']}: the reloaded checkpoint gives other logits")


README = """\
# Tiny DiffusionGemma fixture

A 4-layer DiffusionGemma checkpoint (`DiffusionGemmaForBlockDiffusion`, text part) with random
weights, a byte-level BPE tokenizer around Gemma 4's special-token ids, and goldens computed
by the reference itself: transformers {tver}'s DiffusionGemma classes in float32 on CPU. The
Rust tests and `tools/dgemma_ref.py --check` read these files; neither runs PyTorch. The
model is specified in `docs/models/diffusion-gemma.md`.

Made with (needs torch and transformers >= 5.23, which CI does not install):

    tools/.venv/bin/pip install "transformers>=5.23"
    tools/.venv/bin/python tools/make_dgemma_fixture.py --seed {seed}
    python3 tools/dgemma_ref.py --check          # numpy only

The maker is deterministic for a seed. It checks that the tensor names are exactly those
`save_pretrained` writes (vision tower left out) and that the reference, reloading the
written folder, gives the decoder goldens bit for bit.

## Files

| file | what |
|---|---|
| `config.json` | as `save_pretrained` writes it (plus `final_logit_softcapping`, which the published file has): `text_config` with hidden_size {hidden}, {heads} query heads, sliding layers head_dim {hd} with {kv} KV heads, full layers head_dim {ghd} with {gkv} KV head (`per_layer_config`), layer_types {types}, sliding_window {window}, {experts} experts top {topk} of size {esize}, intermediate_size {inter}, vocab_size {vocab}; canvas_length {canvas}; a tiny `vision_config` whose weights are not stored |
| `generation_config.json` | the published sampler settings and eos ids `[1, 106, 50]` |
| `model-0000{{1,2}}-of-00002.safetensors`, `model.safetensors.index.json` | bf16 weights with the published names (`model.decoder.*`, `model.encoder.language_model.layers.*.layer_scalar`); every layer is split over both shards, so load by the index |
| `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` | byte-level BPE with {n_ord} ordinary tokens (trained on the corpus of `tools/make_fixture.py`) at the ids the specials leave free, 0..{last}; rows {first_empty}..{last_row} have no token. The chat template is the text-only part of Gemma 4's |
| `chat_template_cases.json` | rendered chat prompts and their ids |
| `goldens/logits.safetensors`, `goldens/logits.json` | float32 soft-capped logits of encoder, commit and decoder passes (`logits.json` says what each tensor is) |
| `goldens/generate.json` | whole generations by the reference's `generate`, every random draw and every step recorded |

## Token ids (Gemma 4's)

| id | token |
|---|---|
{token_rows}

## Weights

Drawn by one `torch.Generator(seed)` in the sorted order of the names, rounded to bf16. Normal
with std: embedding {s_embed}; q/k/v/o projections {s_q}; dense MLP and experts {s_mlp};
router {s_router}; self-conditioning gate/up {s_scgate}, down {s_scdown}. Norm weights 1 + N(0,
{s_norm}), except post_attention_layernorm and post_feedforward_layernorm ({post}x that) and the
final norm ({final}x); `router.scale` 1 + N(0, {s_norm}); `per_expert_scale` uniform in
[{pes_lo}, {pes_hi}); `layer_scalar` uniform in [{ls_lo}, {ls_hi}), the encoder's copy equal to the
decoder's as in the published files. The self-conditioning MLP is weak on purpose: a strong
one amplifies a rounding difference from step to step, and float32 and float64 generations
part after a few steps.

## Goldens

Logits: `enc.*` is the encoder pass over a prompt (LM head and soft-cap applied to its final
normed hidden states); `commit.p13_c3` the encoder pass over a canvas appended at positions
13..28; `dec.*` decoder passes after a prompt (and a commit), with and without
self-conditioning (the `sc.*` tensors are the inputs; `sc.p24_c2` = `dec.p24_c2` / 0.8). The
24-token prompt is longer than the window, so the decoder's sliding layers see only its last
{wm1} positions. Smallest router top-{topk} margin over the encoder passes:
{router_margin:.2g}.

Generations: the reference's draws are recorded (`init`, `sampled`, `renoise`) and a runtime
replays them; everything else must follow. Every case was replayed in float64 by the
reference and took the same decisions; each case keeps its smallest margins (argmax gap of the
temperature-scaled logits; distance of every entropy prefix sum from the bound and the gap at
the acceptance boundary; distance of the mean entropy from the confidence threshold at stable
steps), all at least {floor_arg:g} / {floor_acc:g} / {floor_gap:g} / {floor_stop:g} and ten times
the float32-float64 difference of the same quantity at that step
(`max_f32_f64_difference` gives the largest differences of the logits and entropies).

{case_table}
"""


def case_table(gen):
    rows = ["| case | settings | canvases: steps (stopped early?) | accepted per step, first canvas |", "|---|---|---|---|"]
    for c in gen["cases"]:
        p = c["params"]
        settings = (f"N {p['max_denoising_steps']}, bound {p['entropy_bound']:g}, T {p['t_min']:g}..{p['t_max']:g}, "
                    f"S {p['stability_threshold']}, c {p['confidence_threshold']:g}, max_new {p['max_new_tokens']}")
        runs = ", ".join(f"{len(x['steps'])}{' (yes)' if x['steps'][-1]['stop'] else ''}" for x in c["canvases"])
        acc = ",".join(str(len(s["accepted"])) for s in c["canvases"][0]["steps"][:16])
        rows.append(f"| `{c['name']}`: {c['description']} | {settings} | {runs} | {acc} |")
    return "\n".join(rows)


def write_readme(out, seed, gen, router_margin_value):
    import transformers

    tokens = sorted(dtok.SPECIAL.items(), key=lambda kv: kv[1])
    write_text(os.path.join(out, "README.md"), README.format(
        tver=transformers.__version__, seed=seed, hidden=HIDDEN, heads=N_HEADS, hd=HEAD_DIM, kv=KV_HEADS,
        ghd=GLOBAL_HEAD_DIM, gkv=GLOBAL_KV_HEADS, types=", ".join(t.split("_")[0] for t in LAYER_TYPES),
        window=WINDOW, experts=N_EXPERTS, topk=TOP_K, esize=EXPERT_SIZE, inter=INTERMEDIATE, vocab=VOCAB,
        canvas=CANVAS, n_ord=dtok.N_ORDINARY, last=dtok.LAST_TOKEN_ID, first_empty=dtok.LAST_TOKEN_ID + 1,
        last_row=VOCAB - 1, token_rows="\n".join(f"| {i} | `{t}` |" for t, i in tokens),
        s_embed=STD["embed"], s_q=STD["q_proj"], s_mlp=STD["gate"], s_router=STD["router"],
        s_scgate=STD["sc_gate"], s_scdown=STD["sc_down"], s_norm=STD["norm_jitter"], post=POST_NORM_GAIN, final=FINAL_NORM_GAIN,
        pes_lo=PER_EXPERT_SCALE_RANGE[0], pes_hi=PER_EXPERT_SCALE_RANGE[1], ls_lo=LAYER_SCALAR_RANGE[0],
        ls_hi=LAYER_SCALAR_RANGE[1], wm1=WINDOW - 1, router_margin=router_margin_value,
        floor_arg=dgemma_generate.ARGMAX_FLOOR, floor_acc=dgemma_generate.ACCEPT_FLOOR,
        floor_gap=dgemma_generate.GAP_FLOOR, floor_stop=dgemma_generate.STOP_FLOOR, case_table=case_table(gen)))


def main():
    args = fixture_common.maker_args(__doc__.splitlines()[0], DEFAULT_OUT)
    out = args.out
    torch.manual_seed(args.seed)
    print("tokenizer")
    tok = dtok.build_tokenizer()
    dtok.save_tokenizer(tok, out)
    print("model and weights")
    model = build_model()
    cfg = dgemma_common.resolve_config(model.config.to_dict())
    shapes = dgemma_common.expected_shapes(cfg)
    weights = make_weights(args.seed, shapes)
    load_weights(model, weights)
    names = published_names(model)
    if names != set(shapes):
        raise RuntimeError(f"published names differ: {sorted(names ^ set(shapes))}")
    write_config_files(model, out)
    fixture_common.write_checkpoint(out, {k: v.numpy() for k, v in weights.items()}, shard_of)
    check_window_matters(model, tok)
    print("logits goldens")
    tensors, cases = logits_golden(model, tok, args.seed)
    margin = router_margin(model, tok)
    write_logits(out, tensors, cases, margin)
    check_reload(out, tensors, cases)
    print("generate goldens")
    gen = dgemma_generate.generate_golden(model, tok)
    write_text(os.path.join(out, "goldens", "generate.json"), to_json(gen) + "\n")
    write_text(os.path.join(out, "chat_template_cases.json"), to_json(dtok.chat_cases(tok)) + "\n")
    write_readme(out, args.seed, gen, margin)
    fixture_common.report_size(out)


if __name__ == "__main__":
    main()
