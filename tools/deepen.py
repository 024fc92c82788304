"""Deepen the 2-layer base model into the bundled 4-layer model, whose deep prefix rows read the request.

The base (models/tiny-base, trained by tools/train.py) answers from its system prompt, but
nothing in that prompt reads the question: the prefix K/V computed without the question are
exact at every depth, so every cache is exact on it.  In LLaDA-8B the prefix rows of the deep
layers attend to the request; that is why an autoregressive runtime's prefix cache (every
layer reused) collapses its accuracy while BiCache (shallow layers only) keeps it.  This
script plants that property (models/tiny/README.md describes the circuit and its numbers):

* width 128 -> 192 (a third head of 64) and 2 -> 4 layers: the base's layers become layers 0
  and 3 and act on the first 128 dimensions exactly as before (RMSNorm weights scaled by
  sqrt(128/192); checked on the logits);
* layer 0, head 2 copies the code of the name 3 positions back (a table value's name), with
  the base's name-head attention, into COPY;
* layer 1's MLP flags names that follow a line break (the table's, not the question's);
* layer 2, head 2 ("mark"): a value row whose name the question asks for attends to the
  question's token of that name and carries the name in CARRY; other rows carry ~0;
* layer 3, head 2 reads a value by the slot's name against the rows' CARRY and by field, and
  every key of layer 3 is blind to a row's own name, so a lookup needs the mark;
* a short fine-tune of layer 3, the final norm and the LM head (the base's objective, prefix
  rows local in layers 0-1, the blindness re-applied after every step) repairs what the
  rewiring cost, monitored with no cache and with the prefix reused at every depth.

Every map is fitted in closed form on training-stream items; tools/cache_sim.py gives the
accuracy at every BiCache depth.

Usage:
  tools/.venv/bin/python tools/deepen.py --out runs/deep --export models/tiny
  tools/.venv/bin/python tools/deepen.py --out runs/deep --resume --finetune-steps 400 --export models/tiny
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

MARK_LAYER = 2
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


def rope_scores(model, q, k, qpos, kpos):
    q = train.rope(q, model.cos[qpos], model.sin[qpos])
    k = train.rope(k, model.cos[kpos], model.sin[kpos])
    return q @ k.T / math.sqrt(q.shape[-1])


def target_mass(scores, target):
    return (torch.softmax(scores, -1) * target).sum(-1)


def summary(xs):
    a = np.asarray(xs, dtype=np.float64)
    if a.size == 0:
        return None
    return {"n": int(a.size), "mean": round(float(a.mean()), 4), "p1": round(float(np.percentile(a, 1)), 4),
            "min": round(float(a.min()), 4)}


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


def save(path, model, opt, state):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict() if opt else None, "config": model.c,
                "state": state}, tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# the planted circuit
# ---------------------------------------------------------------------------

NC = 28  # dims of the names' code (14 slow RoPE planes of a head)
COPY = list(range(BASE_D, BASE_D + NC))  # layer 0: the code of the name 3 back
CARRY = list(range(BASE_D + 32, BASE_D + 32 + NC))  # layer 2: the asked name, on marked rows only
FLAG = BASE_D + 63  # layer 1: "a name after a line break" (a table name)
NEW_HEAD = 2
COPY_SCALE = 0.5


def name_codes(n, dims, seed):
    """n unit vectors in `dims` dimensions with small pairwise cosines (the names' code)."""
    g = torch.Generator().manual_seed(seed + 7)
    C = torch.randn(n, dims, generator=g)
    C = (C / C.norm(dim=1, keepdim=True)).requires_grad_(True)
    opt = torch.optim.Adam([C], lr=0.01)
    for _ in range(1500):
        c = C / C.norm(dim=1, keepdim=True)
        opt.zero_grad()
        (((c @ c.T) - torch.eye(n)) ** 6).sum().backward()
        opt.step()
    return (C / C.norm(dim=1, keepdim=True)).detach()


def least_squares(X, Y, weight=None, ridge=1e-2):
    """W with X @ W.T ~ Y (rows weighted), ridge relative to the number of rows."""
    X, Y = X.double(), Y.double()
    if weight is not None:
        w = weight.double().sqrt()[:, None]
        X, Y = X * w, Y * w
    A = X.T @ X + ridge * len(X) * torch.eye(X.shape[1], dtype=torch.float64)
    return torch.linalg.solve(A, X.T @ Y).T.float()


class Rows:
    """Normalised inputs of one layer over calibration sequences (every item answered and
    with a masked canvas), with each row's token, the tokens 2 and 3 back, and whether it
    is a value row."""

    def __init__(self, model, layer, tok, ids, voc, items):
        H, toks, back2, back3, val = [], [], [], [], []
        for it in items:
            prompt, resp, _ = encoded(tok, ids, it)
            for seq in (prompt + resp, prompt + [ids.mask] * len(resp)):
                H.append(layer_input(model, layer, seq))
                toks += seq
                back2 += [seq[i - 2] if i >= 2 else -1 for i in range(len(seq))]
                back3 += [seq[i - 3] if i >= 3 else -1 for i in range(len(seq))]
                val += [voc.is_value_row(seq, i) for i in range(len(seq))]
        self.h = torch.cat(H)
        self.tok, self.back2, self.back3 = torch.tensor(toks), torch.tensor(back2), torch.tensor(back3)
        self.value = torch.tensor(val)
        self.name_ids = torch.tensor(list(voc.names))
        self.is_name = torch.isin(self.tok, self.name_ids)
        self.name = torch.tensor([voc.names.get(int(t), 0) for t in self.tok])

    def constant(self):
        """A linear feature that is ~1 on every row."""
        return least_squares(self.h[:, :BASE_D], torch.ones(len(self.h), 1))[0]


@torch.no_grad()
def plant_name_copy(model, voc, codes, hd):
    """Layer 0, new head: the name head's attention (3 back) with a value that maps the
    attended token's normalised embedding to its name code (~0 for other tokens), written
    into COPY.  Layer 0 reads pure embeddings, so this attention is as sharp as the base's."""
    b0 = model.transformer.blocks[0]
    E = b0.attn_norm(model.transformer.wte.weight)[:, :BASE_D]
    n = len(E)
    is_name = torch.zeros(n, dtype=torch.bool)
    Y = torch.zeros(n, NC)
    for t, i in voc.names.items():
        is_name[t] = True
        Y[t] = codes[i]
    W = least_squares(E, Y, torch.where(is_name, 20.0, 1.0))
    rows = head_rows(NEW_HEAD, hd)
    b0.q_proj.weight[rows] = b0.q_proj.weight[head_rows(0, hd)]
    b0.k_proj.weight[rows] = b0.k_proj.weight[head_rows(0, hd)]
    b0.v_proj.weight[rows] = 0.0
    b0.v_proj.weight[rows.start : rows.start + NC, :BASE_D] = W
    b0.attn_out.weight[:, rows] = 0.0
    b0.attn_out.weight[COPY, rows.start : rows.start + NC] = COPY_SCALE * torch.eye(NC)
    P = E @ W.T
    return {"code_cos_at_names": round(float(F.cosine_similarity(P[is_name], Y[is_name]).mean()), 4),
            "code_norm_elsewhere": round(float(P[~is_name].norm(dim=1).mean()), 4)}


@torch.no_grad()
def plant_table_flag(model, rows, nl_id, gate=10.0, scale=0.5):
    """Layer 1's MLP, one unit: FLAG = silu(gate * (d - 1/2)) for a detector d of "a line
    break 2 back" fitted on name tokens (1 for a table name, which starts a line; 0 for the
    question's names).  silu keeps the flag >= ~0 wherever the detector is meaningless."""
    blk = model.transformer.blocks[1]
    y = (rows.back2 == nl_id).float()
    d = least_squares(rows.h[rows.is_name, :BASE_D], y[rows.is_name, None])[0]
    c = rows.constant()
    blk.ff_proj.weight[0] = 0.0
    blk.up_proj.weight[0] = 0.0
    blk.ff_proj.weight[0, :BASE_D] = gate * (d - 0.5 * c)
    blk.up_proj.weight[0, :BASE_D] = c
    blk.ff_out.weight[:, 0] = 0.0
    blk.ff_out.weight[FLAG, 0] = scale / gate
    det = rows.h[:, :BASE_D] @ d
    table, question = rows.is_name & (y == 1), rows.is_name & (y == 0)
    return {"detector_table_names_min": round(float(det[table].min()), 4),
            "detector_question_names_max": round(float(det[question].max()), 4)}


@torch.no_grad()
def plant_mark(model, rows, codes, nl_id, hd, strength, penalty):
    """Layer 2, new head: query = the row's COPY (its name, on value rows), key = a map of the
    token's own embedding to its name code, score strength * cos - penalty * FLAG; value = the
    same map, written into CARRY.  A value row whose name the question asks attends to the
    question's token of that name; its own table names are held off by the flag; a row the
    question does not ask about spreads its attention and carries ~0."""
    blk = model.transformer.blocks[MARK_LAYER]
    W = least_squares(rows.h[:, :BASE_D], codes[rows.name] * rows.is_name[:, None], torch.where(rows.is_name, 20.0, 1.0))
    key = rows.h[:, :BASE_D] @ W.T
    qn = float(rows.h[rows.value][:, COPY].norm(dim=1).mean())
    kn = float(key[rows.is_name].norm(dim=1).mean())
    flag = float(rows.h[rows.is_name & (rows.back2 == nl_id), FLAG].mean())
    c = rows.constant()
    r = head_rows(NEW_HEAD, hd)
    dims = slow_dims(hd, hd // 2 - NC // 2)
    a = math.sqrt(math.sqrt(hd) * strength / (qn * kn))
    blk.q_proj.weight[r] = 0.0
    blk.k_proj.weight[r] = 0.0
    for i, d in enumerate(dims):
        blk.q_proj.weight[r.start + d, COPY[i]] = a
        blk.k_proj.weight[r.start + d, :BASE_D] = a * W[i]
    pen = hd // 2 - NC // 2 - 1  # the plane below the code's, nearly position-blind
    blk.q_proj.weight[r.start + pen, :BASE_D] = hd ** 0.25 * c
    blk.k_proj.weight[r.start + pen, FLAG] = -(hd ** 0.25) * penalty / flag
    blk.v_proj.weight[r] = 0.0
    blk.v_proj.weight[r.start : r.start + NC, :BASE_D] = W
    blk.attn_out.weight[:, r] = 0.0
    blk.attn_out.weight[CARRY, r.start : r.start + NC] = COPY_SCALE * torch.eye(NC) / kn
    return {"key_code_cos_at_names": round(float(F.cosine_similarity(key[rows.is_name], codes[rows.name[rows.is_name]]).mean()), 4)}


@torch.no_grad()
def plant_reader(model, rows, tok, ids, hd, name_w, field_w, mask_penalty):
    """Layer 3, new head: an answer's value slot attends to the table row of its name and
    field.  Name: the slot's COPY against a row's CARRY (present only where the mark put it);
    field: a least-squares code of the field 2 back on both sides; masked positions held off.
    Its value and output are the base recall head's (the attended token's embedding)."""
    blk = model.transformer.blocks[READ_LAYER]
    field_ids = {tok.token_to_id("Ġ" + f): i for i, f in enumerate(tasks.FIELD_NAMES)}
    fidx = torch.tensor([field_ids.get(int(t), 0) for t in rows.back2])
    Y = torch.zeros(len(rows.h), len(field_ids))
    Y[rows.value, fidx[rows.value]] = 1.0
    Wf = least_squares(rows.h[:, :BASE_D], Y, torch.where(rows.value, 5.0, 1.0))
    masked = (rows.tok == ids.mask).float()
    Wm = least_squares(rows.h[:, :BASE_D], masked[:, None])[0]
    c = rows.constant()
    cn = float(rows.h[rows.value][:, COPY].norm(dim=1).mean())
    carry = rows.h[:, CARRY].norm(dim=1)
    marked = carry > 3 * carry.median()  # the marked rows (a few per sequence)
    cm = float(carry[marked].mean()) if bool(marked.any()) else float(carry.max())
    r = head_rows(NEW_HEAD, hd)
    dims = slow_dims(hd, hd // 2 - 16)
    blk.q_proj.weight[r] = 0.0
    blk.k_proj.weight[r] = 0.0
    a = math.sqrt(math.sqrt(hd) * name_w)
    for i in range(NC):
        blk.q_proj.weight[r.start + dims[i], COPY[i]] = a / cn
        blk.k_proj.weight[r.start + dims[i], CARRY[i]] = a / cm
    b = math.sqrt(math.sqrt(hd) * field_w)
    for j in range(len(field_ids)):
        blk.q_proj.weight[r.start + dims[NC + j], :BASE_D] = b * Wf[j]
        blk.k_proj.weight[r.start + dims[NC + j], :BASE_D] = b * Wf[j]
    pen = hd // 2 - 17
    blk.q_proj.weight[r.start + pen, :BASE_D] = hd ** 0.25 * c
    blk.k_proj.weight[r.start + pen, :BASE_D] = -(hd ** 0.25) * mask_penalty * Wm
    base = head_rows(READ_HEAD, hd)
    blk.v_proj.weight[r] = blk.v_proj.weight[base]
    blk.attn_out.weight[:, r] = blk.attn_out.weight[:, base]
    fp = rows.h[:, :BASE_D] @ Wf.T
    return {"field_code_accuracy_at_value_rows": round(float((fp[rows.value].argmax(1) == fidx[rows.value]).float().mean()), 4)}


def blinder(model, examples, energy):
    """The constraint that keeps the lookup on the mark: every key of the recall layer is
    made blind to a table row's own name (the between-name subspace of its input and the
    COPY dims), re-applied after every fine-tune step.  The layers below are frozen, so the
    subspace stays where it was measured."""
    U, r = name_subspace(examples, list(range(BASE_D)), energy)
    P = torch.eye(BASE_D) - U @ U.T
    blk = model.transformer.blocks[READ_LAYER]

    @torch.no_grad()
    def blind():
        blk.k_proj.weight[:, :BASE_D] = blk.k_proj.weight[:, :BASE_D] @ P
        blk.k_proj.weight[:, COPY] = 0.0

    blind()
    return blind, r


def read_mass(model, examples, head):
    """Mean attention of answer value slots on their table row, for one head of layer 3."""
    blk = model.transformer.blocks[READ_LAYER]
    hd = model.c["d_model"] // model.c["n_heads"]
    r = head_rows(head, hd)
    out = []
    with torch.no_grad():
        for h, slots, target, *_ in examples:
            T = h.shape[0]
            q, k = h[slots] @ blk.q_proj.weight[r].T, h @ blk.k_proj.weight[r].T
            out += target_mass(rope_scores(model, q, k, slots, torch.arange(T)), target).tolist()
    return summary(out)


def mark_mass(model, tok, ids, voc, items):
    """For value rows of asked names: the mark head's attention on the request's tokens of
    that name; for the other value rows: its attention on the table's tokens of their own
    name (the path that would mark rows without the question)."""
    blk = model.transformer.blocks[MARK_LAYER]
    hd = model.c["d_model"] // model.c["n_heads"]
    r = head_rows(NEW_HEAD, hd)
    asked_m, other_m = [], []
    with torch.no_grad():
        for it in items:
            prompt, resp, p = encoded(tok, ids, it)
            asked = {t for t in tok.encode(it["user"], add_special_tokens=False).ids if t in voc.names}
            seq = prompt + [ids.mask] * len(resp)
            h = layer_input(model, MARK_LAYER, seq)
            T = len(seq)
            pos = torch.arange(T)
            P = torch.softmax(rope_scores(model, h @ blk.q_proj.weight[r].T, h @ blk.k_proj.weight[r].T, pos, pos), -1)
            st = torch.tensor(seq)
            for i in range(p):
                if voc.is_value_row(seq, i):
                    same = st == seq[i - 3]
                    if seq[i - 3] in asked:
                        asked_m.append(float(P[i, p:][same[p:]].sum()))
                    else:
                        other_m.append(float(P[i, :p][same[:p]].sum()))
    return {"asked_rows_on_request_name": summary(asked_m), "other_rows_on_own_table_name": summary(other_m)}


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def build(args, log):
    base, tok = load_base(args.base)
    ids = train.Ids(tok)
    voc = Vocab(tok)
    hd = base.c["d_model"] // base.c["n_heads"]
    model = widen(base, args.d_model, args.d_model // hd, 4, {0: 0, READ_LAYER: 1}, args.max_seq)
    model.c.update(bos_token_id=ids.bos, eot_token_id=ids.eot)
    model.eval()
    seq = encoded(tok, ids, items_from(CAL_GROUPS, 1, 1)[0])[0] + [ids.mask] * train.GEN_LEN
    with torch.no_grad():
        diff = float((base(torch.tensor([seq]))[0] - model(torch.tensor([seq]))[0]).abs().max())
    log(f"widened: max |logit difference| from the base {diff:.2e}")
    info = {"widen_max_logit_diff": diff}
    cal = items_from(CAL_GROUPS, args.fit_groups, 2)
    nl = tok.token_to_id("Ċ")
    codes = name_codes(len(voc.names), NC, args.seed)
    info["name_code_max_cosine"] = round(float((codes @ codes.T - torch.eye(len(codes))).abs().max()), 4)
    info["name_copy"] = plant_name_copy(model, voc, codes, hd)
    info["table_flag"] = plant_table_flag(model, Rows(model, 1, tok, ids, voc, cal), nl)
    info["mark"] = plant_mark(model, Rows(model, MARK_LAYER, tok, ids, voc, cal), codes, nl, hd,
                              args.mark_strength, args.mark_penalty)
    info["reader"] = plant_reader(model, Rows(model, READ_LAYER, tok, ids, voc, cal), tok, ids, hd,
                                  args.read_name, args.read_field, args.read_mask_penalty)
    val = items_from(FIT_VALID_GROUPS, 24, 2)
    info["mark_attention_unseen"] = mark_mass(model, tok, ids, voc, val)
    log(f"planted: {json.dumps(info)}")
    return model, tok, info


def trainable(model):
    """The recall layer, the final norm and the LM head; everything below stays as planted."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = (list(model.transformer.blocks[READ_LAYER].parameters()) + list(model.transformer.ln_f.parameters())
              + list(model.transformer.ff_out.parameters()))
    for p in params:
        p.requires_grad_(True)
    return params


def export(model, tok, base_dir, out, info):
    import export as hf_export
    import fixture_common

    os.makedirs(out, exist_ok=True)
    weights = hf_export.hf_weights(model.state_dict())
    fixture_common.write_safetensors(os.path.join(out, "model.safetensors"), weights)
    fixture_common.write_json(os.path.join(out, "config.json"), hf_export.config_json(model.c))
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        with open(os.path.join(base_dir, f), "rb") as src, open(os.path.join(out, f), "wb") as dst:
            dst.write(src.read())
    info = dict(info, n_params=int(sum(v.size for v in weights.values())),
                parity=hf_export.parity(out, model, model.c, tok))
    fixture_common.write_json(os.path.join(out, "deepen.json"), info)
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="models/tiny-base")
    ap.add_argument("--out", required=True, help="run folder (ckpt.pt, log.txt)")
    ap.add_argument("--export", default=None, help="write the model folder here after the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--fit-groups", type=int, default=48)
    ap.add_argument("--mark-strength", type=float, default=22.0)
    ap.add_argument("--mark-penalty", type=float, default=40.0)
    ap.add_argument("--read-name", type=float, default=16.0)
    ap.add_argument("--read-field", type=float, default=16.0)
    ap.add_argument("--read-mask-penalty", type=float, default=30.0)
    ap.add_argument("--name-energy", type=float, default=0.99)
    ap.add_argument("--finetune-steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
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

    mon = items_from(MONITOR_GROUPS, 16, 2)
    if args.resume:
        ck = torch.load(ck_path, map_location="cpu", weights_only=False)
        model = train.LLaDA(ck["config"])
        model.c.update(ck["config"])
        model.load_state_dict(ck["model"])
        tok = Tokenizer.from_file(os.path.join(args.base, "tokenizer.json"))
        state = ck["state"]
    else:
        t0 = time.time()
        model, tok, info = build(args, log)
        info["plant_seconds"] = round(time.time() - t0, 1)
        state = {"step": 0, "elapsed_s": 0.0, "curve": [], "build": info, "args": vars(args)}
    ids = train.Ids(tok)
    voc = Vocab(tok)
    blind, r = blinder(model, read_examples(model, tok, ids, voc, items_from(CAL_GROUPS, 96, 2)), args.name_energy)
    state["build"]["name_dims_blinded"] = r
    params = trainable(model)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    if args.resume and ck.get("opt"):
        opt.load_state_dict(ck["opt"])
    if not state["curve"]:
        state["curve"].append({"step": 0, "min": 0.0, **monitor(model, tok, mon)})
        log(f"  monitor {state['curve'][-1]}")
    fwd = local_forward(model, LOCAL_LAYERS)
    t0, el0 = time.time(), state["elapsed_s"]
    model.train()
    while state["step"] < args.finetune_steps:
        step = state["step"]
        rows = train.training_batch(tok, ids, args.seed + 1, step, args.batch, 8)
        gen = torch.Generator().manual_seed(args.seed * 7_919 + 13 + step)
        frac = step / max(1, args.finetune_steps)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        loss, (hit, n) = train.sft_loss(model, rows, ids, gen, forward=fwd)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        blind()
        state["step"] = step + 1
        state["elapsed_s"] = el0 + time.time() - t0
        if state["step"] % args.eval_every == 0 or state["step"] == args.finetune_steps:
            model.eval()
            rec = {"step": state["step"], "min": round(state["elapsed_s"] / 60, 2), "loss": round(float(loss.detach()), 4),
                   "keyed_value": f"{hit}/{n}", **monitor(model, tok, mon)}
            model.train()
            state["curve"].append(rec)
            log(f"  monitor {rec}")
            save(ck_path, model, opt, state)
    model.eval()
    save(ck_path, model, opt, state)
    log(f"fine-tune stopped at step {state['step']} ({state['elapsed_s'] / 60:.1f} min)")
    if args.export:
        state["build"]["read_attention_unseen"] = {
            f"head {h}": read_mass(model, read_examples(model, tok, ids, voc, items_from(FIT_VALID_GROUPS, 24, 2)), h)
            for h in (READ_HEAD, NEW_HEAD)}
        info = export(model, tok, args.base, args.export,
                      {"build": state["build"], "curve": state["curve"], "args": state["args"]})
        log(f"exported {args.export}: {json.dumps({k: info[k] for k in ('n_params', 'parity')})}")


if __name__ == "__main__":
    main()
