"""A PyTorch model of BiCache's layer split, to check a model folder without the runtime.

`CachedForward` runs the LLaDA forward of tools/train.py row-selectively: a prefix-only pass
stores every layer's prefix K/V (after RoPE) and hidden state; a cached pass then computes
the layers below depth b for the non-prefix rows only, against the stored prefix K/V, and
from layer b on starts the prefix rows from the stored hidden state after layer b - 1 and
recomputes them with the rest of the request present (BiCache's boundary state).  b = 0 is
the uncached forward; b = n_layers reuses every layer (an autoregressive runtime's prefix
cache: `prefix-arm`).  The deep prefix is recomputed at every step here, the most exact
BiCache; the runtime refreshes it at block starts.

Used by tools/deepen.py (the accuracy of a planted model at every depth) and by hand:

  tools/.venv/bin/python tools/cache_sim.py --model models/tiny --set data/tasks/heldout-small.jsonl --depth 0,2,3,4
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402
import train  # noqa: E402


def block_rows(blk, x, pos, cos, sin, ext=None):
    """One layer for the rows x [T, D] at absolute positions pos; ext = (K, V) of other rows
    ([heads, P, hd], after RoPE) that the rows also attend to.  Returns (output, (K, V))."""
    T, D = x.shape
    h = blk.attn_norm(x)
    q = blk.q_proj(h).view(T, blk.n_heads, blk.hd).transpose(0, 1)
    k = blk.k_proj(h).view(T, blk.n_kv, blk.hd).transpose(0, 1)
    v = blk.v_proj(h).view(T, blk.n_kv, blk.hd).transpose(0, 1)
    q, k = train.rope(q, cos[pos], sin[pos]), train.rope(k, cos[pos], sin[pos])
    own = (k, v)
    if ext is not None:
        k, v = torch.cat((ext[0], k), dim=1), torch.cat((ext[1], v), dim=1)
    if blk.n_kv < blk.n_heads:
        rep = blk.n_heads // blk.n_kv
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    a = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    x = x + blk.attn_out(a.transpose(0, 1).reshape(T, D))
    hh = blk.ff_norm(x)
    return x + blk.ff_out(F.silu(blk.ff_proj(hh)) * blk.up_proj(hh)), own


class CachedForward:
    def __init__(self, model):
        self.m = model
        self.tr = model.transformer

    @torch.no_grad()
    def states(self, ids):
        """Every layer's (input hidden state, K, V) of an uncached pass over ids."""
        T = len(ids)
        pos = torch.arange(T)
        x = self.tr.wte(torch.tensor(ids))
        out = []
        for blk in self.tr.blocks:
            y, kv = block_rows(blk, x, pos, self.m.cos, self.m.sin)
            out.append((x, kv[0], kv[1]))
            x = y
        return out, x

    @torch.no_grad()
    def prefix_entry(self, prefix):
        """Per layer: (K, V) of the prefix alone and the hidden state after that layer."""
        st, last = self.states(prefix)
        hidden = [s[0] for s in st[1:]] + [last]
        return [(k, v, h) for (_, k, v), h in zip(st, hidden)]

    @torch.no_grad()
    def logits(self, ids, p, entry, depth):
        """Logits of rows p.. of ids with the prefix ids[:p] cached to `depth` layers."""
        T = len(ids)
        if depth == 0 or p == 0:
            st, x = self.states(ids)
            return self.tr.ff_out(self.tr.ln_f(x[p:]))
        pos = torch.arange(p, T)
        x = self.tr.wte(torch.tensor(ids[p:]))
        for li, blk in enumerate(self.tr.blocks):
            if li < depth:
                x, _ = block_rows(blk, x, pos, self.m.cos, self.m.sin, ext=entry[li][:2])
            else:
                if li == depth:  # the boundary state: the prefix-only hidden state after layer b-1
                    x = torch.cat((entry[li - 1][2], x), dim=0)
                    pos = torch.arange(T)
                x, _ = block_rows(blk, x, pos, self.m.cos, self.m.sin)
        if depth < len(self.tr.blocks):
            x = x[p:]
        return self.tr.ff_out(self.tr.ln_f(x))


@torch.no_grad()
def generate(cf, prompt, p, depth, ids, steps=16, gen_length=32, block_length=4):
    """train.generate_batch's sampler (one prompt) on CachedForward logits."""
    x = torch.tensor(list(prompt) + [ids.mask] * gen_length)
    entry = cf.prefix_entry(list(prompt[:p])) if depth else None
    L = len(prompt)
    spb = steps // (gen_length // block_length)
    for blk in range(gen_length // block_length):
        lo = L + blk * block_length
        seg = slice(lo, lo + block_length)
        counts = train.transfer_counts(block_length, spb)
        for s in range(spb):
            logits = cf.logits(x.tolist(), p, entry, depth).double()
            x0 = logits.argmax(-1)
            conf = torch.softmax(logits, -1).gather(-1, x0[..., None])[..., 0]
            order = train.most_confident(conf[lo - p : lo - p + block_length], x[seg] == ids.mask, counts[s]) + lo
            x[order] = x0[order - p]
    return x[L:].tolist()


def prefix_end(ids, eot_id):
    """Tokens of the shared prefix of a system + user chat: BOS, the system turn and its end
    of turn (the engine's split)."""
    return ids.index(eot_id) + 1


def prefix_len(tok, item):
    """(prompt ids, length of their shared prefix) of a task item."""
    full = tok.encode(tasks.render_chat(item["system"], item["user"]), add_special_tokens=False).ids
    return full, prefix_end(full, tok.token_to_id("<|eot_id|>"))


def accuracy(model, tok, items, depths, **sampler):
    """{depth: (correct, n, per task)} over items."""
    ids = train.Ids(tok)
    cf = CachedForward(model)
    out = {}
    for d in depths:
        per, ok_all = {}, 0
        for it in items:
            prompt, p = prefix_len(tok, it)
            gen = generate(cf, prompt, p, d, ids, **sampler)
            ok = train.extract_answer(tok, ids, gen) == it["answer"]
            c, n = per.get(it["task"], (0, 0))
            per[it["task"]] = (c + ok, n + 1)
            ok_all += ok
        out[d] = (ok_all, len(items), per)
    return out


def main():
    import py_eval
    import llada_ref

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--set", required=True)
    ap.add_argument("--depth", default="0", help="comma-separated depths b (0: no cache)")
    ap.add_argument("--limit", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = py_eval.torch_model(llada_ref.load_checkpoint(args.model))
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    items = py_eval.load_items(args.set)
    if args.limit:
        items = items[: args.limit]
    res = accuracy(model, tok, items, [int(d) for d in args.depth.split(",")])
    for d, (c, n, per) in res.items():
        print(json.dumps({"depth": d, "correct": c, "n": n, "accuracy": round(c / n, 4), "per_task": per}))


if __name__ == "__main__":
    main()
