"""PyTorch reference of the Dream forward pass and of Dream's samplers.

The PyTorch counterpart of tools/dream_ref.py (the numpy spec of the Dream family:
Dream-v0-7B, DiffuCoder), for one sequence at a time (batch size 1).  It is the reference
`tools/parity.py --against torch` uses for a checkpoint whose config.json says
`"model_type": "Dream"`, and it has the shape of tools/llada_torch.py: `load(directory,
device, dtype)` gives an object with `.config`, `.forward(ids)` (unshifted logits
[T, vocab_size], float32) and `.generate(prompt_ids, ...)`.  The config, tensor shapes
and quota rule it shares with tools/dream_ref.py are in tools/dream_common.py; checkpoint
loading and .npy output, shared with tools/llada_torch.py, in tools/torch_common.py.

Model: the Qwen2 decoder without the causal mask.  q/k/v projections with biases, GQA
(query head h reads kv head h // (H / Hkv)), half-split ("rotate_half") RoPE, RMSNorm,
SwiGLU MLP, untied LM head unless `tie_word_embeddings`.  The prediction for position i
is read from the output row i - 1 ("shifted logits"); position 0 reads its own row.

Numerics
--------
* `dtype="bf16"`: the weights are bfloat16 and every operation runs on bfloat16 tensors,
  the way the Hugging Face Dream code runs with `torch_dtype=torch.bfloat16`: linear
  layers (bias included) return bf16; RMSNorm normalises in float32, rounds, then scales
  (rounds again); the RoPE angles are float32 but cos/sin are rounded to bf16 and the
  rotation `q * cos + rotate_half(q) * sin` is three bf16 operations; SDPA attention; the
  SiLU output and the gate x up product are rounded; the logits stay bf16 (no upcast), so
  the sampler's softmax, margins and entropies are bf16 too.
* `dtype="f32"`: the same code in float32 (bf16 checkpoints widened exactly); TF32 is
  switched off on CUDA so products are true float32.

Samplers (temperature 0 decides as the runtime does, so runs agree token for token)
-----------------------------------------------------------------------------------
* Original schedule (`block_length` None or `gen_length`, no threshold): Dream's
  `diffusion_generate`.  Timesteps `linspace(1, eps, steps + 1)` in float64 (numpy's
  formula: t_i = i * ((eps - 1) / steps) + 1, the last one eps exactly); step i commits
  `int(masked * (1 - t_{i+1} / t_i))` positions (all at the last step) out of every masked
  position of the canvas, prompt included.
* Block schedule (`block_length < gen_length`, or `threshold`): the Fast-dLLM Dream port.
  Each block opens with a step that commits its first position with the argmax; then
  per-step quotas from the block's own timestep table (`linspace(1, eps, spb + 1)`,
  spb = steps / blocks, steps 1 .. spb - 1), or, with `threshold`, the most confident
  position plus every one at or above the threshold (float32) until the block is full.
* alg: `maskgit_plus` (probability of the argmax), `topk_margin` (top-1 minus top-2
  probability), `entropy` (sum p * log(p + 1e-10)), `origin` (each masked position
  commits with probability 1 - s/t, one draw per position in ascending order).
  `alg_temp > 0` draws the n positions without replacement with weights
  softmax(confidence / alg_temp) (float64), one uniform per pick by tools/dream_ref.py's
  running-sum rule.  Random numbers come from a `torch.Generator` seeded with `seed`
  (float32 uniforms), or from `draws` (one list per step, as the goldens store them).
* Ranking: stable by descending confidence (float32; rounded to bf16 first with
  `round_confidence_bf16`), ties to the lowest position, NaN last, -0.0 equal to 0.0.
* A step whose quota is 0 runs no forward pass and is left out of the returned steps
  (at temperature 0 the next step sees the same canvas); its index is still counted.
* `temperature > 0` samples the tokens with `torch.multinomial` (the distribution of
  Dream's categorical sampling, not the runtime's random numbers).

Command line (from the repository root; needs PyTorch):

    python tools/dream_torch.py logits --model DIR --ids 1,2,3 --out f.npy [--device cpu] [--dtype f32]
    python tools/dream_torch.py generate --model DIR --ids 1,2,3 --gen-length 32 --steps 32 \\
        [--block-length 16] [--alg entropy] [--threshold 0.9] [--json]
    python tools/dream_torch.py self-test [--model tests/fixtures/tiny-dream] [--device cpu]

`self-test` compares, in float32, the logits with the checkpoint's goldens/logits.json
(relative error bound 1e-4 of the largest |logit|) and replays every case of
goldens/generate.json (random ones with their stored draws), which must agree exactly,
per step included.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_common  # noqa: E402
import llada_common  # noqa: E402
import torch_common  # noqa: E402

ALGS = ("maskgit_plus", "topk_margin", "entropy", "origin")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


class _Layer:
    def __init__(self, w, i):
        p = f"model.layers.{i}."
        self.norm1 = w[p + "input_layernorm.weight"]
        self.q, self.q_b = w[p + "self_attn.q_proj.weight"], w[p + "self_attn.q_proj.bias"]
        self.k, self.k_b = w[p + "self_attn.k_proj.weight"], w[p + "self_attn.k_proj.bias"]
        self.v, self.v_b = w[p + "self_attn.v_proj.weight"], w[p + "self_attn.v_proj.bias"]
        self.o = w[p + "self_attn.o_proj.weight"]
        self.norm2 = w[p + "post_attention_layernorm.weight"]
        self.gate = w[p + "mlp.gate_proj.weight"]
        self.up = w[p + "mlp.up_proj.weight"]
        self.down = w[p + "mlp.down_proj.weight"]


def _stable_desc_order(conf):
    """Indices by descending confidence, ties to the lower index; NaN last, -0.0 == 0.0."""
    key = torch.where(torch.isnan(conf), torch.full_like(conf, -math.inf), conf) + 0.0
    return torch.sort(key, descending=True, stable=True).indices


def _as_f32(x):
    """A Python float rounded to float32 (the runtime holds thresholds as float32)."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def timesteps(steps, eps):
    """numpy.linspace(1, eps, steps + 1) as float64 values, by numpy's own formula."""
    step = (eps - 1.0) / steps
    return [i * step + 1.0 for i in range(steps)] + [float(eps)]


