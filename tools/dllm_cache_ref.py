"""numpy reference of dLLM-Cache's adaptive refresh (issue 33), the rule the runtime's
`--cache dllm-cache` is to follow, and its goldens on the tiny fixture.

The rule (dLLM-Cache, arXiv 2506.06295; its reference hooks LLaDA's blocks):

* Per layer, the prompt's rows and the response's rows (the whole canvas) each keep their K,
  V, attention output (after `attn_out`) and MLP output (after `ff_out`).
* Forward n (counting from 1) refreshes the response when (n - 1) % K_r == 0 and the prompt
  when (n - 1) % K_p == 0; a refreshed part is computed in full (attention over every
  position's K/V, its caches overwritten).
* A response that is not refreshed is checked by V (V-verify), layer by layer: V of every
  response row from the layer's input; the int(rho * G) rows whose V has the lowest cosine
  with the cached V (ties to the lower position; a V equal to the cached one has cosine
  exactly 1) get their q and k, attention and MLP
  recomputed and scattered into the caches; the V cache takes every new V; the other rows
  take their cached attention and MLP outputs.  rho = 0 skips the check (the response is
  reused whole until its next refresh).
* With LLaDA's blocks (several of them), the runtime's default also computes the current
  block's rows at every forward (`pin_block`), as Fast-dLLM's dual cache does; V-verify
  then picks among the other response rows (at most G minus the block).  Without it the
  block's masked rows keep their outputs from the last refresh (their V does not move
  while their input is the mask), and the sampler must commit inside the block.
* A prompt that is not refreshed takes its cached outputs; its K/V stay as cached.
* A row's hidden state moves through the layers as x + attention output, then + MLP
  output, whichever of them is fresh or cached.

Defaults of the reference's demo: K_p = 100, K_r = 7, rho = 0.25.  Sampler: LLaDA's quota
rule at temperature 0 (low-confidence remasking), blocks as llada_ref.generate.  Float32
storage, float64 arithmetic, as tools/llada_ref.py.

    python3 tools/dllm_cache_ref.py --model tests/fixtures/tiny --write-goldens   # goldens/dllm_cache.json
    python3 tools/dllm_cache_ref.py --model tests/fixtures/tiny --check
    python3 tools/dllm_cache_ref.py --model tests/fixtures/tiny --self-check  # exact limits

Exact limits (`--self-check`): refreshing both parts at every forward (K_p = K_r = 1), or
the prompt at every forward with every response row verified (K_p = 1, rho = 1), gives
tools/llada_ref.py's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llada_ref  # noqa: E402
import acache_ref  # noqa: E402
from acache_ref import prompt_of  # noqa: E402


class LayerCache:
    """One layer's dLLM-Cache state over every position: K (rotated), V, attention output
    and MLP output."""

    def __init__(self, Hkv, T, hd, D):
        self.K = np.zeros((Hkv, T, hd), np.float32)
        self.V = np.zeros((Hkv, T, hd), np.float32)
        self.attn = np.zeros((T, D), np.float32)
        self.mlp = np.zeros((T, D), np.float32)


class Model(acache_ref.Model):
    """The layers of tools/acache_ref.py with dLLM-Cache's per-layer caches."""

    def __init__(self, params):
        super().__init__(params)
        self.caches = None

    def forward(self, ids, P, refresh_gen, refresh_prompt, rho, trace, pinned=()):
        """Logits of every position after one cached forward; `trace` gets each layer's
        V-verified rows (positions).  `pinned` positions of the response are computed in
        full whatever V-verify picks, which picks among the others."""
        nm = self.nm
        T = len(ids)
        G = T - P
        x = self.W["model.transformer.wte.weight"][np.asarray(ids)].astype(np.float32)
        prompt, gen = list(range(P)), list(range(P, T))
        if self.caches is None:
            self.caches = [LayerCache(self.Hkv, T, self.hd, self.D) for _ in range(self.L)]
        for li, L in enumerate(self.caches):
            fresh = (prompt if refresh_prompt else []) + (gen if refresh_gen else list(pinned))
            selected = []
            if not refresh_gen and rho > 0:
                # V-verify: V of every response row, cosine with the cached V.
                v = self.project(li, x[gen], gen, "v")["v"]  # [Hkv, G, hd]
                new = v.transpose(1, 0, 2).reshape(G, -1).astype(np.float64)
                old = L.V[:, P:].transpose(1, 0, 2).reshape(G, -1).astype(np.float64)
                cos = (new * old).sum(-1) / np.maximum(
                    np.linalg.norm(new, axis=-1) * np.linalg.norm(old, axis=-1), 1e-12)
                # A V that has not moved is exactly 1 (unmoved rows tie, by position).
                cos[np.all(new == old, axis=-1)] = 1.0
                k = min(int(G * rho), G - len(pinned))
                order = np.lexsort((np.arange(G), cos))  # lowest cosine first, then position
                order = [j for j in order if P + int(j) not in pinned]
                selected = sorted(P + int(j) for j in order[:k])
                L.V[:, P:] = v
                trace.append({"layer": li, "rows": selected})
            rows = fresh + selected
            if rows:
                qkv = self.project(li, x[rows], rows)
                L.K[:, rows] = qkv["k"]
                L.V[:, rows] = qkv["v"]
            # Attention after every K/V of the layer is in place.
            if rows:
                L.attn[rows] = self.attend(li, qkv["q"], L.K, L.V)
            x = nm.store(x.astype(np.float64) + L.attn)
            if rows:
                L.mlp[rows] = self.mlp(li, x[rows])
            x = nm.store(x.astype(np.float64) + L.mlp)
        return self.logits(x)


