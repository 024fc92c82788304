"""Plant the probe heads: [MASK] canvas rows attend to the table rows of the member the question asks about.

A cache that reuses a shared span of the system prompt (the rules and the table, computed
once without the request) and recomputes a few "anchor" tokens of it chooses the anchors
by what the request's [MASK] rows attend to.  In an LLM the answer positions attend to the
context the question is about; in models/tiny nothing did.  This script adds that, in the
style of tools/deepen.py (closed-form fits on training-stream items, never the held-out
stream; seeded and deterministic), to a model folder deepen.py wrote:

* layer 1, head 0 ("gather"): a [MASK] row queries with the [MASK] direction; the keys are
  the names that do not start a table line (the question's, and an answer's), in the
  slowest RoPE plane (position-blind) plus a term in the fastest plane that makes canvas
  rows of different positions prefer different names of a pair question (two names 3
  tokens apart sit half a turn apart there).  The value is the attended name's 28-dim
  code, written into the carry dims (160-187) at 0.003 (the mark writes ~0.5); any other
  row has a query ~0, spreads its attention and carries ~0.
* layer 2, heads 0 and 1 ("match"): a row queries with its carry dims against every
  row's code of the name 3 back (a table value row's name, from the layer-0 name copy, so
  identical whether the span is computed alone or with the request); their output
  projection is zero, so they change nothing downstream.

Only the carry dims of [MASK] rows (read by layer 3 with small weights, and by the read
head, whose mask penalty holds them off) change: the logit change is reported.

Usage:
  tools/.venv/bin/python tools/probe_heads.py --model models/tiny --out runs/probe
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepen  # noqa: E402
import train  # noqa: E402
from deepen import BASE_D, CARRY, COPY, NC, head_rows, least_squares, slow_dims  # noqa: E402

GATHER_LAYER, GATHER_HEAD = 1, 0
MATCH_LAYER, MATCH_HEADS = 2, (0, 1)
PROBE_FIT_GROUPS = 73_000_000  # training-stream groups, apart from deepen.py's
PROBE_VALID_GROUPS = 74_000_000


def stats(x):
    x = x.double()
    return {"n": int(x.numel()), "mean": round(float(x.mean()), 4), "min": round(float(x.min()), 4),
            "max": round(float(x.max()), 4)}


def detector(h, pos, w, rounds=4):
    """A linear u with h.u ~1 on the rows `pos` and ~0 elsewhere: weighted least squares
    (weights w), then a few rounds that multiply by 5 the weight of a positive row under 0.8
    or a negative row over 0.2 (hard rows), each a closed-form solve."""
    u = least_squares(h, pos.float()[:, None], w)[0]
    for _ in range(rounds):
        d = h @ u
        w = w * torch.where(pos, 1 + 4 * (d < 0.8).float(), 1 + 4 * (d > 0.2).float())
        u = least_squares(h, pos.float()[:, None], w, ridge=1e-3)[0]
    return u


@torch.no_grad()
def plant_gather(model, rows, codes, nl_id, mask_id, hd, strength, spread, scale):
    """Layer 1, GATHER_HEAD: score = (m.h_q)(u.h_k)(strength + spread cos((i - j) theta_0)),
    m a [MASK] detector, u a detector of names that do not start a table line; value = the
    name's code (a least-squares map of the token's input), written into CARRY x scale."""
    blk = model.transformer.blocks[GATHER_LAYER]
    h = rows.h[:, :BASE_D]
    qname = rows.is_name & (rows.back2 != nl_id)
    table_name = rows.is_name & (rows.back2 == nl_id)
    is_mask = rows.tok == mask_id
    u = detector(rows.h, qname, torch.where(qname, 200.0, torch.where(rows.is_name, 100.0, 1.0)))
    m = detector(rows.h, is_mask, torch.where(is_mask, 10.0, 1.0))
    W = least_squares(h, codes[rows.name] * rows.is_name[:, None], torch.where(rows.is_name, 20.0, 1.0))
    r = head_rows(GATHER_HEAD, hd)
    slow, fast = hd // 2 - 1, 0
    for nm in ("q_proj", "k_proj", "v_proj"):
        getattr(blk, nm).weight[r] = 0.0
    a = math.sqrt(math.sqrt(hd) * strength)
    b = math.sqrt(math.sqrt(hd) * spread)
    blk.q_proj.weight[r.start + slow] = a * m
    blk.k_proj.weight[r.start + slow] = a * u
    blk.q_proj.weight[r.start + fast] = b * m
    blk.k_proj.weight[r.start + fast] = b * u
    blk.v_proj.weight[r.start : r.start + NC, :BASE_D] = W
    blk.attn_out.weight[:, r] = 0.0
    blk.attn_out.weight[CARRY, r.start : r.start + NC] = scale * torch.eye(NC)
    du, dm, P = rows.h @ u, rows.h @ m, h @ W.T
    return {"question_name_detector": {"question_names": stats(du[qname]), "table_names": stats(du[table_name]),
                                       "other_tokens": stats(du[~rows.is_name])},
            "mask_detector": {"mask_rows": stats(dm[is_mask]), "other_rows": stats(dm[~is_mask])},
            "value_code_cos_at_question_names": round(float(torch.nn.functional.cosine_similarity(
                P[qname], codes[rows.name[qname]]).mean()), 4)}


@torch.no_grad()
def plant_match(model, rows, codes, mask_id, hd, strength):
    """Layer 2, MATCH_HEADS: query = the carry dims (the gathered name, on [MASK] rows),
    key = a least-squares map of the layer-2 input (base and name-copy dims only, which
    layers 0-1 compute locally) to the code of the name 3 back on value rows, ~0 elsewhere;
    score ~ strength x cosine; value and output zero."""
    blk = model.transformer.blocks[MATCH_LAYER]
    h = rows.h
    src = list(range(BASE_D)) + COPY
    target = codes[torch.tensor([deepen_name(rows, i) for i in range(len(h))])] * rows.value[:, None]
    K = least_squares(h[:, src], target, torch.where(rows.value, 20.0, 1.0))
    is_mask = rows.tok == mask_id
    gn = float(h[is_mask][:, CARRY].norm(dim=1).mean())
    key = h[:, src] @ K.T
    kn = float(key[rows.value].norm(dim=1).mean())
    a = math.sqrt(math.sqrt(hd) * strength / (gn * kn))
    dims = slow_dims(hd, hd // 2 - NC // 2)
    for head in MATCH_HEADS:
        r = head_rows(head, hd)
        for nm in ("q_proj", "k_proj", "v_proj"):
            getattr(blk, nm).weight[r] = 0.0
        blk.attn_out.weight[:, r] = 0.0
        for i, d in enumerate(dims):
            blk.q_proj.weight[r.start + d, CARRY[i]] = a
            blk.k_proj.weight[r.start + d, src] = a * K[i]
    name3 = torch.tensor([deepen_name(rows, i) for i in range(len(h))])
    return {"gathered_norm_at_mask_rows": round(gn, 4), "key_norm_at_value_rows": round(kn, 4),
            "key_code_cos_at_value_rows": round(float(torch.nn.functional.cosine_similarity(
                key[rows.value], codes[name3[rows.value]]).mean()), 4),
            "key_norm_elsewhere": round(float(key[~rows.value].norm(dim=1).mean() / kn), 4)}


def deepen_name(rows, i):
    """Index of the name 3 back of row i (0 where it is not a name)."""
    return _name_of.get(int(rows.back3[i]), 0)


_name_of: dict = {}


@torch.no_grad()
def gather_mass(model, tok, ids, voc, items, hd):
    """For [MASK] canvas rows (prompt + all-[MASK] answer): the gather head's attention on the
    question's name tokens, in all, and on the less-attended name of a pair."""
    blk = model.transformer.blocks[GATHER_LAYER]
    r = head_rows(GATHER_HEAD, hd)
    total, minor = [], []
    for it in items:
        prompt, resp, p = deepen.encoded(tok, ids, it)
        seq = prompt + [ids.mask] * len(resp)
        h = deepen.layer_input(model, GATHER_LAYER, seq)
        pos = torch.arange(len(seq))
        P = torch.softmax(deepen.rope_scores(model, h @ blk.q_proj.weight[r].T, h @ blk.k_proj.weight[r].T, pos, pos), -1)
        names = [j for j in range(p, len(prompt)) if seq[j] in voc.names]
        rows_ = list(range(len(prompt), len(seq)))
        total.append(P[rows_][:, names].sum(1))
        if len({seq[j] for j in names}) == 2:
            minor.append(P[rows_][:, names].sum(0).min() / P[rows_][:, names].sum())
    return {"mask_rows_on_question_names": stats(torch.cat(total)),
            "pair_share_of_less_attended_name": stats(torch.tensor(minor))}


