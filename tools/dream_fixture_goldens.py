"""Golden outputs of the tiny Dream fixture: goldens/logits.json and goldens/generate.json.

Part of tools/make_dream_fixture.py, which re-exports every name defined here
(tools/check_dream_fixture.py reads CASE_SPECS, run_case and quotas_are_robust through it).

* logits: tools/dream_ref.py forward() over the prompts of fixture_common.logits_prompts,
  and the 12-token one again left-padded, which must equal the unpadded rows;
* generate: for each case of CASE_SPECS, a search over the questions of
  tools/make_fixture.py (and seeds or thresholds) for the first run of dream_ref.generate()
  whose decisions all keep fixture_common.MARGIN_FLOOR from a tie and in which the case's
  option really changes something (case_is_interesting).

The tokenizer, ids and chat rendering come from tools/dream_fixture_chat.py.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_ref  # noqa: E402
import fixture_common  # noqa: E402
import make_fixture  # noqa: E402
from dream_fixture_chat import BOS_ID, EOS_ID, IM_END_ID, MASK_ID, PAD_ID, VOCAB_SIZE, prefix_info, render_chat  # noqa: E402
from fixture_common import Floats, encode  # noqa: E402

QUOTA_FLOOR = 1e-4  # num_masked * (1 - s/t) must be this far from an integer
EPS = 1e-3

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
