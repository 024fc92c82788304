"""numpy reference of ACache (the runtime's `--cache acache`), and its goldens.

The algorithm, as the runtime runs it (docs/architecture.md, src/acache.rs):

1. The span's K/V for every layer from a pass over the span alone (positions 0..S).
2. Placed at the request's offset o: every key rotated by o more positions (RoPE is a
   rotation, so the key at p becomes the key at p + o); values unchanged.
3. Probe: one pass over every row but the span's (the prompt's other tokens and the
   masked canvas), attending to every position (span rows: the placed entry).  In every
   layer, for each head and each masked row, softmax(q . k / sqrt(hd)) over the span's
   keys alone; a span token's importance is the sum over layers, heads and masked rows.
4. Anchors: the ceil(ratio * S) most important span tokens (ties to the lower position).
5. Decoding on the dual cache: at each block start (the first step included) every row
   but the span's non-anchor rows is computed (their K/V overwrite the arena; non-anchor
   span rows keep the entry's K/V at every depth); within a block only the block's rows.
   Every computed row attends to every position.  LLaDA's quota sampler at temperature 0
   (low-confidence remasking), predictions for the current block's masked positions.

Float32 storage, float64 arithmetic, as tools/llada_ref.py.

    python3 tools/acache_ref.py --model tests/fixtures/tiny --write-goldens   # goldens/acache.json
    python3 tools/acache_ref.py --model tests/fixtures/tiny --check           # recompute, compare

The runtime is checked against goldens/acache.json by `cargo test --test all acache::`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llada_ref  # noqa: E402


class Model:
    """A LLaDA checkpoint run row by row against per-layer K/V arenas."""

    def __init__(self, params):
        self.cfg, self.W = params["config"], params["tensors"]
        c = self.cfg
        self.D, self.H, self.Hkv, self.hd = c["d_model"], c["n_heads"], c["n_kv_heads"], c["head_dim"]
        self.L = c["n_layers"]
        self.nm = llada_ref._Numerics(False)
        self.cos, self.sin = llada_ref.rope_tables(c["max_sequence_length"], self.hd, c["rope_theta"])

    def w(self, i, name):
        return self.W[f"model.transformer.blocks.{i}.{name}.weight"]

    def empty_arena(self, T):
        return [(np.zeros((self.Hkv, T, self.hd), np.float32), np.zeros((self.Hkv, T, self.hd), np.float32))
                for _ in range(self.L)]

    def project(self, i, x, positions, what="qkv"):
        """Layer i's q and k (rotated at `positions`) and v of the rows x, as {name: [heads, n, hd]}."""
        nm, hd = self.nm, self.hd
        h = nm.rmsnorm(x, self.w(i, "attn_norm"), self.cfg["rms_norm_eps"])
        pos = np.asarray(positions)
        cos, sin = self.cos[pos], self.sin[pos]
        heads = {"q": self.H, "k": self.Hkv, "v": self.Hkv}
        out = {}
        for name in what:
            t = nm.matmul(h, self.w(i, name + "_proj")).reshape(len(pos), heads[name], hd).transpose(1, 0, 2)
            out[name] = t if name == "v" else nm.rope(t, cos, sin)
        return out

    def attend(self, i, q, K, V, probe=None):
        """Layer i's attention output (after attn_out) of the queries q [H, n, hd] over K, V
        [Hkv, keys, hd].  With `probe` = (masked query indices, span range, importance), the
        masked queries' softmax over the span's keys alone is added to the importance."""
        kv_of_q = np.arange(self.H) // (self.H // self.Hkv)
        s = np.einsum("htd,hsd->hts", q.astype(np.float64), K.astype(np.float64)[kv_of_q]) / math.sqrt(self.hd)
        if probe is not None:
            masked, (a, b), importance = probe
            ss = s[:, masked, a:b]
            ss = ss - ss.max(axis=-1, keepdims=True)
            pr = np.exp(ss)
            importance += (pr / pr.sum(axis=-1, keepdims=True)).sum(axis=(0, 1))
        s -= s.max(axis=-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(axis=-1, keepdims=True)
        n = q.shape[1]
        a = self.nm.store(np.einsum("hts,hsd->htd", pr, V.astype(np.float64)[kv_of_q]))
        return self.nm.matmul(a.transpose(1, 0, 2).reshape(n, self.D), self.w(i, "attn_out"))

    def mlp(self, i, x):
        """Layer i's MLP output (after ff_out) of the rows x (its input, before ff_norm)."""
        nm = self.nm
        h = nm.rmsnorm(x, self.w(i, "ff_norm"), self.cfg["rms_norm_eps"])
        g = nm.matmul(h, self.w(i, "ff_proj")).astype(np.float64)
        u = nm.matmul(h, self.w(i, "up_proj"))
        return nm.matmul(nm.store(g / (1.0 + np.exp(-g)) * u), self.w(i, "ff_out"))

    def rows(self, ids, positions, arena, kv_len, probe=None):
        """Hidden rows after every layer for the tokens `ids` at `positions`; their K/V go
        to arena rows `positions`; every row attends to arena rows 0..kv_len.  With
        `probe` (see `attend`), every layer adds to the importance."""
        nm = self.nm
        pos = np.asarray(positions)
        x = self.W["model.transformer.wte.weight"][np.asarray(ids)].astype(np.float32)
        for i in range(self.L):
            qkv = self.project(i, x, pos)
            K, V = arena[i]
            K[:, pos], V[:, pos] = qkv["k"], qkv["v"]
            att = self.attend(i, qkv["q"], K[:, :kv_len], V[:, :kv_len], probe)
            x = nm.store(x.astype(np.float64) + att)
            x = nm.store(x.astype(np.float64) + self.mlp(i, x))
        return x

    def logits(self, x):
        x = self.nm.rmsnorm(x, self.W["model.transformer.ln_f.weight"], self.cfg["rms_norm_eps"])
        head = self.W["model.transformer.wte.weight" if self.cfg["weight_tying"] else "model.transformer.ff_out.weight"]
        return self.nm.matmul(x, head)

    def rotate(self, k, offset):
        """Keys [Hkv, S, hd] rotated by `offset` positions."""
        return self.nm.rope(k, self.cos[offset], self.sin[offset])


def anchor_count(ratio, length):
    """ceil(ratio * length), the decimal ratio's binary rounding ignored (the runtime's)."""
    return min(length, max(0, math.ceil(float(np.float32(ratio)) * length - 1e-6)))


def generate(model, prompt, span, ratio, gen_length, steps, block_length, mask_id):
    """ACache generation at temperature 0.  Returns (tokens, anchors, importance, trace)."""
    prompt = list(prompt)
    a, b = span
    S = b - a
    Lp = len(prompt)
    T = Lp + gen_length
    x = np.array(prompt + [mask_id] * gen_length, dtype=np.int64)
    # 1. The entry: the span alone at positions 0..S.
    entry = model.empty_arena(S)
    model.rows(x[a:b], list(range(S)), entry, S)
    # 2. Placed at offset a of the request's arena.
    arena = model.empty_arena(T)
    for (K, V), (ek, ev) in zip(arena, entry):
        K[:, a:b] = model.rotate(ek, a)
        V[:, a:b] = ev
    # 3-4. The probe and the anchors.
    outside = [p for p in range(T) if not a <= p < b]
    k = anchor_count(ratio, S)
    importance = np.zeros(S, np.float64)
    if 0 < k < S:
        masked = [i for i, p in enumerate(outside) if x[p] == mask_id]
        model.rows(x[outside], outside, arena, T, probe=(masked, span, importance))
        order = llada_ref.rank_order(importance)
        anchors = sorted(int(j) for j in order[:k])
    else:
        anchors = list(range(S)) if k == S else []
    refresh = sorted(outside + [a + j for j in anchors])
    # 5. Blocks on the dual cache.
    trace = []
    blocks = gen_length // block_length
    for nb in range(blocks):
        b0, b1 = Lp + nb * block_length, Lp + (nb + 1) * block_length
        quotas = llada_ref.num_transfer_tokens(int((x[b0:b1] == mask_id).sum()), steps // blocks)
        for i, quota in enumerate(quotas):
            rows = refresh if i == 0 else list(range(b0, b1))
            hidden = model.rows(x[rows], rows, arena, T)
            where = {p: r for r, p in enumerate(rows)}
            cand = [p for p in range(b0, b1) if x[p] == mask_id]
            logits = model.logits(hidden[[where[p] for p in cand]]).astype(np.float64)
            x0 = np.argmax(logits, axis=-1)
            conf = llada_ref.softmax64(logits)[np.arange(len(cand)), x0]
            order = llada_ref.rank_order(conf)
            chosen = sorted(cand[j] for j in order[:quota])
            # None: every candidate committed, no other choice was possible.
            margin = float(conf[order[quota - 1]] - conf[order[quota]]) if quota < len(cand) else None
            for j in order[:quota]:
                x[cand[j]] = int(x0[j])
            trace.append({"block": nb, "step": i, "committed": chosen,
                          "tokens": [int(x[p]) for p in chosen], "conf_margin": margin})
    return x[Lp:].tolist(), anchors, importance, trace


# The goldens: prompts of the tiny fixture with a span in the middle and at the start.
CASES = [
    # name, prompt length, span, ratio, gen_length, steps, block_length
    ("middle_quarter", 28, (6, 22), 0.25, 8, 8, 4),
    ("middle_half_one_block", 28, (6, 22), 0.5, 8, 4, 8),
    ("front_direct_reuse", 24, (0, 16), 0.0, 8, 8, 4),
    ("end_fifth", 26, (10, 26), 0.2, 8, 8, 2),
]


def prompt_of(n, vocab_lo=10, vocab_hi=250, seed=7):
    rng = np.random.Generator(np.random.PCG64(seed))
    return [int(t) for t in rng.integers(vocab_lo, vocab_hi, size=n)]


def build_goldens(model, mask_id):
    out = []
    for name, n, span, ratio, g, steps, block in CASES:
        prompt = prompt_of(n)
        tokens, anchors, importance, trace = generate(model, prompt, span, ratio, g, steps, block, mask_id)
        k = len(anchors)
        srt = np.sort(importance)[::-1]
        gap = float(srt[k - 1] - srt[k]) if 0 < k < len(srt) else None
        out.append({
            "name": name, "prompt": prompt, "span": list(span), "anchor_ratio": ratio,
            "gen_length": g, "steps": steps, "block_length": block,
            "anchors": [span[0] + a for a in anchors], "importance": [float(v) for v in importance],
            "importance_gap": gap, "output": tokens, "steps_trace": trace,
            "min_conf_margin": min((t["conf_margin"] for t in trace if t["conf_margin"] is not None), default=None),
        })
    return {"description": "ACache (tools/acache_ref.py): anchors and temperature-0 tokens", "cases": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--write-goldens", action="store_true")
    ap.add_argument("--check", action="store_true", help="recompute the goldens and compare")
    args = ap.parse_args()
    params = llada_ref.load_checkpoint(args.model)
    model = Model(params)
    mask_id = params["config"]["mask_token_id"]
    goldens = build_goldens(model, mask_id)
    path = os.path.join(args.model, "goldens", "acache.json")
    if args.write_goldens:
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(json.dumps(goldens, indent=1, allow_nan=False) + "\n")
    for c in goldens["cases"]:
        print(f"{c['name']}: anchors {c['anchors']} (gap {c['importance_gap']}), "
              f"output {c['output']}, min margin {c['min_conf_margin']}")
    if args.check:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
        bad = [c["name"] for c, s in zip(goldens["cases"], stored["cases"])
               if (c["anchors"], c["output"]) != (s["anchors"], s["output"])]
        if bad:
            sys.exit(f"differs from {path}: {bad}")
        print(f"{path}: every case agrees")


if __name__ == "__main__":
    main()
