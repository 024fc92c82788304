"""Train a tiny LLaDA-architecture model on the shared-system-prompt tasks (tools/tasks.py).

* Tokenizer: byte-level BPE trained on a corpus of generated training prompts, digits split
  one per token, followed by LLaDA's special tokens in LLaDA's order (BOS, EOS = pad,
  start/end header, end of turn, mask); no post-processor.
* Model: the LLaDA forward (llada.md section 2.2) in float32: RMSNorm, rotate_half RoPE,
  bidirectional attention, SwiGLU with ff_proj as the gate, separate LM head; parameter
  names follow the Hugging Face checkpoint (model.transformer.*).
* Objective: LLaDA SFT.  The prompt (chat template with system + user turns) is never
  masked; the response region is exactly GEN_LEN tokens ("#### answer", <|eot_id|>, then
  <|endoftext|> padding).  t ~ U(0, 1), p = (1 - eps) t + eps, every response token is
  masked with probability p, loss = sum over masked tokens of CE / p, divided by the
  response length and the batch size.
* Optimiser: AdamW, linear warmup then cosine decay to 10 %.  Batches group sequences of
  similar length; shorter ones are padded at the end and the padding is masked out as
  keys, so real tokens see exactly what they see unpadded.
* Determinism: everything is derived from --seed; the number of optimiser steps is either
  --steps or estimated once from the measured speed of the first steps and --minutes.
  The run stops at the step count or at the wall-clock limit, whichever comes first, and
  records the step reached.  Re-running with --steps N (N = the recorded total) and
  --stop-step S (S = the recorded step) repeats the run.

Usage:
  tools/.venv/bin/python tools/train.py --out runs/tiny --minutes 60
  tools/.venv/bin/python tools/train.py --out runs/smoke --minutes 2 --smoke
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
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402

SPECIAL_TOKENS = [
    "<|startoftext|>",  # BOS
    "<|endoftext|>",  # EOS = PAD
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|mdm_mask|>",  # mask
]
GEN_LEN = 32
EPS = 1e-3
MAX_SEQ = 512  # max_sequence_length of the model
# Where the model and batches live (--device). Random draws stay on the CPU generator so a
# run gives the same masks on every device.
DEVICE = torch.device("cpu")
VALID_GROUP_START = 50_000_000  # training-stream groups used only for monitoring


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------


def tokenizer_corpus(seed, n_groups=400):
    lines = []
    for it in tasks.train_items(seed, 10_000_000, n_groups):
        lines.extend(it["system"].split("\n"))
        lines.append(it["user"])
        lines.append(tasks.answer_text(it["answer"]))
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
    n_ord = tok.get_vocab_size(with_added_tokens=False)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False) for t in SPECIAL_TOKENS]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != n_ord + i:
            raise RuntimeError(f"{t} got id {tok.token_to_id(t)}")
    return tok


def save_tokenizer(tok, path):
    """tokenizer.json with merges in the "left right" string form (read by every release)."""
    data = json.loads(tok.to_str())
    merges = data["model"]["merges"]
    for m in merges:
        if isinstance(m, list) and any(" " in part for part in m):
            raise RuntimeError(f"merge {m} contains a space")
    data["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in merges]
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    reloaded = Tokenizer.from_file(path)
    probe = "\n".join(tokenizer_corpus(0, 5)) + "<|startoftext|>x 123<|mdm_mask|>"
    if reloaded.encode(probe, add_special_tokens=False).ids != tok.encode(probe, add_special_tokens=False).ids:
        raise RuntimeError("tokenizer.json does not reproduce the trained tokenizer")


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


def init_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    n_layers = model.c["n_layers"]
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
            nn.init.ones_(p)
            continue
        std = 0.02
        if name.endswith("attn_out.weight") or (".blocks." in name and name.endswith("ff_out.weight")):
            std = 0.02 / math.sqrt(2 * n_layers)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)


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


HEADER_USER = "<|start_header_id|>user<|end_header_id|>\n\n"
HEADER_ASSISTANT = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def encode_conversation(tok, ids, items):
    """One conversation over the system prompt of items[0]: every item is a user turn and
    its answer.  Returns (sequence ids, response flags): earlier answers are "#### a" and
    <|eot_id|> as a chat history has them; the last one is the GEN_LEN response region of
    `encode_item`, so a one-item conversation is exactly a single-turn request.
    """
    seq, resp = [], []

    def put(tokens, is_resp):
        seq.extend(tokens)
        resp.extend([is_resp] * len(tokens))

    for i, it in enumerate(items):
        if i == 0:
            prompt = tasks.render_chat(it["system"], it["user"])
        else:
            prompt = HEADER_USER + it["user"].strip() + "<|eot_id|>" + HEADER_ASSISTANT
        put(tok.encode(prompt, add_special_tokens=False).ids, False)
        if i + 1 < len(items):
            put(tok.encode(tasks.answer_text(it["answer"]), add_special_tokens=False).ids + [ids.eot], True)
        else:
            put(encode_item(tok, ids, it)[1], True)
    return seq, resp


class Stream:
    """Deterministic stream of length-grouped batches of training conversations.

    Each prompt group's questions are packed into conversations of 1..max_turns user
    turns over the group's system prompt: the long prompt is computed once for several
    answers, which multiplies the supervised tokens per step.  `rows_at(step)` gives the
    table size range of newly drawn groups (a curriculum from small to full tables).
    """

    def __init__(self, tok, ids, seed, batch, pool_groups=64, per_group=16, first_pool=0,
                 max_turns=6, rows_at=lambda step: (6, 8), recall_frac=0.0, recall_turns=10,
                 bare_at=lambda step: False):
        self.tok, self.ids, self.seed, self.batch = tok, ids, seed, batch
        self.pool_groups, self.per_group = pool_groups, per_group
        self.pool_index = first_pool
        self.max_turns, self.rows_at = max_turns, rows_at
        self.recall_frac, self.recall_turns = recall_frac, recall_turns
        self.bare_at = bare_at
        self.queue = []

    def _fill(self, step):
        start = self.pool_index * self.pool_groups
        rows, bare = self.rows_at(step), self.bare_at(step)
        items = list(tasks.train_items(self.seed, start, self.pool_groups, self.per_group, rows, bare))
        rng = random.Random(self.seed * 7919 + self.pool_index)
        self.pool_index += 1
        by_group = {}
        for it in items:
            by_group.setdefault(it["prompt_group"], []).append(it)
        seqs = []
        for g in sorted(by_group):
            its = by_group[g]
            i = 0
            while i < len(its):
                k = rng.randint(1, self.max_turns)
                conv = encode_conversation(self.tok, self.ids, its[i : i + k])
                while len(conv[0]) > MAX_SEQ and k > 1:
                    k -= 1
                    conv = encode_conversation(self.tok, self.ids, its[i : i + k])
                seqs.append(conv)
                i += k
            if rng.random() < self.recall_frac:
                g_index = int(g.rsplit("-", 1)[1])
                drills = tasks.recall_items(self.seed, g_index, self.recall_turns, rows, bare)
                k = len(drills)
                conv = encode_conversation(self.tok, self.ids, drills)
                while len(conv[0]) > MAX_SEQ and k > 1:
                    k -= 1
                    conv = encode_conversation(self.tok, self.ids, drills[:k])
                seqs.append(conv)
        rng.shuffle(seqs)
        seqs.sort(key=lambda s: len(s[0]))
        batches = [seqs[i : i + self.batch] for i in range(0, len(seqs) - self.batch + 1, self.batch)]
        rng.shuffle(batches)
        self.queue.extend(batches)

    def next(self, step=0):
        if not self.queue:
            self._fill(step)
        return self.queue.pop(0)


def collate(batch, ids):
    T = max(len(s) for s, _ in batch)
    x = torch.full((len(batch), T), ids.eos, dtype=torch.long)
    resp = torch.zeros((len(batch), T), dtype=torch.bool)
    valid = torch.zeros((len(batch), T), dtype=torch.bool)
    for b, (s, r) in enumerate(batch):
        x[b, : len(s)] = torch.tensor(s)
        resp[b, : len(s)] = torch.tensor(r)
        valid[b, : len(s)] = True
    return x.to(DEVICE), resp.to(DEVICE), valid.to(DEVICE)


def sft_loss(model, batch, ids, gen, pt_frac=0.0):
    """LLaDA SFT loss on one batch; gen is the torch.Generator for the masking noise.

    Every answer token of a conversation is masked with the row's probability p; the
    row's loss is the sum of CE / p over masked tokens divided by its number of answer
    tokens (for a single-turn row, GEN_LEN).

    With pt_frac > 0 each row is, with that probability, trained with the masked-diffusion
    pretraining objective instead: every real token of the whole sequence (prompt and
    response) is masked with probability p and the row's loss is divided by its length.
    """
    x, resp, valid = collate(batch, ids)
    B = x.shape[0]
    n_resp = resp.sum(1, keepdim=True).float()
    t = torch.rand((B, 1), generator=gen).to(DEVICE)
    p_mask = (1 - EPS) * t + EPS
    u = torch.rand(x.shape, generator=gen).to(DEVICE)
    if pt_frac > 0:
        pt_rows = torch.rand((B, 1), generator=gen).to(DEVICE) < pt_frac
        region = torch.where(pt_rows, valid, resp)
        norm = torch.where(pt_rows, valid.sum(1, keepdim=True).float(), n_resp)
    else:
        region = resp
        norm = n_resp
    masked = (u < p_mask) & region
    noisy = torch.where(masked, torch.full_like(x, ids.mask), x)
    logits = model(noisy, valid, select=masked)
    target = x[masked]
    ce = F.cross_entropy(logits, target, reduction="none")
    w = (1.0 / (p_mask * norm)).expand(B, x.shape[1])[masked]
    # Teacher-forced accuracy on masked answer tokens other than the EOS padding: a free
    # progress signal (exact-match generation only moves once lookups work).
    with torch.no_grad():
        real = (target != ids.eos) & resp[masked]
        hits = int((logits.argmax(-1) == target)[real].sum())
    return (ce * w).sum() / B, (hits, int(real.sum()))


# ---------------------------------------------------------------------------
# sampler (the reference low-confidence generate, temperature 0) for monitoring
# ---------------------------------------------------------------------------


@torch.no_grad()
def generate(model, prompt, ids, steps=32, gen_length=GEN_LEN):
    Lp = len(prompt)
    x = torch.full((1, Lp + gen_length), ids.mask, dtype=torch.long)
    x[0, :Lp] = torch.tensor(prompt)
    x = x.to(DEVICE)
    quotas = [gen_length // steps + (1 if i < gen_length % steps else 0) for i in range(steps)]
    for k in quotas:
        mask_index = x[0] == ids.mask
        logits = model(x)[0].double()
        x0 = logits.argmax(-1)
        p = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
        conf = torch.where(mask_index, p, torch.full_like(p, -math.inf))
        # stable top-k: highest confidence first, ties to the lowest position
        order = torch.sort(-conf, stable=True).indices[:k]
        x[0, order] = x0[order]
    return x[0, Lp:].tolist()


@torch.no_grad()
def generate_batch(model, prompts, ids, steps=32, gen_length=GEN_LEN):
    """`generate` for several prompts at once (one block).

    Rows are padded at the end with <|endoftext|> and the padding is masked as keys, so
    every row computes what it computes alone.  Returns the generated ids of each row.
    """
    B = len(prompts)
    T = max(len(p) for p in prompts) + gen_length
    x = torch.full((B, T), ids.eos, dtype=torch.long)
    valid = torch.zeros((B, T), dtype=torch.bool)
    for b, p in enumerate(prompts):
        x[b, : len(p)] = torch.tensor(p)
        x[b, len(p) : len(p) + gen_length] = ids.mask
        valid[b, : len(p) + gen_length] = True
    x, valid = x.to(DEVICE), valid.to(DEVICE)
    quotas = [gen_length // steps + (1 if i < gen_length % steps else 0) for i in range(steps)]
    for k in quotas:
        mask_index = x == ids.mask
        logits = model(x, valid).double()
        x0 = logits.argmax(-1)
        p = torch.softmax(logits, -1).gather(-1, x0[..., None])[..., 0]
        conf = torch.where(mask_index, p, torch.full_like(p, -math.inf))
        order = torch.sort(-conf, dim=-1, stable=True).indices[:, :k]
        rows = torch.arange(B, device=DEVICE)[:, None].expand(B, k)
        x[rows, order] = x0[rows, order]
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


def evaluate(model, tok, ids, items):
    model.eval()
    per = {}
    outs = generate_batch(model, [encode_item(tok, ids, it)[0] for it in items], ids)
    for it, out in zip(items, outs):
        got = extract_answer(tok, ids, out)
        ok, n = per.get(it["task"], (0, 0))
        per[it["task"]] = (ok + (got == it["answer"]), n + 1)
    model.train()
    total = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    return total[0] / max(1, total[1]), {k: v[0] / v[1] for k, v in per.items()}


def valid_items(seed, n_groups=6, per_group=4):
    return list(tasks.train_items(seed, VALID_GROUP_START, n_groups, per_group))


# ---------------------------------------------------------------------------
# main loop
# ---------------------------------------------------------------------------


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def save_checkpoint(path, model, opt, cfg, state):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "config": cfg, "state": state}, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--steps", type=int, default=0, help="total optimiser steps (0: estimate from --minutes)")
    ap.add_argument("--stop-step", type=int, default=0,
                    help="stop after this many steps while keeping the --steps schedule (repeats a time-limited run)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=384)
    ap.add_argument("--max-turns", type=int, default=6, help="user turns per training conversation: 1..N")
    ap.add_argument("--curriculum-steps", type=int, default=0,
                    help="table sizes grow over these steps: 2-4 rows, then 4-6, then the full 6-8")
    ap.add_argument("--valid-items", type=int, default=24, help="single-turn items checked at each checkpoint")
    ap.add_argument("--recall-frac", type=float, default=0.0,
                    help="per prompt group, the chance of one extra conversation of lookup drills")
    ap.add_argument("--recall-turns", type=int, default=10, help="drills in such a conversation")
    ap.add_argument("--bare-steps", type=int, default=0,
                    help="groups drawn before this step have bare system prompts (role line and table)")
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (a GPU trains the model in minutes)")
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--probe-steps", type=int, default=20, help="steps timed to estimate the total")
    ap.add_argument("--smoke", action="store_true", help="print sequence statistics and timing only")
    ap.add_argument("--first-pool", type=int, default=0,
                    help="index of the first data pool (64 prompt groups each); a continued run uses new data")
    ap.add_argument("--init", default=None, help="start from the weights of this checkpoint (optimiser state is new)")
    ap.add_argument("--pt-frac", type=float, default=0.0,
                    help="fraction of rows trained with the whole-sequence masked-diffusion pretraining objective")
    args = ap.parse_args()

    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    deadline = t_start + args.minutes * 60
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "train.log"), "a", buffering=1)

    def say(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log.write(line + "\n")

    tok = build_tokenizer(args.seed)
    save_tokenizer(tok, os.path.join(args.out, "tokenizer.json"))
    ids = Ids(tok)
    cfg = model_config(args, ids)
    say(f"tokenizer: {tok.get_vocab_size()} tokens, vocab/embedding {ids.vocab}; config {json.dumps(cfg)}")

    model = LLaDA(cfg)
    init_weights(model, args.seed)
    if args.init:
        init = torch.load(args.init, map_location="cpu", weights_only=False)
        if init["config"] != cfg:
            raise SystemExit("--init checkpoint has a different configuration")
        model.load_state_dict(init["model"])
        say(f"initialised from {args.init} (step {init['state']['step']})")
    model.to(DEVICE)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"parameters: {n_params}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    def rows_at(step):
        if step < args.curriculum_steps // 2:
            return (2, 4)
        if step < args.curriculum_steps:
            return (4, 6)
        return (6, 8)

    stream = Stream(tok, ids, args.seed, args.batch, first_pool=args.first_pool,
                    max_turns=args.max_turns, rows_at=rows_at, recall_frac=args.recall_frac,
                    recall_turns=args.recall_turns, bare_at=lambda step: step < args.bare_steps)
    gen = torch.Generator().manual_seed(args.seed + 1)
    vitems = valid_items(args.seed)

    if args.smoke:
        lens = [len(encode_item(tok, ids, it)[0]) for it in tasks.train_items(args.seed, 0, 50)]
        sys_lens = []
        for it in tasks.train_items(args.seed, 0, 50, 1):
            sys_lens.append(len(tok.encode(it["system"], add_special_tokens=False).ids))
        say(f"prompt tokens: min {min(lens)} mean {np.mean(lens):.1f} max {max(lens)}; "
            f"system tokens mean {np.mean(sys_lens):.1f}; request mean {np.mean(lens) + GEN_LEN:.1f}")

    total = args.steps
    step, loss_ema, last_ckpt, t_train = 0, None, time.time(), time.time()
    acc_hits = acc_n = 0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    stopped_by = "steps"
    while True:
        if total and step >= total:
            break
        if args.stop_step and step >= args.stop_step:
            stopped_by = "stop-step"
            break
        if time.time() >= deadline:
            stopped_by = "time"
            break
        cur_total = total or 10**9
        lr = lr_at(step, cur_total, args.lr, args.warmup) if total else args.lr * (step + 1) / args.warmup
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        batch = stream.next(step)
        loss, (hits, n_real) = sft_loss(model, batch, ids, gen, args.pt_frac)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lv = loss.item()
        loss_ema = lv if loss_ema is None else 0.98 * loss_ema + 0.02 * lv
        acc_hits += hits
        acc_n += n_real
        if not total and step == args.probe_steps:
            per_step = (time.time() - t_train) / step
            remaining = deadline - time.time() - 60  # leave a minute for the last checkpoint
            total = step + max(1, int(0.93 * remaining / per_step))
            say(f"{per_step:.3f} s/step over the first {step} steps -> total steps {total}")
            if args.smoke:
                break
        if step % 25 == 0:
            say(f"step {step}/{total or '?'} loss {lv:.4f} ema {loss_ema:.4f} "
                f"answer-token acc {acc_hits / max(1, acc_n):.3f} lr {lr:.2e} "
                f"elapsed {(time.time() - t_start) / 60:.1f} min")
            acc_hits = acc_n = 0
        if time.time() - last_ckpt >= args.ckpt_minutes * 60:
            acc, per = evaluate(model, tok, ids, vitems[: args.valid_items])
            say(f"step {step}: validation exact match {acc:.3f} {per}")
            save_checkpoint(ckpt_path, model, opt, cfg, {
                "step": step, "total_steps": total, "loss_ema": loss_ema, "seed": args.seed,
                "args": vars(args), "elapsed_s": time.time() - t_start, "n_params": n_params, "valid_acc": acc})
            last_ckpt = time.time()
    acc, per = evaluate(model, tok, ids, vitems)
    say(f"final step {step} (stopped by {stopped_by}); loss ema {loss_ema:.4f}; validation {acc:.3f} {per}")
    save_checkpoint(ckpt_path, model, opt, cfg, {
        "step": step, "total_steps": total, "loss_ema": loss_ema, "seed": args.seed, "args": vars(args),
        "elapsed_s": time.time() - t_start, "n_params": n_params, "valid_acc": acc, "valid_per_task": per,
        "stopped_by": stopped_by, "final": True})
    say("done")


if __name__ == "__main__":
    main()