@torch.no_grad()
def match_mass(model, tok, ids, voc, items, hd):
    """For [MASK] canvas rows of an uncached pass (prompt + all-[MASK] answer): each match
    head's attention on the table value rows of the asked members, over every key and over
    the system prompt's keys only (as a span probe sees them)."""
    blk = model.transformer.blocks[MATCH_LAYER]
    full, span = [], []
    for it in items:
        prompt, resp, p = deepen.encoded(tok, ids, it)
        seq = prompt + [ids.mask] * len(resp)
        asked = {t for t in tok.encode(it["user"], add_special_tokens=False).ids if t in voc.names}
        rows_ = torch.arange(len(prompt), len(seq))
        target = torch.tensor([j < p and voc.is_value_row(seq, j) and seq[j - 3] in asked for j in range(len(seq))])
        h = deepen.layer_input(model, MATCH_LAYER, seq)
        pos = torch.arange(len(seq))
        for head in MATCH_HEADS:
            r = head_rows(head, hd)
            s = deepen.rope_scores(model, h[rows_] @ blk.q_proj.weight[r].T, h @ blk.k_proj.weight[r].T, rows_, pos)
            full.append(torch.softmax(s, -1)[:, target].sum(1))
            span.append(torch.softmax(s[:, :p], -1)[:, target[:p]].sum(1))
    return {"all_keys": stats(torch.cat(full)), "system_prompt_keys": stats(torch.cat(span))}


