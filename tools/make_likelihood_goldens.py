"""Golden log-likelihoods of the tiny LLaDA and Dream fixtures: tools/llada_ref.py
log_likelihood() over masks drawn as get_log_likelihood.py draws them (stored with the
case, so the runtime scores the same samples), written to FIXTURE/goldens/likelihood.json.

Usage: tools/.venv/bin/python tools/make_likelihood_goldens.py [--fixture tests/fixtures/tiny]
       tools/.venv/bin/python tools/make_likelihood_goldens.py --fixture tests/fixtures/tiny-dream
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_ref  # noqa: E402
import fixture_common  # noqa: E402
import llada_ref  # noqa: E402
from make_fixture import GENERATE_QUESTIONS  # noqa: E402
from make_infill_goldens import Dream, load_fixture  # noqa: E402

# (name, description, answer text, mc_num, batch, cfg_scale)
CASES = [
    ("a_short", "a 3-token answer, 8 samples in batches of 4", " It is five.", 8, 4, 0.0),
    ("b_long", "a longer answer, 16 samples in batches of 8", " The answer is five, as two and three make five.", 16, 8, 0.0),
    ("c_cfg", "classifier-free guidance 1.0, 8 samples in batches of 4", " It is five.", 8, 4, 1.0),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", default="tests/fixtures/tiny")
    args = ap.parse_args()
    family, ref, params, tok = load_fixture(args.fixture)
    logits_fn = dream_ref.shifted_forward if family is Dream else llada_ref.forward
    mask_id = params["config"]["mask_token_id"]
    rng = np.random.Generator(np.random.PCG64(0))
    cases = []
    for ci, (name, desc, answer_text, mc_num, batch, cfg) in enumerate(CASES):
        prompt = family.prompt(tok, GENERATE_QUESTIONS[ci % len(GENERATE_QUESTIONS)])
        answer = tok.encode(answer_text, add_special_tokens=False).ids
        samples = llada_ref.draw_likelihood_masks(len(answer), mc_num, batch, rng)
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
