"""Build tests/fixtures/tiny-wide-heads/ (LLaDA) and tests/fixtures/tiny-dream-wide-heads/
(Dream): checkpoints whose heads are 256 wide.

Every published LLaDA and Dream model has head_dim 128; the runtime's attention kernels
stage wider heads 128 dimensions at a time (up to 512), and these fixtures check that path
end to end: hidden size 256 with one head (head_dim 256), one layer, an MLP of 64 and a
vocabulary of 128 ids with no tokenizer (the tests feed token ids), so that each stays
under 1 MiB.  The weights are drawn as in tools/make_fixture.py and
tools/make_dream_fixture.py with the standard deviations of the matrices that read the
hidden stream halved (it is 4x the tiny fixtures'), so attention is as far from uniform as
there.

Goldens: LLaDA's from tools/llada_ref.py, goldens/logits.json (the tiny fixture's layout:
float32 and bf16-rounding paths, argmax per row) and goldens/generate.json (temperature 0:
one block, several blocks, Fast-dLLM threshold decoding); Dream's from tools/dream_ref.py,
goldens/logits.json (the tiny Dream fixture's layout: the unshifted output, float32) and
goldens/generate.json (temperature 0: maskgit_plus in one block, 4 blocks, threshold).

Usage: PYTHON tools/make_wide_head_fixture.py [--seed 0], with a Python that has numpy,
safetensors and PyTorch (Dream's quota check computes the quotas in float32 as PyTorch does;
tools/.venv has no PyTorch).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_ref  # noqa: E402
import dream_fixture_goldens  # noqa: E402
import fixture_common  # noqa: E402
import llada_ref  # noqa: E402
import make_dream_fixture  # noqa: E402
import make_fixture  # noqa: E402
from fixture_common import to_json, write_text  # noqa: E402

FIXTURES = os.path.join(make_fixture.REPO_ROOT, "tests", "fixtures")

D_MODEL, N_HEADS, N_KV_HEADS, N_LAYERS, MLP_HIDDEN, VOCAB_SIZE = 256, 1, 1, 1, 64, 128
# ids 0..119 ordinary, then the six LLaDA special tokens; 126 and 127 are rows without a token
BOS_ID, EOS_ID, SHI_ID, EHI_ID, EOT_ID, MASK_ID = range(120, 126)
N_ORDINARY = 120


def halved(stds, names):
    """`stds` with the matrices that read the hidden stream (4x wider here) at half theirs."""
    return dict(stds, **{n: stds[n] / 2 for n in names})


STD = halved(make_fixture.STD, ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "lm_head"])

CASES = [name for name, _, _ in make_fixture.CASE_SPECS if name in ("a_nonblock", "b_blocks", "f_threshold")]


def model_config():
    cfg = make_fixture.model_config()
    cfg.update(
        d_model=D_MODEL,
        n_heads=N_HEADS,
        n_kv_heads=N_KV_HEADS,
        n_layers=N_LAYERS,
        mlp_hidden_size=MLP_HIDDEN,
        vocab_size=VOCAB_SIZE,
        embedding_size=VOCAB_SIZE,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        mask_token_id=MASK_ID,
    )
    return cfg


def shard_of(name):
    """Two shards, the block split over both, as in the tiny fixture."""
    first = name == "model.transformer.wte.weight" or name.endswith((".q_proj.weight", ".attn_norm.weight"))
    return 1 if first else 2


def prompts(rng):
    """The logits prompts (lengths 5, 12 and 23, BOS on the last two, masks in the last,
    one inside its prompt part) and the candidate generation prompts (BOS and 11 ordinary
    ids each; a case takes the first whose margins clear the floor)."""
    text = [int(i) for i in rng.integers(0, N_ORDINARY, size=20)]
    p3 = [BOS_ID] + text[:14] + [MASK_ID] * 8
    p3[6] = MASK_ID
    logits = [("len5", text[:5]), ("len12_bos", [BOS_ID] + text[:11]), ("len23_masks", p3)]
    candidates = [[BOS_ID] + [int(i) for i in rng.integers(0, N_ORDINARY, size=11)] for _ in range(64)]
    return logits, candidates


def logits_golden(params, cases):
    out = [make_fixture.logits_case(params, name, ids) for name, ids in cases]
    return {
        "description": (
            "Golden logits of tools/llada_ref.py forward() on the wide-head checkpoint, in the "
            "layout of tests/fixtures/tiny/goldens/logits.json."
        ),
        "vocab_size": VOCAB_SIZE,
        "cases": out,
    }


def search_cases(params, candidates, specs, full_params, run_case, is_interesting):
    """For each (name, description, spec) of `specs`, the first candidate prompt whose
    generation keeps every margin off a tie and exercises its option, as a golden case in
    the tiny fixtures' layout (each case starts at another candidate, so the cases do not
    share prompts)."""
    cases = []
    for ci, (name, desc, spec) in enumerate(specs):
        fp = full_params(spec)
        for k in range(len(candidates)):
            prompt = candidates[(ci * 8 + k) % len(candidates)]
            r = fixture_common.try_case(run_case, is_interesting, params, name, prompt, fp)
            if r is not None:
                break
        else:
            raise RuntimeError(f"no candidate prompt satisfies case {name}")
        out, trace, cm, lm = r
        cases.append(
            {
                "name": name,
                "description": desc,
                "prompt": prompt,
                "params": fp,
                "output": [int(i) for i in out],
                "steps": [
                    {"block": s["block"], "step": s["step"], "committed": s["committed"], "tokens": s["tokens"]}
                    for s in trace
                ],
                "min_margin": cm,
                "min_logit_margin": lm,
            }
        )
        print(f"  {name}: {len(trace)} steps, min_margin {cm:.3g}, min_logit_margin {lm:.3g}")
    return cases


def generate_golden(params, candidates):
    specs = [s for s in make_fixture.CASE_SPECS if s[0] in CASES]

    def full_params(spec):
        return dict(make_fixture.full_params(spec), mask_id=MASK_ID, eos_id=EOS_ID, eot_id=EOT_ID)

    return {
        "description": (
            "Golden outputs of tools/llada_ref.py generate() (temperature 0, float32 forward) on "
            "the wide-head checkpoint, in the layout of tests/fixtures/tiny/goldens/generate.json."
        ),
        "cases": search_cases(params, candidates, specs, full_params, make_fixture.run_case, interesting),
    }


def interesting(name, params, prompt, fp, out, trace):
    if MASK_ID in list(out[len(prompt):]):
        return False
    return make_fixture.case_is_interesting(name, params, prompt, fp, out, trace)


README = """\
# Tiny LLaDA fixture with 256-wide heads

