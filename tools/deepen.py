"""Deepen the 2-layer bundled model into a 4-layer model whose deep prefix rows read the request.

EXPERIMENTAL: this construction does not yet give a model that meets the accuracy testbed's
bar (docs/models/deepening.md has every measured attempt and what each one showed); the
bundled model is still the 2-layer one it starts from.

The bundled model answers from its system prompt, but nothing in that prompt reads the
question, so the prefix K/V computed without the question are exact at every depth and
every cache is exact on it (tools/cache_sim.py: depth 0 and prefix-arm both 100 %).  In
LLaDA-8B the prefix rows of the deep layers attend to the request.  The construction here
plants that as a circuit on top of the trained base:

* width 128 -> 192 (a third head of 64) and 2 -> 4 layers; layer 0 is the base's layer 0
  (heads writing codes of the token 3 back, the name of a table value, and 2 back, its
  field), layer 3 the base's layer 1 (the recall head and the head that copies the asked
  names into the answer); the base's weights act on the first 128 dimensions as before
  (RMSNorm weights scaled by sqrt(128/192)), checked by the widened model's logits;
* layer 1's MLP writes every token's own name code (as layer 0 writes it for the value
  three positions later), small, into dims 160-191;
* layer 2 head 2 ("mark"): a table value row attends to the question's token of its own
  name when the question asks for it, else to BOS; query/key are fitted by gradient descent
  on that attention pattern (the 14 slowest RoPE planes), the value copies the attended
  own code into dims 128-159;
* layer 3's recall key is made blind to a table row's own name (the between-name subspace
  of its input projected out) and reads the name from dims 128-159 instead (fitted by
  gradient descent on the recall pattern);
* an optional fine-tune of every weight (tools/train.py's objective, prefix rows local in
  layers 0-1, the recall key kept blind after every step), monitored with the prefix
  reused at every depth (tools/cache_sim.py), to see whether it rebuilds a prefix-only path.

Usage:
  tools/.venv/bin/python tools/deepen.py --base models/tiny --out runs/deep --seed 0 [--finetune-steps N]
  tools/.venv/bin/python tools/deepen.py --base models/tiny --out runs/deep --resume --finetune-steps N
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cache_sim  # noqa: E402
import llada_ref  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402

MARK_LAYER, MARK_HEAD = 2, 2
READ_LAYER, READ_HEAD = 3, 0
LOCAL_LAYERS = 2  # layers whose prefix rows see only the prefix while training
BASE_D = 128
CAL_GROUPS = 70_000_000  # training-stream groups for the fits (never the held-out stream)
FIT_VALID_GROUPS = 71_000_000
MONITOR_GROUPS = 72_000_000


def load_base(path):
    params = llada_ref.load_checkpoint(path)
    c = params["config"]
    cfg = {k: c[k] for k in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size",
                             "embedding_size", "max_sequence_length", "rope_theta", "rms_norm_eps")}
    for k in ("mask_token_id", "eos_token_id", "pad_token_id"):
        cfg[k] = c[k]
    m = train.LLaDA(cfg)
    m.load_state_dict({k[len("model."):]: torch.from_numpy(v) for k, v in params["tensors"].items()}, strict=True)
    return m, Tokenizer.from_file(os.path.join(path, "tokenizer.json"))


@torch.no_grad()
def widen(base, d_model, n_heads, n_layers, placement, max_seq):
    """A zero model of the new shape with the base's layers at `placement` (new index -> base
    index) acting on the first base-width dimensions exactly as in the base."""
    cfg = dict(base.c)
    cfg.update(d_model=d_model, n_heads=n_heads, n_kv_heads=n_heads, n_layers=n_layers, max_sequence_length=max_seq)
    m = train.LLaDA(cfg)
    for p in m.parameters():
        p.zero_()
    d0 = base.c["d_model"]
    scale = math.sqrt(d0 / d_model)  # the RMS over the wider stream, where the new dims are 0
    T, B = m.transformer, base.transformer
    T.wte.weight[:, :d0] = B.wte.weight
    T.ff_out.weight[:, :d0] = B.ff_out.weight
    T.ln_f.weight[:d0] = B.ln_f.weight * scale
    for i, nb in enumerate(T.blocks):
        for nm in ("attn_norm", "ff_norm"):
            getattr(nb, nm).weight[:] = 1.0
            getattr(nb, nm).weight[:d0] = scale
        if i not in placement:
            continue
        ob = B.blocks[placement[i]]
        for nm in ("attn_norm", "ff_norm"):
            getattr(nb, nm).weight[:d0] = getattr(ob, nm).weight * scale
        for nm in ("q_proj", "k_proj", "v_proj", "attn_out"):
            getattr(nb, nm).weight[:d0, :d0] = getattr(ob, nm).weight
        f0 = ob.ff_proj.weight.shape[0]
        nb.ff_proj.weight[:f0, :d0] = ob.ff_proj.weight
        nb.up_proj.weight[:f0, :d0] = ob.up_proj.weight
        nb.ff_out.weight[:d0, :f0] = ob.ff_out.weight
    return m


class Vocab:
    def __init__(self, tok):
        self.names = {tok.token_to_id("Ġ" + n): i for i, n in enumerate(tasks.NAMES)}
        self.fields = {tok.token_to_id("Ġ" + f) for f in tasks.FIELD_NAMES}
        self.colon = tok.token_to_id("Ġ:")
        if None in self.names or None in self.fields or self.colon is None:
            raise RuntimeError("a name, field or ':' is not one token of this tokenizer")

    def is_value_row(self, seq, i):
        """A value after `NAME FIELD :` (in the table or in an answer)."""
        return i >= 3 and seq[i - 3] in self.names and seq[i - 2] in self.fields and seq[i - 1] == self.colon


def encoded(tok, ids, item):
    prompt, resp = train.encode_item(tok, ids, item)
    return prompt, resp, cache_sim.prefix_end(prompt, ids.eot)


@torch.no_grad()
def layer_input(model, layer, seq):
    """The normalised input of `layer`'s attention for an uncached pass over seq."""
    st, _ = cache_sim.CachedForward(model).states(seq)
    return model.transformer.blocks[layer].attn_norm(st[layer][0])


