"""Golden infillings of the tiny LLaDA and Dream fixtures: tools/llada_ref.py or
tools/dream_ref.py generate() with a suffix after the canvas (x = prompt, masks, suffix),
written to FIXTURE/goldens/infill.json.

Each case is kept only when its decisions have margins (fixture_common.MARGIN_FLOOR) and
its suffix changes the generation: the same request without the suffix generates other
tokens, so a runtime that dropped or misplaced the suffix would fail the case.

Usage: tools/.venv/bin/python tools/make_infill_goldens.py [--fixture tests/fixtures/tiny]
       tools/.venv/bin/python tools/make_infill_goldens.py --fixture tests/fixtures/tiny-dream
       python tools/make_infill_goldens.py --fixture DIR --check   (numpy alone: the stored
       cases are the reference's)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_ref  # noqa: E402
import llada_ref  # noqa: E402

# The makers' modules need the `tokenizers` package; `--check` runs on numpy alone, so they
# are imported where the goldens are made.

SUFFIXES = [
    " and that is all.",
    " The end.",
    " so the answer is five.",
    " Thank you for asking!",
]

LLADA_CASES = [
    ("a_one_block", "one block of 8 before a suffix, one token per step",
     dict(gen_length=8, steps=8, block_length=8)),
    ("b_blocks", "2 blocks of 4 before a suffix, 2 tokens per step",
     dict(gen_length=8, steps=4, block_length=4)),
    ("c_threshold", "Fast-dLLM threshold 0.5 decoding, 2 blocks of 4, before a suffix",
     dict(gen_length=8, steps=8, block_length=4, threshold=0.5)),
    ("d_cfg", "classifier-free guidance 1.0 (the suffix is masked with the prompt)",
     dict(gen_length=8, steps=8, block_length=8, cfg_scale=1.0)),
]

DREAM_CASES = [
    ("a_original", "Dream's own schedule, maskgit_plus, 8 steps for 8 tokens before a suffix",
     dict(gen_length=8, steps=8, block_length=8, alg="maskgit_plus")),
    ("b_entropy", "Dream's own schedule, entropy, 4 steps",
     dict(gen_length=8, steps=4, block_length=8, alg="entropy")),
    ("c_blocks", "Fast-dLLM's Dream port: 2 blocks of 4, 2 steps each, maskgit_plus",
     dict(gen_length=8, steps=4, block_length=4, alg="maskgit_plus")),
]


class Llada:
    cases = LLADA_CASES

    @staticmethod
    def full_params(spec):
        import make_fixture

        return make_fixture.full_params(spec)

    @staticmethod
    def prompt(tok, question):
        import make_fixture

        text = make_fixture.render_chat([{"role": "user", "content": question}])
        return tok.encode(text, add_special_tokens=False).ids

    @staticmethod
    def run(params, prompt, fp, suffix):
        return llada_ref.generate(
            params, prompt, fp["gen_length"], fp["steps"], fp["block_length"],
            cfg_scale=fp["cfg_scale"], mask_id=fp["mask_id"], eos_id=fp["eos_id"],
            eot_id=fp["eot_id"], threshold=fp["threshold"], suffix_ids=suffix,
        )


class Dream:
    cases = DREAM_CASES

    @staticmethod
    def full_params(spec):
        import dream_fixture_goldens

        return dream_fixture_goldens.full_params(spec)

    @staticmethod
    def prompt(tok, question):
        import dream_fixture_chat
        import fixture_common

        text = dream_fixture_chat.render_chat([{"role": "user", "content": question}])
        return fixture_common.encode(tok, text)

    @staticmethod
    def run(params, prompt, fp, suffix):
        return dream_ref.generate(
            params, prompt, fp["gen_length"], fp["steps"], block_length=fp["block_length"],
            alg=fp["alg"], alg_temp=fp["alg_temp"], eps=fp["eps"], top_p=fp["top_p"],
            top_k=fp["top_k"], threshold=fp["threshold"], mask_id=fp["mask_id"],
            seed=fp["seed"], suffix_ids=suffix,
        )


def family_of(fixture):
    """The fixture's family (Llada or Dream), its reference module and its weights."""
    with open(os.path.join(fixture, "config.json")) as f:
        dream = json.load(f)["model_type"].lower() == "dream"
    ref = dream_ref if dream else llada_ref
    return (Dream if dream else Llada), ref, ref.load_checkpoint(fixture)