A 1-layer LLaDA-format checkpoint whose single attention head is 256 wide (d_model 256,
n_heads = n_kv_heads = 1, mlp_hidden_size 64, vocab_size = embedding_size = 128), with
random bf16 weights in two shards and goldens of the numpy reference. It checks the
attention path for heads wider than 128 (staged 128 dimensions at a time) inside the whole
forward and the sampler. There is no tokenizer: the tests feed token ids.

Made with `python tools/make_wide_head_fixture.py --seed {seed}` (deterministic for a seed),
in a Python with numpy, safetensors and PyTorch (for the Dream fixture made beside it).

| id | token |
|---|---|
| 0..119 | ordinary |
| {bos} | BOS |
| {eos} | EOS = PAD |
| {eot} | EoT |
| {mask} | mask |

`goldens/logits.json`: logits [T, 128] of three prompts (lengths 5, 12, 23; the last with
masks), float32 and bf16-rounding paths. `goldens/generate.json`: temperature-0
generations (one block of 16; 4 blocks of 4; threshold 0.5 in 2 blocks of 8) with the
positions committed at every step; every margin is at least {floor:g}.
"""


def llada_fixture(out, seed):
    fixture_common.write_json_files(out, {"config.json": model_config()})
    rng = np.random.Generator(np.random.PCG64(seed))
    dims = (D_MODEL, N_HEADS, N_KV_HEADS, N_LAYERS, MLP_HIDDEN, VOCAB_SIZE)
    weights = make_fixture.make_weights(rng, dims, STD, (EOS_ID, EOT_ID, MASK_ID))
    fixture_common.write_checkpoint(out, weights, shard_of)
    params = llada_ref.load_checkpoint(out)
    assert params["config"]["head_dim"] == 256
    logits_cases, candidates = prompts(rng)
    print("logits goldens")
    write_text(os.path.join(out, "goldens", "logits.json"), to_json(logits_golden(params, logits_cases)) + "\n")
    print("generate goldens")
    write_text(os.path.join(out, "goldens", "generate.json"), to_json(generate_golden(params, candidates)) + "\n")
    write_text(
        os.path.join(out, "README.md"),
        README.format(seed=seed, bos=BOS_ID, eos=EOS_ID, eot=EOT_ID, mask=MASK_ID, floor=fixture_common.MARGIN_FLOOR),
    )
    fixture_common.report_size(out)


# --- Dream -------------------------------------------------------------------------------

# ids 0..119 ordinary, then Dream's special tokens; 125..127 are rows without a token
DREAM_EOS, DREAM_IM_START, DREAM_IM_END, DREAM_BOS, DREAM_MASK = range(120, 125)

DREAM_STD = halved(make_dream_fixture.STD, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "lm_head"])


def dream_config():
    cfg = make_dream_fixture.model_config()
    cfg.update(
        bos_token_id=DREAM_BOS,
        eos_token_id=DREAM_EOS,
        pad_token_id=DREAM_EOS,
        mask_token_id=DREAM_MASK,
        hidden_size=D_MODEL,
        intermediate_size=MLP_HIDDEN,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        num_hidden_layers=N_LAYERS,
        max_window_layers=N_LAYERS,
        vocab_size=VOCAB_SIZE,
    )
    return cfg


def dream_shard_of(name):
    first = name == "model.embed_tokens.weight" or ".self_attn.q_proj." in name
    return 1 if first else 2


DREAM_README = """\
# Tiny Dream fixture with 256-wide heads

