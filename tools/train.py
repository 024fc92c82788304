"""Train the bundled model: a small LLaDA-architecture model that reads its system prompt.

The recipe (see models/tiny/README.md for the measured curve):

* Task: tools/tasks.py.  A system prompt with a table of `NAME FIELD : VALUE` lines;
  questions answered with the asked facts written the same way after `####`.  So each
  value the model writes is three tokens after a name and two after a field, both in the
  table and in its own answer: the lookup is in-context key -> value recall.
* Tokenizer: byte-level BPE trained on generated prompts (digits one per token), then
  LLaDA's special tokens in LLaDA's order (BOS, EOS = pad, start/end header, end of turn,
  mask); no post-processor.  Every name, field and value must be one token (checked).
* Model: the LLaDA forward (llada.md 2.2) in float32: RMSNorm, rotate_half RoPE,
  bidirectional attention, SwiGLU with ff_proj as the gate, separate LM head; parameter
  names follow the Hugging Face checkpoint (model.transformer.*).
* Structured initialisation: gradient descent does not find in-context recall from a
  random start in the steps a CPU affords (every value slot first needs a head that brings
  its key next to it, and that head gets no gradient before the matching head exists; runs
  from positional heads alone sat at "some value of the table" for thousands of steps).  So
  training starts from a planted recall circuit (plant_recall_circuit): layer 0's heads
  attend to fixed offsets (3 and 2: the name and the field before a value; q/k rows of the
  fastest RoPE planes, after a shared direction u is added to every embedding) and write
  random codes of those tokens into their own half of the residual stream; layer 1's first
  head compares codes on the slowest RoPE planes (nearly position-blind), stays off masked
  positions, and copies the matching token's embedding, which the LM head (started as the
  embeddings) reads out; the other layer-1 heads start as copies too, with random (learned)
  attention.  At initialisation this answers about half of the lookups of a full
  table; training makes it exact and learns everything else (copying the asked names and
  fields into the answer, the format, end of turn and padding, records and pairs).  The
  checkpoint is a plain LLaDA checkpoint.
* Objective: masked-diffusion SFT on the 32-token response (the prompt is never masked),
  plain cross-entropy over the masked tokens (trailing EOS padding weighted 0.1).  Most rows
  mask every value and few other tokens, so values are learned with their keys shown (a
  value predicted with its key masked only teaches a prior); the rest use LLaDA's noise
  (one probability t ~ U(0, 1) per row) or mask everything from a random cut on, as a
  block-wise sampler leaves it.
* Curriculum over the table size (members 1 -> 2 -> 4 -> 8, 4 fields each; system prompts
  without the rules paragraph until the table is full, then with it): a stage ends when
  the running accuracy on masked values whose name and field are shown reaches
  --grow-at.  At the full size the learning rate decays to 10 % over --final-steps.
* Determinism and resuming: every batch and every mask is drawn from (seed, step), and
  ckpt.pt (written every --ckpt-minutes and at the end) holds the model, the optimiser and
  the curriculum state, so `--resume` continues a stopped run exactly.

Usage:
  tools/.venv/bin/python tools/train.py --out runs/tiny --seed 0
  tools/.venv/bin/python tools/train.py --out runs/tiny --resume
  touch runs/tiny/STOP     # ends the run at the next step, with a checkpoint
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_common  # noqa: E402
import llada_common  # noqa: E402
import tasks  # noqa: E402

SPECIAL_TOKENS = llada_common.SPECIAL_TOKENS
GEN_LEN = 32
MAX_SEQ = 512  # max_sequence_length of the model
DEVICE = torch.device("cpu")
VALID_GROUP_START = 50_000_000  # training-stream groups used only for monitoring
# Curriculum stages: (members per table, bare system prompt).  One member: the field alone is
# the key; bare prompts (role line and table, no rules) keep the first lookups short.
STAGES = ((1, True), (2, True), (4, True), (8, True), (8, False))


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------


def tokenizer_corpus(seed, n_groups=400):
    lines = []
    for it in tasks.train_items(seed, 10_000_000, n_groups):
        lines.extend(it["system"].split("\n"))
        lines.append(it["user"])
        lines.append(tasks.answer_text(it["answer"]))
    lines += ["system", "user", "assistant"] * 50  # the chat template's role names
    return lines


def build_tokenizer(seed, target_total=1024):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target_total - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(tokenizer_corpus(seed), trainer)
    # the trained vocabulary may be smaller than asked for; the special tokens follow it
    fixture_common.add_special_tokens(tok, SPECIAL_TOKENS, tok.get_vocab_size(with_added_tokens=False))
    words = tasks.NAMES + tasks.FIELD_NAMES + [v for vs in tasks.FIELDS.values() for v in vs] + [":"]
    for w in words:
        if len(tok.encode(" " + w, add_special_tokens=False).ids) != 1:
            raise RuntimeError(f"' {w}' is not one token: raise target_total")
    if len(tok.encode("####", add_special_tokens=False).ids) != 1:
        raise RuntimeError("'####' is not one token")
    return tok


def save_tokenizer(tok, path):
    """tokenizer.json with merges in the "left right" string form (read by every release)."""
    probe = "\n".join(tokenizer_corpus(0, 5)) + "<|startoftext|>x 123<|mdm_mask|>"
    fixture_common.save_tokenizer(tok, path, probe)


class Ids:
    def __init__(self, tok):
        self.bos, self.eos, self.shi, self.ehi, self.eot, self.mask = (tok.token_to_id(t) for t in SPECIAL_TOKENS)
        n = tok.get_vocab_size(with_added_tokens=True)
        self.vocab = 64 * math.ceil(n / 64)


def encode_item(tok, ids, item):
    """(prompt ids, response ids of length GEN_LEN)."""
    prompt = tok.encode(tasks.render_chat(item["system"], item["user"]), add_special_tokens=False).ids
    resp = tok.encode(tasks.answer_text(item["answer"]), add_special_tokens=False).ids + [ids.eot]
    if len(resp) > GEN_LEN:
        raise ValueError(f"answer of {item['id']} does not fit in {GEN_LEN} tokens")
    return prompt, resp + [ids.eos] * (GEN_LEN - len(resp))


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, f = c["d_model"], c["mlp_hidden_size"]
        self.n_heads, self.n_kv = c["n_heads"], c["n_kv_heads"]
        self.hd = d // self.n_heads
        self.attn_norm = RMSNorm(d, c["rms_norm_eps"])
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * self.hd, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_norm = RMSNorm(d, c["rms_norm_eps"])
        self.ff_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.ff_out = nn.Linear(f, d, bias=False)
        # LLaDA attends both ways; tools/learnability.py sets this to compare with causal
        # attention (then without a padding bias).
        self.causal = False

    def forward(self, x, cos, sin, bias):
        B, T, D = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if self.n_kv < self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=self.causal)
        x = x + self.attn_out(a.transpose(1, 2).reshape(B, T, D))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


def rope(t, cos, sin):
    half = t.shape[-1] // 2
    rot = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rot * sin


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["embedding_size"], c["d_model"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["n_layers"]))
        self.ln_f = RMSNorm(c["d_model"], c["rms_norm_eps"])
        self.ff_out = nn.Linear(c["d_model"], c["embedding_size"], bias=False)


class LLaDA(nn.Module):
    """Parameter names match the HF checkpoint after prefixing "model." ."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.transformer = Transformer(c)
        hd = c["d_model"] // c["n_heads"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        pos = torch.arange(c["max_sequence_length"], dtype=torch.float32)
        ang = torch.outer(pos, inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids, key_valid=None, select=None):
        """ids [B, T]; key_valid [B, T] bool (False = padding, masked as keys).

        With select (a bool [B, T] mask) only the logits of the selected positions are
        computed, as a [N, V] tensor.
        """
        T = ids.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        bias = None
        if key_valid is not None and not bool(key_valid.all()):
            bias = torch.zeros(key_valid.shape, dtype=torch.float32, device=ids.device)
            bias = bias.masked_fill(~key_valid, float("-inf"))[:, None, None, :]
        x = self.transformer.wte(ids)
        for blk in self.transformer.blocks:
            x = blk(x, cos, sin, bias)
        if select is not None:
            x = x[select]
        return self.transformer.ff_out(self.transformer.ln_f(x))