def pick_by_draws(weights, draws):
    """Sampling without replacement, one uniform per pick (tools/dream_ref.py's rule): over
    the remaining indices in ascending order, the first whose running weight sum exceeds
    u * (remaining total); the last remaining when rounding leaves none."""
    remaining = list(range(len(weights)))
    picks = []
    for u in draws:
        total = sum(weights[j] for j in remaining)
        target = float(u) * total
        run, pick = 0.0, len(remaining) - 1
        for idx, j in enumerate(remaining):
            run += weights[j]
            if run > target:
                pick = idx
                break
        picks.append(remaining.pop(pick))
    return picks


class Dream:
    """A loaded Dream checkpoint: `forward(ids)` and `generate(prompt_ids, ...)`."""

    def __init__(self, cfg, weights, device, dtype, directory=None):
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.directory = directory
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.head = self.embed if cfg["tie_word_embeddings"] else weights["lm_head.weight"]
        self.layers = [_Layer(weights, i) for i in range(cfg["num_hidden_layers"])]
        hd = cfg["head_dim"]
        # inverse frequencies as Hugging Face builds them: int64 arange, float32 division
        exponent = torch.arange(0, hd, 2, dtype=torch.int64).float() / hd
        self._inv_freq = (1.0 / (cfg["rope_theta"] ** exponent)).to(self.device)

    # -- forward ------------------------------------------------------------------------

    def _rmsnorm(self, x, w):
        xf = x.float()
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config["rms_norm_eps"])
        return w * n.to(x.dtype)

    def _cos_sin(self, positions):
        """cos/sin [T, head_dim]: float32 angles, then cast to the compute dtype."""
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    @staticmethod
    def _rope(t, cos, sin):
        """t [heads, T, hd] in the compute dtype; rotate_half pairs d with d + hd/2."""
        half = t.shape[-1] // 2
        rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * cos + rotated * sin

    @torch.no_grad()
    def forward_native(self, ids, attention_mask=None):
        """Unshifted logits [T, vocab_size] in the compute dtype.

        Without `attention_mask`, positions 0..T-1 and full bidirectional attention.  With
        it (1 = token, 0 = pad), positions cumsum(mask) - 1 (pads at 1) and pad keys are
        masked for every query, as tools/dream_ref.py does; pad rows carry no meaning.
        """
        cfg = self.config
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        T = ids.shape[0]
        if T == 0:
            raise ValueError("forward needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg["vocab_size"]:
            raise ValueError(f"token ids must lie in 0..{cfg['vocab_size'] - 1}")
        H, Hkv, hd, D = (cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size"))
        mask = None
        if attention_mask is None:
            positions = torch.arange(T, device=self.device)
        else:
            am = torch.as_tensor(attention_mask, dtype=torch.long, device=self.device).reshape(-1)
            if am.shape[0] != T:
                raise ValueError("attention_mask must have one entry per token")
            if not bool(am.any()):
                raise ValueError("attention_mask masks every token")
            positions = torch.where(am != 0, torch.cumsum(am, 0) - 1, torch.ones_like(am))
            mask = (am != 0)[None, None, None, :].expand(1, H, T, T)
        cos, sin = self._cos_sin(positions)

        x = self.embed[ids]
        for L in self.layers:
            h = self._rmsnorm(x, L.norm1)
            q = F.linear(h, L.q, L.q_b).view(T, H, hd).transpose(0, 1)
            k = F.linear(h, L.k, L.k_b).view(T, Hkv, hd).transpose(0, 1)
            v = F.linear(h, L.v, L.v_b).view(T, Hkv, hd).transpose(0, 1)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            if Hkv < H:
                k = k.repeat_interleave(H // Hkv, dim=0)
                v = v.repeat_interleave(H // Hkv, dim=0)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=False)[0]
            x = x + F.linear(a.transpose(0, 1).reshape(T, D), L.o)
            h = self._rmsnorm(x, L.norm2)
            x = x + F.linear(F.silu(F.linear(h, L.gate)) * F.linear(h, L.up), L.down)
        return F.linear(self._rmsnorm(x, self.norm), self.head)

    def forward(self, ids, attention_mask=None):
        """float32 unshifted logits [T, vocab_size] (row i = the output at position i)."""
        return self.forward_native(ids, attention_mask).float()

    def shifted_logits(self, ids):
        """Row i predicts position i: output row i - 1, row 0 its own (compute dtype)."""
        lg = self.forward_native(ids)
        return torch.cat((lg[:1], lg[:-1]), dim=0)

    # -- Dream's sample_tokens ----------------------------------------------------------

    def _filter(self, lg, top_p, top_k):
        low = torch.finfo(lg.dtype).min
        if top_p is not None and top_p < 1:
            sorted_lg, order = torch.sort(lg, dim=-1, descending=True, stable=True)
            cum = torch.cumsum(torch.softmax(sorted_lg, dim=-1), dim=-1)
            drop = torch.zeros_like(cum, dtype=torch.bool)
            drop[:, 1:] = cum[:, :-1] > top_p  # the first token always stays
            lg = lg.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), low)
        if top_k is not None:
            kth = torch.topk(lg, min(int(top_k), lg.shape[-1]), dim=-1).values[:, -1:]
            lg = lg.masked_fill(lg < kth, low)
        return lg

    def _tokens(self, rows, kind, temperature, top_p, top_k, gen):
        """(confidence float32 [n], token ids [n]) of logit rows [n, V] in the compute dtype.

        kind: "probability", "margin" or "entropy" (Dream's margin_confidence / neg_entropy).
        """
        if rows.shape[0] == 0:
            return torch.zeros(0, device=self.device), torch.zeros(0, dtype=torch.long, device=self.device)
        lg = rows / temperature if temperature > 0 else rows
        lg = self._filter(lg, top_p, top_k)
        probs = torch.softmax(lg, dim=-1)
        if temperature > 0:
            x0 = torch.multinomial(probs.float(), 1, generator=gen)[:, 0]
            conf = probs.gather(-1, x0[:, None])[:, 0]
        else:
            conf, x0 = probs.max(dim=-1)
        if kind == "margin":
            top2 = torch.topk(probs, 2, dim=-1).values
            conf = top2[:, 0] - top2[:, 1]
        elif kind == "entropy":
            conf = (probs * torch.log(probs + 1e-10)).sum(dim=-1)
        return conf.float(), x0

    # -- sampler ------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt_ids,
        steps=128,
        gen_length=128,
        block_length=None,
        alg="maskgit_plus",
        alg_temp=None,
        eps=1e-3,
        temperature=0.0,
        top_p=None,
        top_k=None,
        threshold=None,
        mask_id=None,
        seed=0,
        draws=None,
        round_confidence_bf16=False,
    ):
        """Dream's sampler for one prompt (see the module docstring for the schedules).

        Returns {"output": prompt + canvas, "prompt_ids", "ids": the canvas, "steps":
        [{"block", "step", "positions", "tokens"} (+ "draws" where random numbers were
        used)]}, with the steps that committed nothing left out.
        """
        cfg = self.config
        mask_id = cfg.get("mask_token_id") if mask_id is None else mask_id
        if mask_id is None:
            raise ValueError("mask_id is not given and config.json has no mask_token_id")
        if alg not in ALGS:
            raise ValueError(f"alg must be one of {', '.join(ALGS)}, not {alg!r}")
        block_length = gen_length if block_length is None else block_length
        if gen_length <= 0 or block_length <= 0 or gen_length % block_length:
            raise ValueError("gen_length must be a positive multiple of block_length")
        if steps <= 0:
            raise ValueError("steps must be positive")
        block_mode = threshold is not None or block_length < gen_length
        if block_mode and alg == "origin":
            raise ValueError("alg origin is not available with the block schedule")
        if threshold is not None:
            if alg != "maskgit_plus" or alg_temp:
                raise ValueError("threshold decoding ranks probabilities: alg maskgit_plus without alg_temp")
            if not 0.0 < threshold <= 1.0:
                raise ValueError("threshold must lie in (0, 1]")
            threshold = _as_f32(threshold)
        kind = {"topk_margin": "margin", "entropy": "entropy"}.get(alg, "probability")

        dev = self.device
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        Lp = len(prompt)
        x = torch.tensor(prompt + [mask_id] * gen_length, dtype=torch.long, device=dev)
        gen = torch.Generator(device=dev)
        gen.manual_seed(int(seed))
        records = []
        counter = [0]  # every step, empty ones included (indexes `draws`)

        def uniforms(n):
            k = counter[0]
            if draws is not None:
                got = [] if k >= len(draws) or draws[k] is None else [float(u) for u in draws[k]]
                if len(got) != n:
                    raise ValueError(f"step {k}: {len(got)} stored draws, {n} needed")
                return got
            return torch.rand(n, generator=gen, dtype=torch.float32, device=dev).tolist()

        def commit(block, step, positions, tokens, used=None):
            counter[0] += 1
            pairs = sorted(zip((int(p) for p in positions), (int(t) for t in tokens)))
            if not pairs:
                return
            for p, t in pairs:
                x[p] = t
            entry = {"block": block, "step": step, "positions": [p for p, _ in pairs], "tokens": [t for _, t in pairs]}
            if used is not None:
                entry["draws"] = used
            records.append(entry)

        def ranked(conf):
            if round_confidence_bf16:
                conf = conf.to(torch.bfloat16).float()
            return _stable_desc_order(conf)

        def quota_step(block, step, masked, n):
            """Commit n of the masked positions (tensor, ascending) by alg / alg_temp."""
            if n <= 0:
                commit(block, step, [], [])  # no forward pass: the canvas would not change
                return
            logits = self.shifted_logits(x)
            conf, x0 = self._tokens(logits[masked], kind, temperature, top_p, top_k, gen)
            if not alg_temp:
                chosen = ranked(conf)[:n].tolist()
                commit(block, step, masked[chosen].tolist(), x0[chosen].tolist())
                return
            used = uniforms(n)
            c64 = [float(c) / alg_temp for c in conf.double().tolist()]
            top = max(c64)
            w = [math.exp(c - top) for c in c64]
            total = sum(w)
            chosen = pick_by_draws([v / total for v in w], used)
            commit(block, step, masked[chosen].tolist(), x0[chosen].tolist(), used)

        if not block_mode:
            ts = timesteps(steps, eps)
            for i in range(steps):
                masked = torch.nonzero(x == mask_id)[:, 0]
                last = i == steps - 1
                if alg != "origin":
                    quota_step(0, i, masked, dream_common.quota(masked.shape[0], ts[i], ts[i + 1], last))
                    continue
                p_transfer = 1.0 if last else 1.0 - ts[i + 1] / ts[i]
                used = uniforms(masked.shape[0]) if masked.shape[0] else None
                take = [j for j, u in enumerate(used or []) if u < p_transfer]
                if take:
                    logits = self.shifted_logits(x)
                    _, x0 = self._tokens(logits[masked[take]], "probability", temperature, top_p, top_k, gen)
                    commit(0, i, masked[take].tolist(), x0.tolist(), used)
                else:
                    commit(0, i, [], [], used)
        else:
            num_blocks = gen_length // block_length
            if threshold is None:
                if steps % num_blocks:
                    raise ValueError("steps must be a multiple of the number of blocks")
                spb = steps // num_blocks
                if spb < 2:
                    raise ValueError("the block schedule needs at least 2 steps per block")
                ts = timesteps(spb, eps)
            for nb in range(num_blocks):
                b0, b1 = Lp + nb * block_length, Lp + (nb + 1) * block_length
                logits = self.shifted_logits(x)
                _, x0 = self._tokens(logits[b0 : b0 + 1], "probability", temperature, top_p, top_k, gen)
                commit(nb, 0, [b0], x0.tolist())
                if threshold is None:
                    for i in range(1, spb):
                        masked = b0 + torch.nonzero(x[b0:b1] == mask_id)[:, 0]
                        n = dream_common.quota(masked.shape[0], ts[i], ts[i + 1], i == spb - 1)
                        quota_step(nb, i, masked, n)
                    continue
                i = 1
                while bool((x[b0:b1] == mask_id).any()):
                    if i > 4 * block_length:  # only when the model keeps predicting mask_id
                        raise RuntimeError("threshold decoding does not finish the block")
                    masked = b0 + torch.nonzero(x[b0:b1] == mask_id)[:, 0]
                    logits = self.shifted_logits(x)
                    conf, x0 = self._tokens(logits[masked], "probability", temperature, top_p, top_k, gen)
                    if round_confidence_bf16:
                        conf = conf.to(torch.bfloat16).float()
                    take = max(int((conf >= threshold).sum()), 1)
                    chosen = ranked(conf)[:take].tolist()
                    commit(nb, i, masked[chosen].tolist(), x0[chosen].tolist())
                    i += 1
        out = x.tolist()
        return {"output": out, "prompt_ids": prompt, "ids": out[Lp:], "steps": records}


def load(directory, device="cpu", dtype="f32"):
    """Load a Hugging Face-layout Dream checkpoint onto `device` in `dtype` ("bf16"/"f32")."""
    device, torch_dtype = torch_common.prepare_device(device, dtype)
    cfg = dream_common.load_config(directory)
    weights = torch_common.load_weights(directory, dream_common.expected_shapes(cfg), device, torch_dtype)
    return Dream(cfg, weights, device, torch_dtype, directory)


# ---------------------------------------------------------------------------
# self-test against the numpy goldens
# ---------------------------------------------------------------------------

# the goldens' sampler parameters that generate() takes under the same name
_GOLDEN_PARAMS = (
    "gen_length", "steps", "block_length", "alg", "alg_temp", "eps", "temperature",
    "top_p", "top_k", "threshold", "mask_id", "seed",
)


def self_test(directory, device, rel_bound=1e-4):
    """Logits and generations of `directory`'s goldens in float32; returns 0 when all agree."""
    start = time.time()
    model = load(directory, device, "f32")
    with open(os.path.join(directory, "goldens", "logits.json"), encoding="utf-8") as f:
        logit_cases = json.load(f)["cases"]
    with open(os.path.join(directory, "goldens", "generate.json"), encoding="utf-8") as f:
        gen_cases = json.load(f)["cases"]
    failures = 0
    worst = 0.0
    for case in logit_cases:
        if "attention_mask" in case:
            am = case["attention_mask"]
            full = model.forward(case["padded_ids"], am)
            got = full[torch.tensor(am, dtype=torch.bool, device=full.device)]
        else:
            got = model.forward(case["ids"])
        want = torch.tensor(case["logits_f32"], dtype=torch.float64)
        got = got.double().cpu()
        scale = float(want.abs().max())
        err = float((got - want).abs().max())
        rel = err / scale
        worst = max(worst, rel)
        argmax_ok = bool((got.argmax(-1) == want.argmax(-1)).all())
        ok = rel <= rel_bound and argmax_ok
        failures += not ok
        print(
            f"logits {case['name']:<14} {tuple(got.shape)}: max abs error {err:.3e}, scale {scale:.4g}, "
            f"relative {rel:.3e}, argmax {'equal' if argmax_ok else 'DIFFERS'} -> {'ok' if ok else 'FAIL'}"
        )
    for case in gen_cases:
        params = {k: case["params"][k] for k in _GOLDEN_PARAMS if k in case["params"]}
        steps = case["steps"]
        random = params.get("alg") == "origin" or bool(params.get("alg_temp"))
        draws = [s.get("draws") for s in steps] if random else None
        got = model.generate(case["prompt"], draws=draws, **params)
        want_steps = [(s["committed"], s["tokens"]) for s in steps if s["committed"]]
        got_steps = [(s["positions"], s["tokens"]) for s in got["steps"]]
        ids_ok = got["output"] == case["output"]
        steps_ok = got_steps == want_steps
        ok = ids_ok and steps_ok
        failures += not ok
        Lp = len(case["prompt"])
        agree = sum(a == b for a, b in zip(got["output"][Lp:], case["output"][Lp:]))
        how = "replaying the stored draws, " if random else ""
        print(
            f"generate {case['name']:<20} {how}tokens {agree}/{len(case['output']) - Lp}, "
            f"steps {len(got_steps)}/{len(want_steps)} {'equal' if steps_ok else 'DIFFER'} -> {'ok' if ok else 'FAIL'}"
        )
    total = len(logit_cases) + len(gen_cases)
    print(
        f"self-test {'OK' if not failures else 'FAILED'}: {total - failures}/{total} cases on {model.device} "
        f"(worst logit error {worst:.3e} of the scale, bound {rel_bound:g}) in {time.time() - start:.1f} s"
    )
    return 0 if not failures else 1


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p, needs_ids=True):
        p.add_argument("--model", required=needs_ids, help="checkpoint folder (config.json, *.safetensors)")
        if needs_ids:
            p.add_argument("--ids", required=True, type=llada_common.parse_ids, help="token ids, e.g. 1,2,3")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")

    lg = sub.add_parser("logits", help="write float32 unshifted logits [T, vocab_size] to a .npy file")
    common(lg)
    lg.add_argument("--dtype", choices=sorted(torch_common.DTYPES), default="f32", help="weights and compute (default f32)")
    lg.add_argument("--out", required=True, help="output .npy path")

    gn = sub.add_parser("generate", help="run Dream's sampler")
    common(gn)
    gn.add_argument("--dtype", choices=sorted(torch_common.DTYPES), default="f32", help="weights and compute (default f32)")
    gn.add_argument("--gen-length", type=int, default=64)
    gn.add_argument("--steps", type=int, default=None, help="default: gen-length")
    gn.add_argument("--block-length", type=int, default=None, help="default: gen-length (Dream's own schedule)")
    gn.add_argument("--alg", "--remasking", dest="alg", choices=ALGS, default="maskgit_plus")
    gn.add_argument("--alg-temp", type=float, default=None)
    gn.add_argument("--eps", type=float, default=1e-3)
    gn.add_argument("--temperature", type=float, default=0.0)
    gn.add_argument("--top-p", type=float, default=None)
    gn.add_argument("--top-k", type=int, default=None)
    gn.add_argument("--threshold", type=float, default=None, help="Fast-dLLM confidence threshold")
    gn.add_argument("--seed", type=int, default=0)
    gn.add_argument("--mask-id", type=int, default=None)
    gn.add_argument("--bf16-confidence", action="store_true", help="round confidences to bf16 before ranking")
    gn.add_argument("--json", action="store_true", help="print one JSON object instead of the ids")

    st = sub.add_parser("self-test", help="float32 agreement with the checkpoint's numpy goldens")
    common(st, needs_ids=False)
    st.set_defaults(model=os.path.join(ROOT, "tests", "fixtures", "tiny-dream"))
    args = ap.parse_args(argv)

    device = args.device or torch_common.default_device()
    if args.command == "self-test":
        return self_test(args.model, device)
    model = load(args.model, device, args.dtype)
    if args.command == "logits":
        torch_common.write_npy(args.out, model.forward(args.ids))
        print(f"wrote {args.out}: float32 logits [{len(args.ids)}, {model.config['vocab_size']}]", file=sys.stderr)
        return 0
    same_name = (
        "gen_length", "block_length", "alg", "alg_temp", "eps", "temperature", "top_p", "top_k",
        "threshold", "mask_id", "seed",
    )
    result = model.generate(
        args.ids,
        steps=args.steps if args.steps is not None else args.gen_length,
        round_confidence_bf16=args.bf16_confidence,
        **{key: getattr(args, key) for key in same_name},
    )
    torch_common.print_generation(result, model, args.dtype, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