def load_fixture(fixture):
    """family_of's, and the fixture's tokenizer."""
    from tokenizers import Tokenizer

    family, ref, params = family_of(fixture)
    return family, ref, params, Tokenizer.from_file(os.path.join(fixture, "tokenizer.json"))


def check(fixture):
    """Every stored case again through the reference: the same sequence and commits."""
    family, _, params = family_of(fixture)
    with open(os.path.join(fixture, "goldens", "infill.json")) as f:
        cases = json.load(f)["cases"]
    for case in cases:
        out, trace = family.run(params, case["prompt"], case["params"], case["suffix"])
        commits = [s["committed"] for s in trace]
        if [int(t) for t in out] != case["output"] or commits != [s["committed"] for s in case["steps"]]:
            raise SystemExit(f"{fixture}: infill case {case['name']} differs from the reference")
    print(f"{fixture}: {len(cases)} infill goldens reproduced")


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
    prompts = [family.prompt(tok, q) for q in GENERATE_QUESTIONS]
    suffixes = [tok.encode(s, add_special_tokens=False).ids for s in SUFFIXES]
    cases = []
    for ci, (name, desc, spec) in enumerate(family.cases):
        fp = family.full_params(spec)
        chosen = None
        for k in range(len(prompts) * len(suffixes)):
            qi = (ci + k) % len(prompts)
            si = (ci + k // len(prompts)) % len(suffixes)
            suffix = suffixes[si]

            def with_suffix(params_, prompt, fp_, suffix=suffix):
                return family.run(params_, prompt, fp_, suffix)

            def suffix_matters(name_, params_, prompt, fp_, out, trace):
                bare, _ = family.run(params_, prompt, fp_, ())
                gen = list(out[len(prompt):len(prompt) + fp_["gen_length"]])
                return fp_["mask_id"] not in gen and gen != list(bare[len(prompt):])

            r = fixture_common.try_case(with_suffix, suffix_matters, params, name, prompts[qi], fp)
            if r is not None:
                chosen = (qi, si) + r
                break
        if chosen is None:
            raise RuntimeError(f"no prompt and suffix satisfy case {name}")
        qi, si, out, trace, cm, lm = chosen
        cases.append({
            "name": name,
            "description": desc,
            "question": GENERATE_QUESTIONS[qi],
            "suffix_text": SUFFIXES[si],
            "prompt": [int(i) for i in prompts[qi]],
            "suffix": [int(i) for i in suffixes[si]],
            "params": fp,
            "output": [int(i) for i in out],
            "steps": [
                {"block": s["block"], "step": s["step"], "committed": s["committed"], "tokens": s["tokens"]}
                for s in trace
            ],
            # null: no step of the case made a ranked decision.
            "min_margin": cm if math.isfinite(cm) else None,
            "min_logit_margin": lm if math.isfinite(lm) else None,
        })
        print(f"  {name}: prompt {len(prompts[qi])} tokens, suffix {len(suffixes[si])}, "
              f"{len(trace)} steps, min_margin {cm:.3g}, min_logit_margin {lm:.3g}")
    goldens = {
        "description": (
            f"Golden infillings of tools/{ref.__name__}.py generate() with suffix_ids "
            "(temperature 0, float32 forward, float64 confidences) on the fixture checkpoint: the "
            "sequence is the prompt, gen_length masks, then the suffix. output is the whole "
            "sequence; steps lists the committed positions (absolute) and tokens per step. "
            "Every case generates other tokens without its suffix. Made by "
            "tools/make_infill_goldens.py."
        ),
        "cases": cases,
    }
    fixture_common.write_json(os.path.join(args.fixture, "goldens", "infill.json"), goldens)


if __name__ == "__main__":
    main()
