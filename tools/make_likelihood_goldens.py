"""Golden log-likelihoods of the tiny LLaDA and Dream fixtures: tools/llada_ref.py
log_likelihood() over masks drawn as get_log_likelihood.py draws them (stored with the
case, so the runtime scores the same samples), written to FIXTURE/goldens/likelihood.json.

Usage: tools/.venv/bin/python tools/make_likelihood_goldens.py [--fixture tests/fixtures/tiny]
       tools/.venv/bin/python tools/make_likelihood_goldens.py --fixture tests/fixtures/tiny-dream
       python tools/make_likelihood_goldens.py --fixture DIR --check   (numpy alone)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_ref  # noqa: E402
import llada_ref  # noqa: E402
from make_infill_goldens import Dream, family_of, load_fixture  # noqa: E402

# (name, description, answer text, mc_num, batch, cfg_scale, seed, prompted): a case with a
# seed holds the masks the runtime's seeded draw gives (llada_ref.draw_seeded_masks), so a
# caller that passes only the seed (the browser's score) is compared too. A case without a
# prompt scores the text unconditionally (perplexity's bound); Dream, which reads a token's
# logits from the row before it, has none.
CASES = [
    ("a_short", "a 3-token answer, 8 samples in batches of 4", " It is five.", 8, 4, 0.0, None, True),
    ("b_long", "a longer answer, 16 samples in batches of 8", " The answer is five, as two and three make five.", 16, 8, 0.0, None, True),
    ("c_cfg", "classifier-free guidance 1.0, 8 samples in batches of 4", " It is five.", 8, 4, 1.0, None, True),
    ("d_seeded", "the runtime's draw for seed 7: 8 samples in batches of 4", " It is five, I think.", 8, 4, 0.0, 7, True),
    ("e_unconditional", "no prompt: the text's own bound, 16 samples in batches of 8", "Two and three make five, so the answer is five.", 16, 8, 0.0, None, False),
]


def check(fixture):
    """Every stored case's sample losses again through the reference."""
    family, _, params = family_of(fixture)
    logits_fn = dream_ref.shifted_forward if family is Dream else llada_ref.forward
    with open(os.path.join(fixture, "goldens", "likelihood.json")) as f:
        cases = json.load(f)["cases"]
    for case in cases:
        samples = [(s["masked"], s["p_mask"]) for s in case["samples"]]
        if case.get("seed") is not None:
            drawn = llada_ref.draw_seeded_masks(
                len(case["answer"]), len(samples), case["mc_batch"], case["seed"])
            if [(list(m), p) for m, p in drawn] != [(list(m), p) for m, p in samples]:
                raise SystemExit(f"{fixture}: case {case['name']}: the seed draws other masks")
        _, losses = llada_ref.log_likelihood(
            params, case["prompt"], case["answer"], samples, cfg_scale=case["cfg_scale"],
            mask_id=params["config"]["mask_token_id"], logits_fn=logits_fn,
        )
        if not np.allclose(losses, case["sample_losses"], rtol=1e-9, atol=0):
            raise SystemExit(f"{fixture}: likelihood case {case['name']} differs from the reference")
    print(f"{fixture}: {len(cases)} likelihood goldens reproduced")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", default="tests/fixtures/tiny")
    ap.add_argument("--check", action="store_true", help="reproduce the stored goldens")
    args = ap.parse_args()
    if args.check:
        return check(args.fixture)
    import fixture_common
    from make_fixture import GENERATE_QUESTIONS

    family, ref, params, tok = load_fixture(args.fixture)
    logits_fn = dream_ref.shifted_forward if family is Dream else llada_ref.forward
    mask_id = params["config"]["mask_token_id"]
    rng = np.random.Generator(np.random.PCG64(0))
    cases = []
    for ci, (name, desc, answer_text, mc_num, batch, cfg, seed, prompted) in enumerate(CASES):
        if not prompted and family is Dream:
            continue
        prompt = family.prompt(tok, GENERATE_QUESTIONS[ci % len(GENERATE_QUESTIONS)]) if prompted else []
        answer = tok.encode(answer_text, add_special_tokens=False).ids
        if seed is None:
            samples = llada_ref.draw_likelihood_masks(len(answer), mc_num, batch, rng)
        else:
            samples = llada_ref.draw_seeded_masks(len(answer), mc_num, batch, seed)
        est, losses = llada_ref.log_likelihood(
            params, prompt, answer, samples, cfg_scale=cfg, mask_id=mask_id, logits_fn=logits_fn
        )
        cases.append({
            "name": name,
            "description": desc,
            "prompt": [int(t) for t in prompt],
            "answer": [int(t) for t in answer],
            "answer_text": answer_text,
            "cfg_scale": cfg,
            "seed": seed,
            "mc_batch": batch,
            "samples": [{"masked": m, "p_mask": p} for m, p in samples],
            "sample_losses": losses,
            "log_likelihood": est,
        })
        print(f"  {name}: prompt {len(prompt)} tokens, answer {len(answer)}, {len(samples)} samples, "
              f"estimate {est:.4f}")
    goldens = {
        "description": (
            f"Golden Monte Carlo log-likelihoods (tools/llada_ref.py log_likelihood, logits of "
            f"tools/{ref.__name__}.py in float32, log-softmax in float64) on the fixture "
            "checkpoint, over the stored samples (masked answer positions from 0, p_mask). "
            "Made by tools/make_likelihood_goldens.py."
        ),
        "cases": cases,
    }
    fixture_common.write_json(os.path.join(args.fixture, "goldens", "likelihood.json"), goldens)


if __name__ == "__main__":
    main()
