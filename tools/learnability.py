"""How fast a small LLaDA-architecture model learns in-context retrieval, on synthetic data.

Two tasks, each a sequence of token ids whose last position is masked and must be filled:

* recall  key->value pairs ("k v ;" x pairs), then a query "? k" and the masked value: the
          answer must be bound to its key (an induction-style, two-hop circuit, what every
          table lookup of tools/tasks.py needs);
* kind    filler tokens with one token of each of `kinds` kinds scattered among them, then a
          query "? kind" and the masked answer: the one token of the asked kind (one
          content-based attention hop).

The model is tools/train.py's LLaDA (bidirectional attention unless --causal), trained with
cross-entropy on the masked position only, AdamW, batch 64.  It prints the loss and the
accuracy every 50 steps.

Usage:
  tools/.venv/bin/python tools/learnability.py recall --steps 1500
  tools/.venv/bin/python tools/learnability.py kind --steps 800
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402

MASK, SEP, QUERY = 1023, 1000, 1001


def recall_batch(rng, batch, pairs, keys):
    seqs = []
    for _ in range(batch):
        ks = rng.sample(range(keys), pairs)
        vs = [rng.randrange(500, 600) for _ in ks]
        seq = [t for k, v in zip(ks, vs) for t in (k, v, SEP)]
        q = rng.randrange(pairs)
        seqs.append(seq + [QUERY, ks[q], vs[q]])
    return seqs


def kind_batch(rng, batch, kinds, length=60):
    seqs = []
    for _ in range(batch):
        seq = [rng.randrange(100) for _ in range(length)]
        vals = [100 + 20 * k + rng.randrange(20) for k in range(kinds)]
        for pos, k in zip(rng.sample(range(length), kinds), rng.sample(range(kinds), kinds)):
            seq[pos] = vals[k]
        q = rng.randrange(kinds)
        seqs.append(seq + [SEP, 300 + q, QUERY, vals[q]])
    return seqs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task", choices=["recall", "kind"])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=8, help="recall: key-value pairs per sequence")
    ap.add_argument("--keys", type=int, default=50, help="recall: size of the key vocabulary")
    ap.add_argument("--kinds", type=int, default=8, help="kind: kinds per sequence")
    ap.add_argument("--causal", action="store_true", help="causal attention instead of LLaDA's bidirectional")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    cfg = {"d_model": args.d_model, "n_heads": args.heads, "n_kv_heads": args.heads, "n_layers": args.layers,
           "mlp_hidden_size": 3 * args.d_model, "vocab_size": 1024, "embedding_size": 1024,
           "max_sequence_length": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
    model = train.LLaDA(cfg)
    train.init_weights(model, args.seed)
    if args.causal:
        # the same blocks with a causal mask: the baseline of autoregressive models
        for blk in model.transformer.blocks:
            blk.causal = True
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(args.seed)
    t0, hits, n = time.time(), 0, 0
    for step in range(1, args.steps + 1):
        if args.task == "recall":
            seqs = recall_batch(rng, args.batch, args.pairs, args.keys)
        else:
            seqs = kind_batch(rng, args.batch, args.kinds)
        x = torch.tensor(seqs)
        target = x[:, -1].clone()
        x[:, -1] = MASK
        select = torch.zeros_like(x, dtype=torch.bool)
        select[:, -1] = True
        logits = model(x, None, select=select)
        loss = F.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        hits += int((logits.argmax(-1) == target).sum())
        n += len(seqs)
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f} accuracy {hits / n:.3f} ({time.time() - t0:.0f} s)", flush=True)
            hits = n = 0


if __name__ == "__main__":
    main()
