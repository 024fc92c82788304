"""Self-check of tests/fixtures/tiny/: reload every file and re-run the reference.

Checks the file layout and size, the config keys, the safetensors files (with this
repository's reader and with the `safetensors` library), the tokenizer (loading,
round trips, special tokens, no added special tokens), the chat template cases (and,
if jinja2 is installed, the template string itself), and recomputes the logits and
generate goldens with tools/llada_ref.py.  The checks it shares with
tools/check_dream_fixture.py (file list, safetensors re-reading, tokenizer round
trips) are in tools/fixture_common.py.

Usage: tools/.venv/bin/python tools/check_fixture.py [--dir tests/fixtures/tiny]
Exits with status 1 on the first group of failures.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_common  # noqa: E402
import llada_ref  # noqa: E402
import make_fixture  # noqa: E402
from fixture_common import check, load  # noqa: E402

# key order of the LLaDA-8B-Instruct config.json (llada.md section 1)
SPEC_CONFIG_KEYS = [
    "activation_type", "alibi", "alibi_bias_max", "architectures", "attention_dropout",
    "attention_layer_norm", "attention_layer_norm_with_affine", "auto_map",
    "bias_for_layer_norm", "block_group_size", "block_type", "d_model", "embedding_dropout",
    "embedding_size", "eos_token_id", "flash_attention", "include_bias", "include_qkv_bias",
    "init_cutoff_factor", "init_device", "init_fn", "init_std", "input_emb_norm",
    "layer_norm_type", "layer_norm_with_affine", "mask_token_id", "max_sequence_length",
    "mlp_hidden_size", "mlp_ratio", "model_type", "multi_query_attention", "n_heads",
    "n_kv_heads", "n_layers", "pad_token_id", "precision", "residual_dropout", "rms_norm_eps",
    "rope", "rope_full_precision", "rope_theta", "scale_logits", "transformers_version",
    "use_cache", "vocab_size", "weight_tying",
]

def check_config(d, tok):
    cfg = load(os.path.join(d, "config.json"))
    check(list(cfg) == SPEC_CONFIG_KEYS, "config.json keys differ from the LLaDA layout")
    want = {
        "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "mlp_hidden_size": 96,
        "max_sequence_length": 256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "weight_tying": False, "block_type": "llama", "activation_type": "silu",
        "layer_norm_type": "rms", "rope": True,
    }
    for k, v in want.items():
        check(cfg[k] == v, f"config {k} = {cfg[k]!r}, expected {v!r}")
    check(cfg["vocab_size"] == cfg["embedding_size"], "vocab_size != embedding_size")
    check(cfg["vocab_size"] % 64 == 0, "vocab_size is not a multiple of 64")
    check(cfg["vocab_size"] > tok.get_vocab_size(with_added_tokens=True), "vocab_size must exceed the token count")
    check(cfg["mask_token_id"] == tok.token_to_id("<|mdm_mask|>"), "mask_token_id mismatch")
    check(cfg["eos_token_id"] == tok.token_to_id("<|endoftext|>"), "eos_token_id mismatch")
    check(cfg["pad_token_id"] == tok.token_to_id("<|endoftext|>"), "pad_token_id mismatch")
    gen = load(os.path.join(d, "generation_config.json"))
    check(gen["bos_token_id"] == tok.token_to_id("<|startoftext|>"), "generation_config bos mismatch")
    check(gen["eos_token_id"] == tok.token_to_id("<|endoftext|>"), "generation_config eos mismatch")
    tc = load(os.path.join(d, "tokenizer_config.json"))
    check(tc["chat_template"] == make_fixture.CHAT_TEMPLATE, "chat_template differs")
    check((tc["bos_token"], tc["eos_token"], tc["pad_token"]) == ("<|startoftext|>", "<|endoftext|>", "<|endoftext|>"),
          "tokenizer_config special tokens")
    for sid, entry in tc["added_tokens_decoder"].items():
        check(tok.token_to_id(entry["content"]) == int(sid), f"added_tokens_decoder {sid}")
    stm = load(os.path.join(d, "special_tokens_map.json"))
    check(stm["bos_token"]["content"] == "<|startoftext|>" and stm["eos_token"]["content"] == "<|endoftext|>",
          "special_tokens_map")
    print("config files ok")
    return cfg


def check_safetensors(d, cfg):
    params = llada_ref.load_checkpoint(d)
    total, _ = fixture_common.check_shards(d, params)
    n_expected = 3 + 9 * cfg["n_layers"]
    check(len(params["tensors"]) == n_expected, f"{len(params['tensors'])} tensors, expected {n_expected}")
    print(f"safetensors ok ({len(params['tensors'])} tensors, {total} bytes)")
    return params


def check_tokenizer(tok):
    ids = {t: tok.token_to_id(t) for t in make_fixture.SPECIAL_TOKENS}
    check(list(ids.values()) == list(range(make_fixture.N_ORDINARY, make_fixture.N_ORDINARY + 6)), f"special ids {ids}")
    check(tok.get_vocab_size(with_added_tokens=False) == make_fixture.N_ORDINARY, "ordinary vocabulary size")
    texts = [
        "Hello, how are you?",
        "The price is 12.50 dollars; 7 * 8 = 56.\n\nNew line\ttab",
        "Unicode: café, naïve, 東京, emoji 🙂",
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|endoftext|><|mdm_mask|>",
    ]
    fixture_common.check_round_trips(tok, texts, ids)
    enc = tok.encode("<|startoftext|>hi", add_special_tokens=False).ids
    check(enc[0] == ids["<|startoftext|>"] and len(enc) >= 2, f"'<|startoftext|>hi' -> {enc}")
    check(tok.decode(tok.encode("<|eot_id|>Hi<|endoftext|>", add_special_tokens=False).ids, skip_special_tokens=True) == "Hi",
          "skip_special_tokens decode")
    print(f"tokenizer ok ('<|startoftext|>hi' -> {enc})")


def check_chat(d, tok):
    cases = load(os.path.join(d, "chat_template_cases.json"))
    try:
        import jinja2
    except ImportError:
        jinja2 = None
    for c in cases["cases"]:
        text = make_fixture.render_chat(c["messages"], cases["bos_token"])
        check(text == c["rendered"], f"chat case {c['name']}: rendering")
        check(tok.encode(text, add_special_tokens=False).ids == c["ids"], f"chat case {c['name']}: ids")
        check(tok.decode(c["ids"], skip_special_tokens=True) == c["decoded_skip_special"], f"chat case {c['name']}: decode")
        if jinja2 is not None:
            env = jinja2.Environment()
            tmpl = env.from_string(make_fixture.CHAT_TEMPLATE)
            for agp in (False, True):
                j = tmpl.render(messages=c["messages"], bos_token=cases["bos_token"], add_generation_prompt=agp)
                check(j == c["rendered"], f"chat case {c['name']}: jinja2 rendering differs")
    print("chat template ok" + (" (also checked with jinja2)" if jinja2 is not None else ""))


def check_logits(d, params):
    g = load(os.path.join(d, "goldens", "logits.json"))
    for c in g["cases"]:
        lf = llada_ref.forward(params, c["ids"], bf16_rounding=False)
        lb = llada_ref.forward(params, c["ids"], bf16_rounding=True)
        gf = np.array(c["logits_f32"], dtype=np.float64)
        gb = np.array(c["logits_bf16"], dtype=np.float32)
        check(gf.shape == lf.shape == tuple(c["shape"]), f"logits {c['name']}: shape")
        err = np.max(np.abs(gf - lf) / np.maximum(1.0, np.abs(lf)))
        check(err <= 1e-6, f"logits {c['name']}: f32 relative error {err:.3g}")
        check(np.array_equal(llada_ref.bf16_round(gb), gb), f"logits {c['name']}: bf16 golden values are not exact bf16")
        ulp = np.abs(llada_ref.f32_to_bf16_bits(gb).astype(np.int64) - llada_ref.f32_to_bf16_bits(lb).astype(np.int64))
        check(ulp.max() <= 1 and (ulp > 0).sum() <= 3, f"logits {c['name']}: bf16 path differs by up to {ulp.max()} ulp")
        check(list(np.argmax(lf, axis=-1)) == c["argmax_f32"], f"logits {c['name']}: argmax")
        print(f"logits {c['name']}: f32 max rel err {err:.2g}, bf16 ulp mismatches {(ulp > 0).sum()}")


def check_generate(d, params):
    g = load(os.path.join(d, "goldens", "generate.json"))
    names = []
    for c in g["cases"]:
        names.append(c["name"])
        fp = c["params"]
        T = len(c["prompt"]) + fp["gen_length"]
        out, trace = make_fixture.run_case(params, c["prompt"], fp)
        steps = [{"block": s["block"], "step": s["step"], "committed": s["committed"], "tokens": s["tokens"]} for s in trace]
        check([int(i) for i in out] == c["output"], f"generate {c['name']}: output")
        check(steps == c["steps"], f"generate {c['name']}: steps")
        check(c["output"][: len(c["prompt"])] == c["prompt"], f"generate {c['name']}: prompt not kept")
        check(fp["mask_id"] not in c["output"][len(c["prompt"]):], f"generate {c['name']}: mask left in output")
        committed = sorted(p for s in c["steps"] for p in s["committed"])
        check(committed == list(range(len(c["prompt"]), T)), f"generate {c['name']}: every position committed once")
        cm, lm = fixture_common.margins(trace)
        check(math.isclose(cm, c["min_margin"], rel_tol=1e-6), f"generate {c['name']}: min_margin")
        check(math.isclose(lm, c["min_logit_margin"], rel_tol=1e-6), f"generate {c['name']}: min_logit_margin")
        check(cm >= fixture_common.MARGIN_FLOOR and lm >= fixture_common.MARGIN_FLOOR, f"generate {c['name']}: margin below floor")
        if fp["threshold"] is None:
            nb = fp["gen_length"] // fp["block_length"]
            check(len(c["steps"]) == fp["steps"], f"generate {c['name']}: step count")
            for b in range(nb):
                quotas = [len(s["committed"]) for s in c["steps"] if s["block"] == b]
                check(quotas == llada_ref.num_transfer_tokens(fp["block_length"], fp["steps"] // nb),
                      f"generate {c['name']}: quotas of block {b}")
        if fp["remasking"] == "random":
            rc = c["random_confidences"]
            check(len(rc) == len(c["steps"]) and all(len(r) == T for r in rc), f"generate {c['name']}: random_confidences shape")
            rng = np.random.Generator(np.random.PCG64(fp["seed"]))
            drawn = [rng.random(T).astype(np.float32) for _ in rc]
            check(all(np.array_equal(np.array(r, dtype=np.float32), x) for r, x in zip(rc, drawn)),
                  f"generate {c['name']}: random_confidences are not float32(PCG64(seed).random(T))")
            out2, trace2 = make_fixture.run_case(params, c["prompt"], dict(fp, seed=fp["seed"] + 1), rng_uniform=rc)
            check([int(i) for i in out2] == c["output"], f"generate {c['name']}: replay from random_confidences")
        else:
            check(c["random_confidences"] is None, f"generate {c['name']}: unexpected random_confidences")
        print(f"generate {c['name']}: ok ({len(c['steps'])} steps, min_margin {cm:.3g}, min_logit_margin {lm:.3g})")
    check(len(names) == 8 and len(set(names)) == 8, "eight distinct generate cases")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=make_fixture.DEFAULT_OUT)
    args = ap.parse_args()
    d = args.dir
    fixture_common.check_files(d, 1 << 20, "1 MiB")
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    cfg = check_config(d, tok)
    params = check_safetensors(d, cfg)
    check_tokenizer(tok)
    check_chat(d, tok)
    check_logits(d, params)
    check_generate(d, params)
    fixture_common.finish_checks()


if __name__ == "__main__":
    main()