def items_from(start, groups, per_group, members=8):
    return list(tasks.train_items(0, start, groups, per_group, members))


def head_rows(head, hd):
    return slice(head * hd, (head + 1) * hd)


def slow_dims(hd, first_plane):
    planes = list(range(first_plane, hd // 2))
    return planes + [j + hd // 2 for j in planes]


# ---------------------------------------------------------------------------
# layer 1: every token's own name code
# ---------------------------------------------------------------------------

OWN_LAYER = 1
OWN_SCALE = 0.1


@torch.no_grad()
def own_code_targets(model, hd):
    """For every vocabulary token, the code layer 0's name head writes 3 positions after it:
    its value/output map applied to the token's normalised embedding (code dims [hd, 1.5 hd))."""
    b0 = model.transformer.blocks[0]
    e = b0.attn_norm(model.transformer.wte.weight)
    out = b0.attn_out.weight[:, :hd] @ b0.v_proj.weight[:hd] @ e.T
    return out.T[:, hd : hd + hd // 2]


@torch.no_grad()
def plant_own_code(model, tok, ids, items, own_dims, gate=8.0, scale=0.1):
    """Layer 1's MLP writes each token's own name code (as layer 0 writes it for the value 3
    after a name) into own_dims, so the mark head compares a row's name code with a token's
    code in one representation, as the base's recall head compares codes.  The MLP is linear
    here: every gate unit reads a constant feature (least squares: 1 at every row) times
    `gate`, where silu is nearly the identity; the up rows are a least-squares map from the
    normalised input to the code."""
    hd = model.c["d_model"] // model.c["n_heads"]
    targets = own_code_targets(model, hd)
    blk = model.transformer.blocks[OWN_LAYER]
    X, Y = [], []
    for it in items:
        prompt, resp, _ = encoded(tok, ids, it)
        for seq in (prompt + resp, prompt + [ids.mask] * len(resp)):
            st, _ = cache_sim.CachedForward(model).states(seq)
            x = st[OWN_LAYER][0]  # layer 1's attention is zero here: its MLP input is this row
            X.append(blk.ff_norm(x)[:, :BASE_D])
            Y.append(targets[torch.tensor(seq)])
    X, Y = torch.cat(X).double(), torch.cat(Y).double()
    ridge = 1e-3 * len(X)
    A = X.T @ X + ridge * torch.eye(BASE_D, dtype=torch.float64)
    W = torch.linalg.solve(A, X.T @ Y).T.float()
    c = torch.linalg.solve(A, X.T @ torch.ones(len(X), 1, dtype=torch.float64)).T.float()[0]
    n = len(own_dims)
    blk.ff_proj.weight[:n] = 0.0
    blk.up_proj.weight[:n] = 0.0
    blk.ff_out.weight[:, :n] = 0.0
    blk.ff_proj.weight[:n, :BASE_D] = gate * c
    blk.up_proj.weight[:n, :BASE_D] = W
    # written small: the RMS of every row stays nearly the base's
    blk.ff_out.weight[own_dims, :n] = scale * torch.eye(n) / gate
    pred = X.float() @ W.T
    return {"own_code_cos": round(float(F.cosine_similarity(pred, Y.float()).mean()), 4),
            "constant_feature_std": round(float((X.float() @ c).std()), 4)}


# ---------------------------------------------------------------------------
# the mark head (layer 2)
# ---------------------------------------------------------------------------


def mark_examples(model, tok, ids, voc, items):
    """(normalised layer-2 input, target mask [T, T], value-row mask) per calibration sequence:
    masked canvas, answered canvas, and the prefix alone.  A value row whose name the
    question asks for targets the request's tokens of that name; every other row targets BOS."""
    out = []
    for it in items:
        prompt, resp, p = encoded(tok, ids, it)
        asked = {t for t in tok.encode(it["user"], add_special_tokens=False).ids if t in voc.names}
        for seq, ask in ((prompt + [ids.mask] * len(resp), asked), (prompt + resp, asked), (prompt[:p], set())):
            T = len(seq)
            h = layer_input(model, MARK_LAYER, seq)
            target = torch.zeros(T, T, dtype=torch.bool)
            val = torch.zeros(T, dtype=torch.bool)
            for i in range(T):
                val[i] = voc.is_value_row(seq, i)
                tg = [j for j in range(p, T) if seq[j] == seq[i - 3]] if val[i] and seq[i - 3] in ask else []
                target[i, tg or [0]] = True
            out.append((h, target, val, torch.tensor(seq)))
    return out


def rope_scores(model, q, k, qpos, kpos):
    q = train.rope(q, model.cos[qpos], model.sin[qpos])
    k = train.rope(k, model.cos[kpos], model.sin[kpos])
    return q @ k.T / math.sqrt(q.shape[-1])


def target_loss(scores, target, weight):
    lp = torch.log_softmax(scores, -1)
    nll = -torch.logsumexp(lp.masked_fill(~target, -1e9), -1)
    return (nll * weight).sum() / weight.sum()


def target_mass(scores, target):
    return (torch.softmax(scores, -1) * target).sum(-1)


def fit_mark_qk(model, train_ex, valid_ex, dims, q_inputs, k_inputs, steps, seed, log):
    """Query and key of the mark head on the RoPE dims `dims`, the query reading only the
    input dims q_inputs (the name code and the shared direction), the key only k_inputs (the
    token embedding and the code of the token 2 back, which tells the question's names from
    the table's: a table name follows a line break)."""
    hd = model.c["d_model"] // model.c["n_heads"]
    D = model.c["d_model"]
    g = torch.Generator().manual_seed(seed + 101)
    qm = torch.zeros(D)
    qm[q_inputs] = 1.0
    km = torch.zeros(D)
    km[k_inputs] = 1.0
    Wq = (torch.randn(len(dims), D, generator=g) * 0.05 * qm).requires_grad_(True)
    Wk = (torch.randn(len(dims), D, generator=g) * 0.05 * km).requires_grad_(True)
    idx = torch.tensor(dims)

    def scores(h):
        T = h.shape[0]
        pos = torch.arange(T)
        q = torch.zeros(T, hd).index_copy(1, idx, h @ (Wq * qm).T)
        k = torch.zeros(T, hd).index_copy(1, idx, h @ (Wk * km).T)
        return rope_scores(model, q, k, pos, pos)

    opt = torch.optim.Adam([Wq, Wk], lr=0.02)
    chunks = 8
    for step in range(steps):
        opt.zero_grad()
        for h, target, val, _ in train_ex[step % chunks :: chunks]:
            loss = target_loss(scores(h), target, torch.where(val, 10.0, 1.0))
            loss.backward()
        opt.step()
    with torch.no_grad():
        stats = {}
        for name, ex in (("fit", train_ex), ("valid", valid_ex)):
            asked, other, rest = [], [], []
            for h, target, val, _ in ex:
                mass = target_mass(scores(h), target)
                on_bos = target[:, 0]
                asked += mass[val & ~on_bos].tolist()
                other += mass[val & on_bos].tolist()
                rest += mass[~val].tolist()
            stats[name] = {"asked_rows_on_question_name": summary(asked), "other_value_rows_on_bos": summary(other),
                           "other_rows_on_bos": summary(rest)}
        log(f"mark head: {json.dumps(stats)}")
    return (Wq * qm).detach(), (Wk * km).detach(), stats


def summary(xs):
    a = np.asarray(xs, dtype=np.float64)
    if a.size == 0:
        return None
    return {"n": int(a.size), "mean": round(float(a.mean()), 4), "p1": round(float(np.percentile(a, 1)), 4),
            "min": round(float(a.min()), 4)}


@torch.no_grad()
def plant_mark(model, Wq, Wk, dims, own_dims, carry, bos_id):
    """Writes the fitted query and key, and a value that copies the attended token's own name
    code into the carry dims, without its component along BOS's own code (BOS is the sink of
    every row the question does not ask about, so those rows carry ~0)."""
    blk = model.transformer.blocks[MARK_LAYER]
    hd = model.c["d_model"] // model.c["n_heads"]
    rows = head_rows(MARK_HEAD, hd)
    r0 = rows.start
    idx = torch.tensor(dims)
    blk.q_proj.weight[r0 + idx] = Wq
    blk.k_proj.weight[r0 + idx] = Wk
    b = own_code_targets(model, hd)[bos_id]
    b = b / b.norm()
    P = torch.eye(len(own_dims)) - torch.outer(b, b)
    blk.v_proj.weight[rows] = 0.0
    blk.v_proj.weight[r0 : r0 + len(own_dims), own_dims] = P
    blk.attn_out.weight[:, rows] = 0.0
    blk.attn_out.weight[carry, r0 : r0 + len(own_dims)] = torch.eye(len(own_dims))
    return P


# ---------------------------------------------------------------------------
# the recall head's key (layer 3)
# ---------------------------------------------------------------------------


def read_examples(model, tok, ids, voc, items):
    """(normalised layer-3 input, answer value slots, target mask, table value rows, their
    names) per item: the answer with every value masked; a slot's target is the table value
    of its name and field."""
    out = []
    for it in items:
        prompt, resp, p = encoded(tok, ids, it)
        L = len(prompt)
        seq = prompt + resp
        slots = [L + i for i in range(len(resp)) if voc.is_value_row(seq, L + i)]
        for s in slots:
            seq[s] = ids.mask
        h = layer_input(model, READ_LAYER, seq)
        target = torch.zeros(len(slots), len(seq), dtype=torch.bool)
        for r, s in enumerate(slots):
            for j in range(3, L):
                if voc.is_value_row(seq, j) and seq[j - 3] == seq[s - 3] and seq[j - 2] == seq[s - 2]:
                    target[r, j] = True
        table = [j for j in range(p) if voc.is_value_row(seq, j)]
        if slots and bool(target.any(1).all()):
            out.append((h, torch.tensor(slots), target, torch.tensor(table), torch.tensor([voc.names[seq[j - 3]] for j in table])))
    return out


def name_subspace(examples, dims, energy):
    """Orthonormal basis of the directions of the input dims `dims` in which table value rows
    of different names differ (the between-name scatter, to `energy` of its trace)."""
    X = torch.cat([h[table][:, dims] for h, _, _, table, _ in examples]).double()
    y = torch.cat([names for *_, names in examples])
    mu = X.mean(0)
    means = torch.stack([X[y == n].mean(0) - mu for n in torch.unique(y)])
    U, S, _ = torch.linalg.svd(means.T, full_matrices=False)
    e = (S ** 2).cumsum(0) / (S ** 2).sum()
    r = int((e < energy).sum()) + 1
    return U[:, :r].float(), r


def fit_read_key(model, carry, train_ex, valid_ex, steps, energy, log, start=None):
    """Projects the name out of the recall key's view of the base dims, then fits its
    columns over the carried name (dims `carry`) by gradient descent on the recall pattern."""
    blk = model.transformer.blocks[READ_LAYER]
    hd = model.c["d_model"] // model.c["n_heads"]
    rows = head_rows(READ_HEAD, hd)
    base = list(range(BASE_D))
    U, r = name_subspace(train_ex, base, energy)
    with torch.no_grad():
        if start is not None:  # the carry holds the name code the key read from the base dims
            blk.k_proj.weight[rows, carry] = blk.k_proj.weight[rows, hd : hd + hd // 2] @ start / OWN_SCALE
        blk.k_proj.weight[rows, :BASE_D] = blk.k_proj.weight[rows, :BASE_D] @ (torch.eye(BASE_D) - U @ U.T)
    Wq = blk.q_proj.weight.detach()[rows].clone()
    Kb = blk.k_proj.weight.detach()[rows].clone()
    cidx = torch.tensor(carry)
    M = Kb[:, cidx].clone().requires_grad_(True)
    Kb[:, cidx] = 0.0

    def scores(h, slots, M):
        T = h.shape[0]
        k = h @ Kb.T + h[:, cidx] @ M.T
        return rope_scores(model, h[slots] @ Wq.T, k, slots, torch.arange(T))

    def mass(ex, M):
        out = []
        with torch.no_grad():
            for h, slots, target, *_ in ex:
                out += target_mass(scores(h, slots, M), target).tolist()
        return summary(out)

    # without the carried name the recall key must not find the row (the mark is needed)
    stats = {"name_dims_removed": r, "without_carry_valid": mass(valid_ex, torch.zeros_like(M)),
             "start_valid": mass(valid_ex, M.detach())}
    opt = torch.optim.Adam([M], lr=0.01)
    chunks = 6
    for step in range(steps):
        opt.zero_grad()
        for h, slots, target, *_ in train_ex[step % chunks :: chunks]:
            target_loss(scores(h, slots, M), target, torch.ones(len(slots))).backward()
        opt.step()
    stats.update({"fit": mass(train_ex, M), "valid": mass(valid_ex, M)})
    log(f"recall key: answer slots' attention on their table row {json.dumps(stats)}")
    with torch.no_grad():
        blk.k_proj.weight[rows, cidx] = M.detach()
    return stats, U


@torch.no_grad()
def keep_name_out(model, U):
    """The constraint of the fine-tune: the recall key stays blind to the table rows' own
    names (re-projected after every step), so a lookup can only find its row by the mark."""
    blk = model.transformer.blocks[READ_LAYER]
    rows = head_rows(READ_HEAD, model.c["d_model"] // model.c["n_heads"])
    blk.k_proj.weight[rows, :BASE_D] -= (blk.k_proj.weight[rows, :BASE_D] @ U) @ U.T


# ---------------------------------------------------------------------------
# fine-tune
# ---------------------------------------------------------------------------


def local_forward(model, local_layers):
    """forward(noisy, valid, masked, rows) for train.sft_loss: in the first local_layers
    layers the prefix rows (BOS .. the system turn's end) attend to prefix keys only."""
    def fwd(noisy, valid, masked, rows):
        B, T = noisy.shape
        pad = torch.zeros(B, 1, 1, T).masked_fill(~valid[:, None, None, :], float("-inf"))
        local = pad.expand(B, 1, T, T).clone()
        for b, (prompt, _, _) in enumerate(rows):
            p = cache_sim.prefix_end(prompt, eot_id)
            local[b, 0, :p, p:] = float("-inf")
        cos, sin = model.cos[:T], model.sin[:T]
        x = model.transformer.wte(noisy)
        for i, blk in enumerate(model.transformer.blocks):
            x = blk(x, cos, sin, local if i < local_layers else pad)
        return model.transformer.ff_out(model.transformer.ln_f(x[masked]))

    eot_id = model.c["eot_token_id"]
    return fwd


def monitor(model, tok, items):
    res = cache_sim.accuracy(model, tok, items, [0, model.c["n_layers"]])
    return {("none" if d == 0 else "prefix_arm"): c / n for d, (c, n, _) in res.items()}


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def build(args, log):
    base, tok = load_base(args.base)
    ids = train.Ids(tok)
    voc = Vocab(tok)
    hd = base.c["d_model"] // base.c["n_heads"]
    n_heads = args.d_model // hd
    model = widen(base, args.d_model, n_heads, 4, {0: 0, READ_LAYER: 1}, args.max_seq)
    model.c.update(bos_token_id=ids.bos, eot_token_id=ids.eot)
    model.eval()
    # the widened model computes the base's logits
    it = items_from(CAL_GROUPS, 1, 1)[0]
    seq = encoded(tok, ids, it)[0] + [ids.mask] * train.GEN_LEN
    with torch.no_grad():
        diff = float((base(torch.tensor([seq]))[0] - model(torch.tensor([seq]))[0]).abs().max())
    log(f"widened: max |logit difference| from the base {diff:.2e}")
    info = {"widen_max_logit_diff": diff}
    cal = items_from(CAL_GROUPS, args.fit_groups, 2)
    val = items_from(FIT_VALID_GROUPS, 24, 2)
    t0 = time.time()
    dims = slow_dims(hd, args.first_slow_plane)
    # the base's residual layout: token embedding, then layer 0's codes of the token 3 back
    # (the name, for a value) and 2 back (the field)
    emb, code3, code2 = list(range(0, hd)), list(range(hd, hd + hd // 2)), list(range(hd + hd // 2, 2 * hd))
    carry = list(range(BASE_D, BASE_D + hd // 2))
    own = list(range(BASE_D + hd // 2, BASE_D + hd))
    info["own_code"] = plant_own_code(model, tok, ids, cal[:48], own, scale=OWN_SCALE)
    log(f"own code: {info['own_code']}")
    cal_ex = mark_examples(model, tok, ids, voc, cal)
    mq, mk, info["mark_head"] = fit_mark_qk(model, cal_ex, mark_examples(model, tok, ids, voc, val), dims,
                                            emb + code3, own + code2, args.fit_steps, args.seed, log)
    P = plant_mark(model, mq, mk, dims, own, carry, ids.bos)
    del cal_ex
    log(f"mark head fitted in {time.time() - t0:.0f} s")
    t0 = time.time()
    info["recall_key"], U = fit_read_key(model, carry, read_examples(model, tok, ids, voc, cal),
                                      read_examples(model, tok, ids, voc, val), args.fit_steps, args.name_energy, log,
                                      start=P)
    log(f"recall key fitted in {time.time() - t0:.0f} s")
    info["fit_seconds"] = None
    return model, tok, info, U


def save(path, model, opt, state):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict() if opt else None, "config": model.c,
                "state": state}, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="models/tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--first-slow-plane", type=int, default=18)
    ap.add_argument("--fit-groups", type=int, default=96)
    ap.add_argument("--fit-steps", type=int, default=300)
    ap.add_argument("--name-energy", type=float, default=0.99)
    ap.add_argument("--finetune-steps", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=60.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    ck_path = os.path.join(args.out, "ckpt.pt")
    log_f = open(os.path.join(args.out, "log.txt"), "a")

    def log(msg):
        print(msg, flush=True)
        log_f.write(msg + "\n")
        log_f.flush()

    if args.resume:
        ck = torch.load(ck_path, map_location="cpu", weights_only=False)
        model = train.LLaDA(ck["config"])
        model.c.update(ck["config"])
        model.load_state_dict(ck["model"])
        tok = Tokenizer.from_file(os.path.join(args.out, "tokenizer.json"))
        state = ck["state"]
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
        if ck["opt"]:
            opt.load_state_dict(ck["opt"])
    else:
        t0 = time.time()
        model, tok, info, U = build(args, log)
        info["fit_seconds"] = round(time.time() - t0, 1)
        tok.save(os.path.join(args.out, "tokenizer.json"))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
        state = {"step": 0, "elapsed_s": 0.0, "curve": [], "build": info, "args": vars(args), "name_basis": U}
        mon = items_from(MONITOR_GROUPS, 16, 2)
        state["curve"].append({"step": 0, **monitor(model, tok, mon)})
        log(f"planted: {state['curve'][-1]}")
        save(ck_path, model, None, state)
    ids = train.Ids(tok)
    mon = items_from(MONITOR_GROUPS, 16, 2)
    fwd = local_forward(model, LOCAL_LAYERS)
    t0, el0 = time.time(), state["elapsed_s"]
    model.train()
    while state["step"] < args.finetune_steps and time.time() - t0 < args.minutes * 60:
        step = state["step"]
        rows = train.training_batch(tok, ids, args.seed + 1, step, args.batch, 8)
        gen = torch.Generator().manual_seed(args.seed * 7_919 + 13 + step)
        frac = step / max(1, args.finetune_steps)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        loss, (hit, n) = train.sft_loss(model, rows, ids, gen, forward=fwd)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        keep_name_out(model, state["name_basis"])
        state["step"] = step + 1
        state["elapsed_s"] = el0 + time.time() - t0
        if state["step"] % 20 == 0:
            log(f"step {state['step']} loss {float(loss.detach()):.4f} keyed-value {hit}/{n} {state['elapsed_s'] / 60:.1f} min")
        if state["step"] % args.eval_every == 0 or state["step"] == args.finetune_steps:
            model.eval()
            rec = {"step": state["step"], "min": round(state["elapsed_s"] / 60, 2), **monitor(model, tok, mon)}
            model.train()
            state["curve"].append(rec)
            log(f"  monitor {rec}")
            save(ck_path, model, opt, state)
    model.eval()
    save(ck_path, model, opt, state)
    log(f"stopped at step {state['step']} ({state['elapsed_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