def init_weights(model, seed, emb_std=0.02):
    g = torch.Generator().manual_seed(seed)
    n_layers = model.c["n_layers"]
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
            nn.init.ones_(p)
            continue
        std = 0.02
        if name.endswith("wte.weight"):
            std = emb_std
        elif name.endswith("attn_out.weight") or (".blocks." in name and name.endswith("ff_out.weight")):
            std = 0.02 / math.sqrt(2 * n_layers)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)


@torch.no_grad()
def plant_positional_heads(model, offsets, seed, c=3.0, planes=4, shared=1.0, u=None):
    """Layer-0 heads h (one per entry of offsets) attend from position m to m - offsets[h].

    A shared unit direction u is added to every token embedding (scaled by the mean row
    norm), so every position has a content-independent component after RMSNorm; then on
    the `planes` fastest RoPE planes j the query reads c*u into dim j and the key reads
    c*u rotated by offset*theta_j, so q.k after RoPE is sum_j c^2 (u.h)^2 cos((m-n-o) theta_j),
    which peaks at n = m - o.
    """
    cfg = model.c
    d, hd = cfg["d_model"], cfg["d_model"] // cfg["n_heads"]
    if u is None:  # else the caller has added its own shared direction
        g = torch.Generator().manual_seed(seed + 17)
        u = torch.randn(d, generator=g)
        u /= u.norm()
        wte = model.transformer.wte.weight
        wte += shared * wte.norm(dim=1).mean() * u
    blk = model.transformer.blocks[0]
    half = hd // 2
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    for h, o in enumerate(offsets):
        for j in range(planes):
            r = h * hd + j
            blk.q_proj.weight[r] = c * u
            blk.q_proj.weight[r + half] = 0.0
            blk.k_proj.weight[r] = c * math.cos(o * inv[j]) * u
            blk.k_proj.weight[r + half] = c * math.sin(o * inv[j]) * u


