"""Self-check of tests/fixtures/tiny-dream/: reload every file and re-run the reference.

Checks the file layout and size, the config files against the generator's, the
safetensors files (with this repository's reader and with the `safetensors` library),
the tokenizer (special tokens, Qwen2 pre-tokenizer, round trips), the chat template
cases (plain and jinja2 rendering, ids, system-turn prefix), recomputes the logits
goldens (and the left-padded case) and the generate goldens with tools/dream_ref.py,
re-derives every step's commit count from Dream's schedule, the draws from the seed, and
replays the cases from the stored draws.  The checks it shares with tools/check_fixture.py
(file list, safetensors re-reading, tokenizer round trips) are in tools/fixture_common.py.

Usage: tools/.venv/bin/python tools/check_dream_fixture.py [--dir tests/fixtures/tiny-dream]
Exits with status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_common  # noqa: E402
import dream_ref  # noqa: E402
import fixture_common  # noqa: E402
import make_dream_fixture as mdf  # noqa: E402
from fixture_common import check, load  # noqa: E402

def check_config(d, tok):
    cfg = load(os.path.join(d, "config.json"))
    want = mdf.model_config()
    check(list(cfg) == list(want), "config.json keys differ from the Dream layout")
    check(cfg == want, "config.json values differ from the generator's")
    ids = {t: tok.token_to_id(t) for t in mdf.SPECIAL_TOKENS}
    check(cfg["mask_token_id"] == ids["<|mask|>"], "mask_token_id mismatch")
    check(cfg["eos_token_id"] == ids["<|endoftext|>"] == cfg["pad_token_id"], "eos/pad_token_id mismatch")
    check(cfg["bos_token_id"] == ids["<|beginoftext|>"], "bos_token_id mismatch")
    check(cfg["vocab_size"] > tok.get_vocab_size(with_added_tokens=True), "vocab_size must exceed the token count")
    gen = load(os.path.join(d, "generation_config.json"))
    check(gen == mdf.generation_config(), "generation_config.json differs")
    check((gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]),
          "generation_config ids differ from config.json")
    tc = load(os.path.join(d, "tokenizer_config.json"))
    check(tc == mdf.tokenizer_config(), "tokenizer_config.json differs")
    for sid, entry in tc["added_tokens_decoder"].items():
        check(tok.token_to_id(entry["content"]) == int(sid), f"added_tokens_decoder {sid}")
    for key in ("bos_token", "eos_token", "pad_token", "mask_token"):
        check(tok.token_to_id(tc[key]) is not None, f"tokenizer_config {key} is not a token")
    check(load(os.path.join(d, "special_tokens_map.json")) == mdf.special_tokens_map(), "special_tokens_map.json differs")
    print("config files ok")
    return cfg


def check_safetensors(d, cfg):
    params = dream_ref.load_checkpoint(d)
    total, placed = fixture_common.check_shards(d, params)
    shards_of_layer = {}
    for fname, name in placed:
        if name.startswith("model.layers."):
            shards_of_layer.setdefault(name.split(".")[2], set()).add(fname)
    n_expected = 3 + 12 * cfg["num_hidden_layers"]
    check(len(params["tensors"]) == n_expected, f"{len(params['tensors'])} tensors, expected {n_expected}")
    check(all(len(s) == 2 for s in shards_of_layer.values()) and len(shards_of_layer) == cfg["num_hidden_layers"],
          "every layer must be split over both shards")
    for i in range(cfg["num_hidden_layers"]):
        for kind in ("q", "k", "v"):
            b = params["tensors"][f"model.layers.{i}.self_attn.{kind}_proj.bias"]
            check(float(np.std(b)) > 0.2, f"layer {i} {kind}_proj.bias is too small to matter")
    print(f"safetensors ok ({len(params['tensors'])} tensors, {total} bytes)")
    return params


def check_tokenizer(d, tok):
    ids = {t: tok.token_to_id(t) for t in mdf.SPECIAL_TOKENS}
    check(list(ids.values()) == list(range(mdf.N_ORDINARY, mdf.N_ORDINARY + len(mdf.SPECIAL_TOKENS))), f"special ids {ids}")
    check(tok.get_vocab_size(with_added_tokens=False) == mdf.N_ORDINARY, "ordinary vocabulary size")
    data = load(os.path.join(d, "tokenizer.json"))
    pre = data["pre_tokenizer"]
    check(pre["type"] == "Sequence" and [p["type"] for p in pre["pretokenizers"]] == ["Split", "ByteLevel"], "pre-tokenizer layout")
    check(pre["pretokenizers"][0]["pattern"] == {"Regex": mdf.QWEN2_PATTERN} and pre["pretokenizers"][0]["behavior"] == "Isolated",
          "Split pattern / behavior")
    check(pre["pretokenizers"][1]["use_regex"] is False and pre["pretokenizers"][1]["add_prefix_space"] is False, "ByteLevel options")
    check(data["normalizer"] == {"type": "NFC"}, "normalizer")
    check(data["post_processor"] is None, "post_processor must be null")
    check(data["decoder"]["type"] == "ByteLevel", "decoder")
    check(all(a["special"] for a in data["added_tokens"]), "added tokens must be special")
    texts = [
        "Hello, how are you?",
        "The price is 12.50 dollars; 7 * 8 = 56.\n\nNew line\ttab  ",
        "Unicode: café, naïve, 東京, emoji 🙂",
        "<|im_start|>user\nHi<|im_end|>\n<|endoftext|><|mask|><|beginoftext|>",
    ]
    fixture_common.check_round_trips(tok, texts, ids)
    # Qwen2 splits digits one by one
    digits = tok.encode("2024", add_special_tokens=False).ids
    check(len(digits) == 4, f"'2024' -> {digits}, expected 4 digit tokens")
    # NFC: a decomposed accent encodes like the composed character
    check(tok.encode("Cafe\u0301", add_special_tokens=False).ids == tok.encode("Caf\u00e9", add_special_tokens=False).ids, "NFC normalizer")
    check(tok.decode(tok.encode("<|im_end|>Hi<|endoftext|>", add_special_tokens=False).ids, skip_special_tokens=True) == "Hi",
          "skip_special_tokens decode")
    print(f"tokenizer ok ('2024' -> {digits})")


def check_chat(d, tok):
    cases = load(os.path.join(d, "chat_template_cases.json"))
    tc = load(os.path.join(d, "tokenizer_config.json"))
    check(tc["chat_template"] == mdf.CHAT_TEMPLATE, "chat_template differs")
    for c in cases["cases"]:
        text = mdf.render_chat(c["messages"])
        check(text == c["rendered"], f"chat case {c['name']}: rendering")
        check(mdf.render_jinja(c["messages"]) == c["rendered"], f"chat case {c['name']}: jinja2 rendering")
        check(mdf.render_jinja(c["messages"], False) + "<|im_start|>assistant\n" == c["rendered"],
              f"chat case {c['name']}: rendering without the generation prompt")
        check(tok.encode(text, add_special_tokens=False).ids == c["ids"], f"chat case {c['name']}: ids")
        check(tok.decode(c["ids"], skip_special_tokens=True) == c["decoded_skip_special"], f"chat case {c['name']}: decode")
        prefix = mdf.system_turn(c["messages"])
        check(c["rendered"].encode("utf-8")[: c["system_prefix_bytes"]] == prefix.encode("utf-8"), f"chat case {c['name']}: prefix bytes")
        check(c["ids"][: c["system_prefix_tokens"]] == tok.encode(prefix, add_special_tokens=False).ids,
              f"chat case {c['name']}: prefix tokens")
    print(f"chat template ok ({len(cases['cases'])} cases, also rendered with jinja2)")


def check_logits(d, params):
    g = load(os.path.join(d, "goldens", "logits.json"))
    by_name = {}
    for c in g["cases"]:
        if "attention_mask" in c:
            n_pad = len(c["padded_ids"]) - len(c["ids"])
            check(c["padded_ids"][n_pad:] == c["ids"] and c["attention_mask"] == [0] * n_pad + [1] * len(c["ids"]),
                  f"logits {c['name']}: padding layout")
            lf = dream_ref.forward(params, c["padded_ids"], c["attention_mask"])[n_pad:]
        else:
            lf = dream_ref.forward(params, c["ids"])
        gf = np.array(c["logits_f32"], dtype=np.float64)
        check(gf.shape == lf.shape == tuple(c["shape"]), f"logits {c['name']}: shape")
        err = np.max(np.abs(gf - lf) / np.maximum(1.0, np.abs(lf)))
        check(err <= 1e-6, f"logits {c['name']}: f32 relative error {err:.3g}")
        check(list(np.argmax(lf, axis=-1)) == c["argmax_f32"], f"logits {c['name']}: argmax")
        by_name[c["name"]] = gf
        print(f"logits {c['name']}: f32 max rel err {err:.2g}")
    if check("left_padded" in by_name and "len12_bos" in by_name, "logits: left_padded and len12_bos cases"):
        diff = np.max(np.abs(by_name["left_padded"] - by_name["len12_bos"]))
        check(diff <= 1e-5 * max(1.0, np.max(np.abs(by_name["len12_bos"]))), f"left_padded differs from len12_bos by {diff:.3g}")


def expected_draws(fp, steps, masked_counts):
    """The draws each step must hold, re-drawn from the seed."""
    rng = np.random.Generator(np.random.PCG64(fp["seed"]))
    out = []
    for s, nm in zip(steps, masked_counts):
        if fp["alg"] == "origin":
            n = nm
        elif fp["alg_temp"]:
            n = len(s["committed"])
        else:
            n = 0
        out.append(rng.random(n).astype(np.float32) if n else None)
    return out


def check_schedule(c):
    """Re-derive each step's commit count from the recorded steps (independently of
    dream_ref.generate); returns the number of masks before each step."""
    fp, name = c["params"], c["name"]
    Lp, G = len(c["prompt"]), fp["gen_length"]
    masked = set(range(Lp, Lp + G))
    counts = []
    block_mode = fp["threshold"] is not None or fp["block_length"] < G
    nb = G // fp["block_length"]
    spb = fp["steps"] // nb
    for k, s in enumerate(c["steps"]):
        bs = Lp + s["block"] * fp["block_length"]
        be = bs + fp["block_length"]
        cand = sorted(masked) if not block_mode else sorted(p for p in masked if bs <= p < be)
        counts.append(len(cand))
        committed = s["committed"]
        check(set(committed) <= set(cand), f"generate {name} step {k}: commits outside the candidates")
        check(committed == sorted(committed), f"generate {name} step {k}: committed not ascending")
        n = len(committed)
        if not block_mode:
            check(s["step"] == k and s["block"] == 0, f"generate {name} step {k}: numbering")
            ts = np.linspace(1.0, fp["eps"], fp["steps"] + 1)
            last = k == fp["steps"] - 1
            if fp["alg"] == "origin":
                p = 1.0 if last else 1.0 - ts[k + 1] / ts[k]
                want = [q for q, u in zip(cand, s.get("draws", [])) if float(np.float32(u)) < p]
                check(committed == want and len(s.get("draws", [])) == len(cand), f"generate {name} step {k}: origin draws")
            else:
                check(n == dream_common.quota(len(cand), ts[k], ts[k + 1], last), f"generate {name} step {k}: quota")
        elif s["step"] == 0:
            check(committed == [bs], f"generate {name} step {k}: block step 0 must commit the block start")
        elif fp["threshold"] is None:
            ts = np.linspace(1.0, fp["eps"], spb + 1)
            i = s["step"]
            check(n == dream_common.quota(len(cand), ts[i], ts[i + 1], i == spb - 1), f"generate {name} step {k}: quota")
        else:
            check(n >= 1, f"generate {name} step {k}: threshold step commits nothing")
        masked -= set(committed)
    check(not masked, f"generate {name}: positions never committed: {sorted(masked)}")
    if block_mode and fp["threshold"] is None:
        check([(s["block"], s["step"]) for s in c["steps"]] == [(b, i) for b in range(nb) for i in range(spb)],
              f"generate {name}: block step numbering")
    return counts


def check_generate(d, params, tok):
    g = load(os.path.join(d, "goldens", "generate.json"))
    by_name = {}
    for c in g["cases"]:
        name, fp = c["name"], c["params"]
        by_name[name] = c
        check(c["prompt"] == tok.encode(mdf.render_chat(c["messages"]), add_special_tokens=False).ids, f"generate {name}: prompt ids")
        check(c["system_prefix_tokens"] == mdf.prefix_info(tok, c["messages"], c["prompt"])["tokens"], f"generate {name}: system prefix")
        out, trace = mdf.run_case(params, c["prompt"], fp)
        keys = ("block", "step", "committed", "tokens")
        check([int(i) for i in out] == c["output"], f"generate {name}: output")
        check([{k: s[k] for k in keys} for s in trace] == [{k: s[k] for k in keys} for s in c["steps"]], f"generate {name}: steps")
        check(all(("draws" in s) == ("draws" in t) for s, t in zip(trace, c["steps"])), f"generate {name}: steps with draws")
        check(all(np.array_equal(np.float32(s["draws"]), np.float32(t["draws"])) for s, t in zip(trace, c["steps"]) if "draws" in s),
              f"generate {name}: draws differ from the reference's")
        check(c["output"][: len(c["prompt"])] == c["prompt"], f"generate {name}: prompt not kept")
        check(fp["mask_id"] not in c["output"][len(c["prompt"]):], f"generate {name}: mask left in output")
        cm, lm = fixture_common.margins(trace)
        for key, val in (("min_margin", cm), ("min_logit_margin", lm)):
            stored = c[key]
            if math.isfinite(val):
                check(stored is not None and math.isclose(val, stored, rel_tol=1e-6), f"generate {name}: {key}")
                check(val >= fixture_common.MARGIN_FLOOR, f"generate {name}: {key} below the floor")
            else:
                check(stored is None, f"generate {name}: {key} should be null")
        check(mdf.quotas_are_robust(fp, trace), f"generate {name}: a quota depends on the precision")
        counts = check_schedule(c)
        if fp["threshold"] is None:
            check(len(c["steps"]) == fp["steps"], f"generate {name}: step count")
        drawn = expected_draws(fp, c["steps"], counts)
        stored = [s.get("draws") for s in c["steps"]]
        check(all((x is None and y is None) or (x is not None and y is not None and np.array_equal(np.array(y, dtype=np.float32), x))
                  for x, y in zip(drawn, stored)), f"generate {name}: draws are not float32(PCG64(seed).random(n))")
        if any(x is not None for x in stored):
            out2, _ = mdf.run_case(params, c["prompt"], dict(fp, seed=fp["seed"] + 1), draws=stored)
            check([int(i) for i in out2] == c["output"], f"generate {name}: replay from the stored draws")
        print(f"generate {name}: ok ({len(c['steps'])} steps, min_margin {cm:.3g}, min_logit_margin {lm:.3g})")
    check(len(by_name) == len(mdf.CASE_SPECS), "case count")
    if check("i_long_shared_prefix" in by_name and "a_maskgit_plus" in by_name, "cases a and i"):
        i, a = by_name["i_long_shared_prefix"], by_name["a_maskgit_plus"]
        n = i["shared_prefix_tokens"]
        check(n == len(a["prompt"]) and i["prompt"][:n] == a["prompt"], "case i does not start with case a's prompt")
    h = by_name.get("h_threshold")
    if h is not None:
        check(sum(1 for s in h["steps"] if s["step"] > 0 and len(s["committed"]) > 1) >= 2, "h_threshold: too few multi-commit steps")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=mdf.DEFAULT_OUT)
    args = ap.parse_args()
    d = args.dir
    fixture_common.check_files(d, 600_000, "600 KB")
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    cfg = check_config(d, tok)
    params = check_safetensors(d, cfg)
    check_tokenizer(d, tok)
    check_chat(d, tok)
    check_logits(d, params)
    check_generate(d, params, tok)
    fixture_common.finish_checks()


if __name__ == "__main__":
    main()