def generate(params, prompt, gen_length, steps, block_length, k_p, k_r, rho, pin_block=True):
    """dLLM-Cache generation at temperature 0: (canvas tokens, per-step trace).  With
    `pin_block` and several blocks, the current block's rows are computed at every forward
    (V-verify picks among the other response rows)."""
    model = Model(params)
    mask_id = params["config"]["mask_token_id"]
    P = len(prompt)
    x = np.array(list(prompt) + [mask_id] * gen_length, dtype=np.int64)
    blocks = gen_length // block_length
    trace, n = [], 0
    for nb in range(blocks):
        b0, b1 = P + nb * block_length, P + (nb + 1) * block_length
        quotas = llada_ref.num_transfer_tokens(int((x[b0:b1] == mask_id).sum()), steps // blocks)
        for i, quota in enumerate(quotas):
            n += 1
            verified = []
            rg, rp = (n - 1) % k_r == 0, (n - 1) % k_p == 0
            pinned = range(b0, b1) if pin_block and blocks > 1 and not rg else ()
            logits = model.forward(x, P, rg, rp, rho, verified, pinned).astype(np.float64)
            cand = [p for p in range(b0, b1) if x[p] == mask_id]
            sub = logits[cand]
            x0 = np.argmax(sub, axis=-1)
            conf = llada_ref.softmax64(sub)[np.arange(len(cand)), x0]
            order = llada_ref.rank_order(conf)
            chosen = sorted(cand[j] for j in order[:quota])
            margin = float(conf[order[quota - 1]] - conf[order[quota]]) if quota < len(cand) else None
            for j in order[:quota]:
                x[cand[j]] = int(x0[j])
            trace.append({"block": nb, "step": i, "forward": n, "refresh_response": rg,
                          "refresh_prompt": rp, "pinned": list(pinned), "verified": verified, "committed": chosen,
                          "tokens": [int(x[p]) for p in chosen], "conf_margin": margin})
    return x[P:].tolist(), trace


CASES = [
    # name, prompt length, gen_length, steps, block_length, K_p, K_r, rho, pin_block
    ("one_block_defaults", 20, 16, 16, 16, 100, 7, 0.25, True),
    ("blocks_of_4", 20, 16, 8, 4, 100, 7, 0.25, True),
    ("blocks_of_4_unpinned", 20, 16, 8, 4, 100, 7, 0.25, False),
    ("prompt_refresh_every_5", 24, 16, 16, 16, 5, 3, 0.5, True),
    ("no_verify", 20, 16, 16, 16, 100, 4, 0.0, True),
    ("no_verify_blocks_of_8", 20, 16, 8, 8, 100, 4, 0.0, True),
]


def build_goldens(params):
    out = []
    for name, n, g, steps, block, k_p, k_r, rho, pin in CASES:
        prompt = prompt_of(n, seed=11)
        tokens, trace = generate(params, prompt, g, steps, block, k_p, k_r, rho, pin)
        margins = [t["conf_margin"] for t in trace if t["conf_margin"] is not None]
        out.append({"name": name, "prompt": prompt, "gen_length": g, "steps": steps,
                    "block_length": block, "prompt_interval": k_p, "response_interval": k_r,
                    "refresh_ratio": rho, "pin_block": pin, "output": tokens, "steps_trace": trace,
                    "min_conf_margin": min(margins, default=None)})
    return {"description": "dLLM-Cache (tools/dllm_cache_ref.py): V-verified rows and temperature-0 tokens",
            "cases": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--write-goldens", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--self-check", action="store_true", help="the exact limits equal tools/llada_ref.py")
    args = ap.parse_args()
    params = llada_ref.load_checkpoint(args.model)
    if args.self_check:
        prompt = prompt_of(20, seed=11)
        want = llada_ref.generate(params, prompt, 16, 8, 4)[0][len(prompt):].tolist()
        for k_p, k_r, rho in [(1, 1, 0.0), (1, 3, 1.0)]:
            got, _ = generate(params, prompt, 16, 8, 4, k_p, k_r, rho)
            if got != want:
                sys.exit(f"K_p {k_p}, K_r {k_r}, rho {rho}: {got} != the uncached {want}")
        print("exact limits equal tools/llada_ref.py")
    goldens = build_goldens(params)
    path = os.path.join(args.model, "goldens", "dllm_cache.json")
    if args.write_goldens:
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(json.dumps(goldens, indent=1, allow_nan=False) + "\n")
    for c in goldens["cases"]:
        print(f"{c['name']}: output {c['output']}, min margin {c['min_conf_margin']}")
    if args.check:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
        bad = [c["name"] for c, s in zip(goldens["cases"], stored["cases"]) if c != s]
        if bad:
            sys.exit(f"differs from {path}: {bad}")
        print(f"{path}: every case agrees")


if __name__ == "__main__":
    main()