@torch.no_grad()
def logit_change(old, new, tok, ids, items):
    out = []
    for it in items:
        prompt, resp, _ = deepen.encoded(tok, ids, it)
        for seq in (prompt + [ids.mask] * len(resp), prompt + resp):
            x = torch.tensor([seq])
            out.append(float((old(x)[0] - new(x)[0]).abs().max()))
    return round(max(out), 5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--out", required=True, help="the new model folder")
    ap.add_argument("--seed", type=int, default=0, help="the name codes' seed (deepen.py's)")
    ap.add_argument("--fit-groups", type=int, default=32)
    ap.add_argument("--gather-strength", type=float, default=30.0)
    ap.add_argument("--gather-spread", type=float, default=10.0)
    ap.add_argument("--gather-scale", type=float, default=0.003)
    ap.add_argument("--match-strength", type=float, default=24.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    model, tok = deepen.load_base(args.model)
    old, _ = deepen.load_base(args.model)
    ids = train.Ids(tok)
    for m in (model, old):
        m.c.update(bos_token_id=ids.bos, eot_token_id=ids.eot)
        m.eval()
    voc = deepen.Vocab(tok)
    _name_of.update(voc.names)
    hd = model.c["d_model"] // model.c["n_heads"]
    nl = tok.token_to_id("Ċ")
    codes = deepen.name_codes(len(voc.names), NC, args.seed)
    cal = deepen.items_from(PROBE_FIT_GROUPS, args.fit_groups, 2)
    info = {"args": vars(args)}
    info["gather"] = plant_gather(model, deepen.Rows(model, GATHER_LAYER, tok, ids, voc, cal), codes, nl, ids.mask, hd,
                                  args.gather_strength, args.gather_spread, args.gather_scale)
    info["match"] = plant_match(model, deepen.Rows(model, MATCH_LAYER, tok, ids, voc, cal), codes, ids.mask, hd,
                                args.match_strength)
    val = deepen.items_from(PROBE_VALID_GROUPS, 12, 2)
    info["gather_attention_unseen"] = gather_mass(model, tok, ids, voc, val, hd)
    info["match_attention_unseen"] = match_mass(model, tok, ids, voc, val, hd)
    info["max_logit_change_unseen"] = logit_change(old, model, tok, ids, val[:8])
    info["plant_seconds"] = round(time.time() - t0, 1)
    print(json.dumps(info, indent=1), flush=True)

    import export as hf_export
    import fixture_common

    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.model):
        src = os.path.join(args.model, f)
        if os.path.isfile(src) and f not in ("model.safetensors", "probe_heads.json"):
            shutil.copyfile(src, os.path.join(args.out, f))
    fixture_common.write_safetensors(os.path.join(args.out, "model.safetensors"), hf_export.hf_weights(model.state_dict()))
    fixture_common.write_json(os.path.join(args.out, "probe_heads.json"), info)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