@torch.no_grad()
def plant_recall_circuit(model, offsets, mask_id, seed, code_scale=1.0, match_scale=3.0, mask_penalty=3.0,
                         copy_scale=2.0, slow_from=None):
    """A key -> value recall circuit as the starting point of training (a structured init).

    The residual stream is split: token embeddings live in the first half of the
    dimensions, and layer 0 writes *key codes* into the second half.
    * Layer 0, head h (offset o_h, planted by plant_positional_heads): its value reads the
      token embedding at m - o_h (minus the shared direction) and its output writes a random
      projection of it into code block h.  A value in the table and the value slot of an
      answer then both carry codes of the name (3 back) and the field (2 back).
    * Layer 1, head 0: query and key read the code blocks through the same random map H on
      the slowest RoPE planes (from slow_from up, nearly position-blind over the context),
      so q.k is large where the codes agree; on the last plane a query constant times a key
      that reads the mask token's embedding keeps the head off masked positions (a value
      slot matches its own codes too).  Its value/output copy the attended token's embedding.
    * The LM head starts as the token embeddings (the copied embedding reads out as its token).
    Everything else keeps its random initialisation, and every weight is trained afterwards.
    """
    cfg = model.c
    d, nh = cfg["d_model"], cfg["n_heads"]
    hd, half = d // nh, d // nh // 2
    E = d // 2  # embedding dims [0, E); code dims [E, d), one block per planted layer-0 head
    C = (d - E) // len(offsets)
    g = torch.Generator().manual_seed(seed + 29)
    tr = model.transformer
    wte = tr.wte.weight
    wte[:, E:] = 0.0
    wte *= wte.norm(dim=1).mean() / wte.norm(dim=1, keepdim=True)  # equal norms: codes compare by direction
    u = torch.zeros(d)
    u[:E] = torch.randn(E, generator=g)
    u /= u.norm()
    # the shared direction of plant_positional_heads, restricted to the embedding half
    wte += wte[:, :E].norm(dim=1).mean() * u
    plant_positional_heads(model, offsets, seed, c=5.0, u=u)
    no_u = torch.eye(d) - torch.outer(u, u)
    b0 = tr.blocks[0]
    for h in range(len(offsets)):
        R = torch.randn(hd, E, generator=g) / math.sqrt(E)
        v = torch.zeros(hd, d)
        v[:, :E] = R
        b0.v_proj.weight[h * hd : (h + 1) * hd] = code_scale * (v @ no_u)
        G = torch.randn(C, hd, generator=g) / math.sqrt(hd)
        b0.attn_out.weight[:, h * hd : (h + 1) * hd] = 0.0
        b0.attn_out.weight[E + h * C : E + (h + 1) * C, h * hd : (h + 1) * hd] = G
    b1 = tr.blocks[1]
    if slow_from is None:  # planes turning less than ~0.6 rad over the longest context
        inv = cfg["rope_theta"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        slow_from = int((inv * cfg["max_sequence_length"] > 0.6).sum())
    planes = list(range(slow_from, half - 1))
    H = torch.randn(len(planes) * 2, d - E, generator=g) / math.sqrt(d - E)
    rows = planes + [j + half for j in planes]
    b1.q_proj.weight[:hd] = 0.0
    b1.k_proj.weight[:hd] = 0.0
    for r, hrow in zip(rows, H):
        b1.q_proj.weight[r, E:] = match_scale * hrow
        b1.k_proj.weight[r, E:] = match_scale * hrow
    e_mask = wte[mask_id].clone()
    e_mask[:E] -= (e_mask[:E] @ u[:E]) * u[:E]
    e_mask /= e_mask.norm()
    b1.q_proj.weight[half - 1] = mask_penalty * u
    b1.k_proj.weight[half - 1] = -mask_penalty * e_mask
    # every layer-1 head copies what it attends to; only head 0 is told where to look (the
    # others learn it: the asked names and fields are copied from the question this way)
    for h in range(nh):
        R1 = torch.randn(hd, E, generator=g) / math.sqrt(E)
        b1.v_proj.weight[h * hd : (h + 1) * hd] = 0.0
        b1.v_proj.weight[h * hd : (h + 1) * hd, :E] = R1
        b1.attn_out.weight[:, h * hd : (h + 1) * hd] = 0.0
        b1.attn_out.weight[:E, h * hd : (h + 1) * hd] = copy_scale * R1.T
    tr.ff_out.weight.copy_(wte / wte[:, :E].norm(dim=1, keepdim=True).mean())


def model_config(args, ids):
    return {
        "d_model": args.d_model,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_heads,
        "n_layers": args.n_layers,
        "mlp_hidden_size": args.mlp,
        "vocab_size": ids.vocab,
        "embedding_size": ids.vocab,
        "max_sequence_length": MAX_SEQ,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": 1e-5,
        "mask_token_id": ids.mask,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.eos,
        "bos_token_id": ids.bos,
        "eot_token_id": ids.eot,
    }


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def value_slots(tok, resp):
    """Indices of the value tokens in a response (encode_item's): each follows a colon."""
    colon = tok.token_to_id("Ġ:")
    return [i + 1 for i, t in enumerate(resp[:-1]) if t == colon]


def training_batch(tok, ids, seed, step, batch, members, bare=False):
    """Rows of (prompt, response, value slots) for one step, drawn from (seed, step)."""
    rng = random.Random(seed * 1_000_003 + step)
    rows = []
    for b in range(batch):
        g = step * batch + b  # a new table for every row: groups are never reused
        grp = tasks.Group(random.Random(tasks.TRAIN_SEED_BASE + seed * 100_000 + g), f"train-{g}", members, bare)
        prompt, resp = encode_item(tok, ids, grp.item(rng, tasks.pick_task(rng), 0))
        rows.append((prompt, resp, value_slots(tok, resp)))
    return rows


def collate(rows, ids):
    T = max(len(p) for p, _, _ in rows) + GEN_LEN
    B = len(rows)
    x = torch.full((B, T), ids.eos, dtype=torch.long)
    resp = torch.zeros((B, T), dtype=torch.bool)
    valid = torch.zeros((B, T), dtype=torch.bool)
    vals = torch.zeros((B, T), dtype=torch.bool)
    for b, (p, r, vs) in enumerate(rows):
        L = len(p)
        x[b, :L] = torch.tensor(p)
        x[b, L : L + GEN_LEN] = torch.tensor(r)
        resp[b, L : L + GEN_LEN] = True
        valid[b, : L + GEN_LEN] = True
        for v in vs:
            vals[b, L + v] = True
    return x, resp, valid, vals


def sft_loss(model, rows, ids, gen, forward=None):
    """Masked-diffusion SFT loss of one batch and the accuracy on keyed value slots.

    Three masking modes, one per row:
    * keyed (60 %): every value masked, every other response token with probability 0.15,
      so most values are predicted with their name and field shown, as the sampler asks;
    * noise (20 %): every response token masked with one probability t ~ U(0, 1) (LLaDA);
    * cut (20 %): everything from a random cut c in [0, GEN_LEN] on masked, each earlier
      token with probability 0.1 (what a block-wise sampler leaves).
    Loss: mean CE over masked tokens, trailing EOS padding weighted 0.1.
    forward(noisy, valid, masked, rows) replaces the model's own forward (tools/deepen.py
    passes one with a per-layer attention mask).
    """
    x, resp, valid, vals = collate(rows, ids)
    B, T = x.shape
    L = torch.tensor([len(p) for p, _, _ in rows])
    pos = torch.arange(T)[None, :] - L[:, None]  # position within the response
    t = torch.rand((B, 1), generator=gen)
    u = torch.rand((B, T), generator=gen)
    mode = torch.rand((B, 1), generator=gen)
    cut = torch.randint(0, GEN_LEN + 1, (B, 1), generator=gen)
    m_keyed = vals | (u < 0.15)
    m_noise = u < t
    m_cut = (pos >= cut) | (u < 0.1)
    masked = torch.where(mode < 0.6, m_keyed, torch.where(mode < 0.8, m_noise, m_cut)) & resp
    noisy = torch.where(masked, torch.full_like(x, ids.mask), x)
    if forward is None:
        logits = model(noisy, valid, select=masked)
    else:
        logits = forward(noisy, valid, masked, rows)
    target = x[masked]
    ce = F.cross_entropy(logits, target, reduction="none")
    w = torch.where(target == ids.eos, 0.1, 1.0)
    loss = (ce * w).sum() / w.sum()
    # accuracy on masked value slots whose name (3 back) and field (2 back) are shown
    with torch.no_grad():
        shown = torch.zeros_like(masked)
        shown[:, 3:] = ~masked[:, :-3] & ~masked[:, 1:-2]
        keyed = (vals & masked & shown)[masked]
        hit = (logits.argmax(-1) == target)[keyed]
    return loss, (int(hit.sum()), int(keyed.sum()))


# ---------------------------------------------------------------------------
# sampler: the reference block-wise low-confidence generate at temperature 0
# ---------------------------------------------------------------------------


def most_confident(conf, masked, k):
    """Offsets of the k most confident masked positions of a block (ties to the lowest)."""
    c = torch.where(masked, conf, torch.full_like(conf, -math.inf))
    return torch.sort(-c, stable=True).indices[:k]


def transfer_counts(n_masked, steps):
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


@torch.no_grad()
def generate_batch(model, prompts, ids, steps=16, gen_length=GEN_LEN, block_length=4):
    """LLaDA `generate` (llada.md 3.1) for several prompts at once.

    Rows are padded at the end with <|endoftext|> and the padding is masked as keys, so
    every row computes what it computes alone; ties in confidence go to the lowest position.
    """
    B = len(prompts)
    T = max(len(p) for p in prompts) + gen_length
    x = torch.full((B, T), ids.eos, dtype=torch.long)
    valid = torch.zeros((B, T), dtype=torch.bool)
    for b, p in enumerate(prompts):
        x[b, : len(p)] = torch.tensor(p)
        x[b, len(p) : len(p) + gen_length] = ids.mask
        valid[b, : len(p) + gen_length] = True
    n_blocks = gen_length // block_length
    spb = steps // n_blocks
    for blk in range(n_blocks):
        lo = [len(p) + blk * block_length for p in prompts]
        counts = [transfer_counts(block_length, spb) for _ in prompts]
        for s in range(spb):
            logits = model(x, valid).double()
            x0 = logits.argmax(-1)
            conf = torch.softmax(logits, -1).gather(-1, x0[..., None])[..., 0]
            for b in range(B):
                seg = slice(lo[b], lo[b] + block_length)
                k = counts[b][s]
                if k == 0:
                    continue
                order = most_confident(conf[b, seg], x[b, seg] == ids.mask, k) + lo[b]
                x[b, order] = x0[b, order]
    return [x[b, len(p) : len(p) + gen_length].tolist() for b, p in enumerate(prompts)]


def extract_answer(tok, ids, out_ids):
    cut = []
    for t in out_ids:
        if t in (ids.eot, ids.eos):
            break
        cut.append(t)
    text = tok.decode(cut, skip_special_tokens=True)
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip()


def evaluate(model, tok, ids, items, **sampler):
    model.eval()
    per = {}
    outs = []
    for i in range(0, len(items), 32):
        chunk = items[i : i + 32]
        outs += generate_batch(model, [encode_item(tok, ids, it)[0] for it in chunk], ids, **sampler)
    for it, out in zip(items, outs):
        got = extract_answer(tok, ids, out)
        ok, n = per.get(it["task"], (0, 0))
        per[it["task"]] = (ok + (got == it["answer"]), n + 1)
    model.train()
    total = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    return total[0] / max(1, total[1]), {k: v[0] / v[1] for k, v in per.items()}


def valid_items(seed, n_groups=16, per_group=4):
    return list(tasks.train_items(seed, VALID_GROUP_START, n_groups, per_group))


# ---------------------------------------------------------------------------
# main loop
# ---------------------------------------------------------------------------


def lr_at(st, args):
    if st["step"] < args.warmup:
        return args.lr * (st["step"] + 1) / args.warmup
    if st["stage"] + 1 < len(STAGES):
        return args.lr
    frac = min(1.0, (st["step"] - st["final_from"]) / max(1, args.final_steps))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def save_checkpoint(path, model, opt, cfg, state):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "config": cfg, "state": state}, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue the run in --out from its ckpt.pt")
    ap.add_argument("--minutes", type=float, default=90.0, help="wall-clock limit of this invocation")
    ap.add_argument("--final-steps", type=int, default=1500, help="steps at the full table size (lr decays over them)")
    ap.add_argument("--target", type=float, default=0.99,
                    help="stop early once the monitored exact match at the full size reaches this (0: never)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-heads", type=int, default=2)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--mlp", type=int, default=256)
    ap.add_argument("--emb-std", type=float, default=1.0)
    ap.add_argument("--plant", default="3,2", help="layer-0 planted head offsets, one per head (empty: none)")
    ap.add_argument("--plant-match", type=int, default=1,
                    help="1: start from the planted recall circuit (plant_recall_circuit); 0: positional heads only")
    ap.add_argument("--match-scale", type=float, default=6.0)
    ap.add_argument("--copy-scale", type=float, default=4.0)
    ap.add_argument("--grow-at", type=float, default=0.9)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    log_path = os.path.join(args.out, "log.jsonl")

    def say(msg):
        print(msg, flush=True)

    if args.resume:
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        saved = ck["state"]["args"]
        # the run's own settings win, except flags given on this command line (e.g. a longer
        # --final-steps, or --target 0 to train on past the target)
        given = {a.dest for a in ap._actions
                 if any(w == o or w.startswith(o + "=") for w in sys.argv[1:] for o in a.option_strings)}
        for k, v in saved.items():
            if k not in ("resume", "minutes", "threads", "out") and k not in given:
                setattr(args, k, v)
    tok_path = os.path.join(args.out, "tokenizer.json")
    if args.resume:
        tok = Tokenizer.from_file(tok_path)
    else:
        tok = build_tokenizer(args.seed)
        save_tokenizer(tok, tok_path)
    ids = Ids(tok)
    cfg = model_config(args, ids)
    torch.manual_seed(args.seed)
    model = LLaDA(cfg)
    offsets = [int(o) for o in args.plant.split(",") if o.strip()]
    if not args.resume:  # else the weights come from the checkpoint
        init_weights(model, args.seed, args.emb_std)
        if offsets and args.plant_match:
            plant_recall_circuit(model, offsets, ids.mask, args.seed, match_scale=args.match_scale,
                                 copy_scale=args.copy_scale)
        elif offsets:
            plant_positional_heads(model, offsets, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    st = {"step": 0, "stage": 0, "final_from": 0, "acc_ema": 0.0, "loss_ema": None, "elapsed_s": 0.0,
          "curve": [], "stages": [], "seed": args.seed}
    if args.resume:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        st = ck["state"]
        say(f"resumed at step {st['step']} (stage {st['stage']}, {st['elapsed_s'] / 60:.1f} min so far)")
    st["args"] = dict(vars(args))
    n_params = sum(p.numel() for p in model.parameters())
    say(f"{n_params} parameters, vocab {ids.vocab}, planted offsets {offsets}")
    vitems = valid_items(args.seed)
    t0 = time.time()
    elapsed0 = st["elapsed_s"]
    last_ckpt = time.time()
    model.train()
    stop = None
    while stop is None:
        step = st["step"]
        members, bare = STAGES[st["stage"]]
        rows = training_batch(tok, ids, args.seed, step, args.batch, members, bare)
        gen = torch.Generator().manual_seed(args.seed * 7_919 + step)
        for group in opt.param_groups:
            group["lr"] = lr_at(st, args)
        loss, (hit, n) = sft_loss(model, rows, ids, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        st["step"] = step + 1
        lv = float(loss.detach())
        st["loss_ema"] = lv if st["loss_ema"] is None else 0.98 * st["loss_ema"] + 0.02 * lv
        if n:
            st["acc_ema"] = 0.95 * st["acc_ema"] + 0.05 * (hit / n)
        st["elapsed_s"] = elapsed0 + time.time() - t0
        if st["stage"] + 1 < len(STAGES) and st["acc_ema"] >= args.grow_at and st["step"] >= args.warmup:
            st["stages"].append({"members": members, "bare": bare, "until_step": st["step"],
                                 "min": st["elapsed_s"] / 60})
            st["stage"] += 1
            st["acc_ema"] = 0.0
            if st["stage"] + 1 == len(STAGES):
                st["final_from"] = st["step"]
            say(f"step {st['step']}: stage {STAGES[st['stage']]} (members, bare)")
        if st["step"] % 20 == 0:
            say(f"step {st['step']} members {members} loss {st['loss_ema']:.4f} keyed-value acc {st['acc_ema']:.3f} "
                f"lr {lr_at(st, args):.2e} {st['elapsed_s'] / 60:.1f} min")
        final = st["stage"] + 1 == len(STAGES)
        if st["step"] % args.eval_every == 0 and members == STAGES[-1][0]:
            acc, per = evaluate(model, tok, ids, vitems)
            rec = {"step": st["step"], "min": round(st["elapsed_s"] / 60, 2), "members": members, "bare": bare,
                   "exact": acc, "per_task": per, "loss_ema": st["loss_ema"], "keyed_value_acc": st["acc_ema"]}
            st["curve"].append(rec)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            say(f"  eval (block 4, 16 steps, {len(vitems)} items, {members} members): {acc:.3f} {per}")
            if final and args.target and acc >= args.target:
                stop = "target"
        if final and st["step"] - st["final_from"] >= args.final_steps:
            stop = "steps"
        if time.time() - t0 > args.minutes * 60:
            stop = "time limit"
        if os.path.exists(os.path.join(args.out, "STOP")):  # `touch OUT/STOP` ends a run cleanly
            os.remove(os.path.join(args.out, "STOP"))
            stop = "STOP file"
        if stop or time.time() - last_ckpt > args.ckpt_minutes * 60:
            st["stopped_by"] = stop or "checkpoint (run still going)"
            save_checkpoint(ckpt_path, model, opt, cfg, st)
            last_ckpt = time.time()
    say(f"stopped by {stop} at step {st['step']} ({st['elapsed_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