A 1-layer Dream-format (Qwen2 names, q/k/v biases) checkpoint whose single attention head is
256 wide (hidden_size 256, one query and one KV head, intermediate_size 64, vocab_size 128),
with random bf16 weights in two shards and the logits of the numpy reference
(`tools/dream_ref.py`): `goldens/logits.json`, the unshifted output of three prompts
(lengths 5, 12, 23; BOS on the last two, masks in the last), float32; `goldens/generate.json`,
temperature-0 generations (maskgit_plus in one block of 16; 4 blocks of 4; threshold 0.3 in 2
blocks of 8) with the positions committed at every step, every margin at least {floor:g}.
There is no tokenizer: the tests feed token ids.

Made with `python tools/make_wide_head_fixture.py --seed {seed}` (with the LLaDA one beside
it), in a Python with numpy, safetensors and PyTorch (Dream's quotas are checked in float32
as PyTorch computes them).

Ids: 0..119 ordinary, {eos} EOS = PAD, {bos} BOS, {mask} mask.
"""


DREAM_CASES = ("a_maskgit_plus", "g_blocks_maskgit", "h_threshold")


def dream_generate_golden(params, candidates):
    """Temperature-0 generations of tools/dream_ref.py (no random draws): one block, 4 blocks
    of 4 and threshold decoding, in the layout of tests/fixtures/tiny-dream/goldens/generate.json
    (id prompts; no chat fields)."""
    specs = [s for s in dream_fixture_goldens.CASE_SPECS if s[0] in DREAM_CASES]

    def full_params(spec):
        return dict(dream_fixture_goldens.full_params(spec), mask_id=DREAM_MASK, eos_id=DREAM_EOS)

    cases = search_cases(params, candidates, specs, full_params, dream_fixture_goldens.run_case, dream_interesting)
    return {
        "description": (
            "Golden outputs of tools/dream_ref.py generate() (temperature 0, float32 forward) on "
            "the wide-head checkpoint, in the layout of tests/fixtures/tiny-dream/goldens/generate.json."
        ),
        "cases": cases,
    }


def dream_interesting(name, params, prompt, fp, out, trace):
    """The tiny Dream fixture's conditions, with this checkpoint's mask id."""
    if DREAM_MASK in list(out[len(prompt):]):
        return False
    if not dream_fixture_goldens.quotas_are_robust(fp, trace):
        return False
    if name == "h_threshold":
        sizes = [len(s["committed"]) for s in trace if s["step"] > 0]
        return sum(1 for n in sizes if n >= 2) >= 1
    return True


def dream_fixture(out, seed):
    fixture_common.write_json_files(out, {"config.json": dream_config()})
    rng = np.random.Generator(np.random.PCG64(seed))
    dims = (D_MODEL, N_HEADS, N_KV_HEADS, N_LAYERS, MLP_HIDDEN, VOCAB_SIZE)
    ids = (DREAM_EOS, DREAM_IM_END, DREAM_MASK)
    weights = make_dream_fixture.make_weights(rng, dims, DREAM_STD, ids)
    fixture_common.write_checkpoint(out, weights, dream_shard_of)
    params = dream_ref.load_checkpoint(out)
    text = [int(i) for i in rng.integers(0, N_ORDINARY, size=20)]
    p3 = [DREAM_BOS] + text[:14] + [DREAM_MASK] * 8
    p3[6] = DREAM_MASK
    cases = [("len5", text[:5]), ("len12_bos", [DREAM_BOS] + text[:11]), ("len23_masks", p3)]
    golden = {
        "description": (
            "Golden logits of tools/dream_ref.py forward() on the wide-head checkpoint, in the "
            "layout of tests/fixtures/tiny-dream/goldens/logits.json (unshifted output)."
        ),
        "vocab_size": VOCAB_SIZE,
        "cases": [dream_fixture_goldens.logits_case(n, i, dream_ref.forward(params, i)) for n, i in cases],
    }
    write_text(os.path.join(out, "goldens", "logits.json"), to_json(golden) + "\n")
    # Drawn after the logits prompts: the checkpoint and logits stay what they were.
    candidates = [[DREAM_BOS] + [int(i) for i in rng.integers(0, N_ORDINARY, size=11)] for _ in range(64)]
    print("generate goldens")
    write_text(os.path.join(out, "goldens", "generate.json"), to_json(dream_generate_golden(params, candidates)) + "\n")
    write_text(
        os.path.join(out, "README.md"),
        DREAM_README.format(
            seed=seed, eos=DREAM_EOS, bos=DREAM_BOS, mask=DREAM_MASK, floor=fixture_common.MARGIN_FLOOR
        ),
    )
    fixture_common.report_size(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=FIXTURES, help="the folder the two fixtures go in")
    args = ap.parse_args()
    for name, make in [("tiny-wide-heads", llada_fixture), ("tiny-dream-wide-heads", dream_fixture)]:
        out = os.path.join(args.out_dir, name)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(os.path.join(out, "goldens"))
        print(name)
        make(out, args.seed)


if __name__ == "__main__":
    main()
