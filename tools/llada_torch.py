"""PyTorch reference of the LLaDA forward pass and of its reference sampler.

Implements the model of `shared/reference/llada.md` section 2.2 and the `generate`
procedure of section 3.1 (plus Fast-dLLM's confidence-threshold decoding, which the
runtime also offers), for one sequence at a time (batch size 1, no attention mask).
It is the reference `tools/parity.py --against torch` compares the runtime with.  The
checkpoint loading and .npy output it shares with tools/dream_torch.py are in
tools/torch_common.py.

Numerics
--------
* `dtype="bf16"`: weights are held in bfloat16 and every operation runs on bfloat16
  tensors the way the official PyTorch code runs (`torch_dtype=torch.bfloat16`):
  matrix products return bf16, RMSNorm normalises in float32 and rounds twice, RoPE is
  applied in float32 and rounded once, the SiLU output and the gate x up product are
  rounded, and the logits are bf16 (returned widened to float32).  On CUDA the
  memory-efficient attention kernel is switched off, as the official model does, so the
  attention runs on the flash (or math) kernel.
* `dtype="f32"`: the same code with float32 tensors everywhere; bf16 checkpoints are
  widened exactly.  TF32 is switched off so CUDA matrix products are true float32.
* The RoPE tables are built on the CPU in float32 (`max_sequence_length` rows, as the
  reference does at construction) and moved to the device.

Sampler conventions (the runtime's rules, so that temperature-0 runs agree token for token)
------------------------------------------------------------------------------------------
* The confidence of `low_confidence` remasking is the softmax probability (float32
  softmax, no temperature) of the chosen token.  With `round_confidence_bf16` (the
  default) it is rounded to bf16 before ranking, which is what both the bf16 reference
  (its softmax returns bf16) and the runtime's sampler do.
* Ranking is a stable sort by descending confidence: ties go to the lowest position;
  NaN ranks as -inf and -0.0 ties with 0.0.
* Steps whose quota is 0 (more steps than masks) are skipped without a forward pass:
  the reference's `topk(k=0)` commits nothing there, so the result is the same.
* A committed prediction equal to `mask_id` leaves the position masked; it is predicted
  again at the next step, as in the reference.
* `temperature > 0` and `random` remasking use a `torch.Generator` seeded with `seed`:
  the same distributions as the reference, not the runtime's random numbers.

Command line (from the repository root; needs PyTorch):

    python tools/llada_torch.py logits --model DIR --ids 1,2,3 --out f.npy [--device cpu] [--dtype f32]
    python tools/llada_torch.py generate --model DIR --ids 1,2,3 --gen-length 32 --steps 32 \\
        --block-length 16 [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llada_common  # noqa: E402
import torch_common  # noqa: E402

# ---------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------


def special_id(directory, content):
    """Id of a special token in the checkpoint's tokenizer.json, or None."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        tok = json.load(f)
    for added in tok.get("added_tokens", []):
        if added.get("content") == content:
            return int(added["id"])
    return None


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


class _Block:
    """Weights of one transformer block."""

    def __init__(self, w, i):
        p = f"model.transformer.blocks.{i}."
        self.attn_norm = w[p + "attn_norm.weight"]
        self.q = w[p + "q_proj.weight"]
        self.k = w[p + "k_proj.weight"]
        self.v = w[p + "v_proj.weight"]
        self.o = w[p + "attn_out.weight"]
        self.ff_norm = w[p + "ff_norm.weight"]
        self.gate = w[p + "ff_proj.weight"]
        self.up = w[p + "up_proj.weight"]
        self.down = w[p + "ff_out.weight"]


class LLaDA:
    """A loaded checkpoint: `forward(ids)` and `generate(prompt_ids, ...)`."""

    def __init__(self, cfg, weights, device, dtype, directory=None):
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.directory = directory
        self.wte = weights["model.transformer.wte.weight"]
        self.ln_f = weights["model.transformer.ln_f.weight"]
        self.head = self.wte if cfg["weight_tying"] else weights["model.transformer.ff_out.weight"]
        self.blocks = [_Block(weights, i) for i in range(cfg["n_layers"])]
        self._cos, self._sin = self._rope_tables(cfg["max_sequence_length"], torch.device("cpu"))
        self._cos, self._sin = self._cos.to(self.device), self._sin.to(self.device)

    # -- pieces of the forward pass -------------------------------------------------

    def _rope_tables(self, n, device):
        """cos/sin [n, head_dim] in float32 for half-split ("rotate_half") RoPE."""
        hd = self.config["head_dim"]
        exponent = torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd
        inv_freq = 1.0 / (self.config["rope_theta"] ** exponent)
        seq = torch.arange(n, dtype=torch.float32, device=device)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    def _rmsnorm(self, x, w):
        # normalise in float32, round to the activation dtype, then scale (rounds again)
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        n = (xf * torch.rsqrt(var + self.config["rms_norm_eps"])).to(x.dtype)
        return w * n

    @staticmethod
    def _rope(t, cos, sin):
        """t [heads, T, hd]: float32 math (rope_full_precision), one rounding at the end."""
        tf = t.float()
        half = tf.shape[-1] // 2
        rotated = torch.cat((-tf[..., half:], tf[..., :half]), dim=-1)
        return (tf * cos + rotated * sin).to(t.dtype)

    @torch.no_grad()
    def forward(self, ids):
        """float32 logits [T, embedding_size] of one sequence of token ids."""
        cfg = self.config
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        T = ids.shape[0]
        if T == 0:
            raise ValueError("forward needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg["embedding_size"]:
            raise ValueError(f"token ids must lie in 0..{cfg['embedding_size'] - 1}")
        H, Hkv, hd, D = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], cfg["d_model"]
        if T > self._cos.shape[0]:
            # the reference rebuilds the tables on the device past max_sequence_length
            self._cos, self._sin = self._rope_tables(T, self.device)
        cos, sin = self._cos[:T], self._sin[:T]

        x = self.wte[ids]  # exact rows; no scaling, no position embedding
        for b in self.blocks:
            h = self._rmsnorm(x, b.attn_norm)
            q = F.linear(h, b.q).view(T, H, hd).transpose(0, 1)
            k = F.linear(h, b.k).view(T, Hkv, hd).transpose(0, 1)
            v = F.linear(h, b.v).view(T, Hkv, hd).transpose(0, 1)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            if Hkv < H:  # GQA: query head h reads kv head h // (H / Hkv)
                k = k.repeat_interleave(H // Hkv, dim=0)
                v = v.repeat_interleave(H // Hkv, dim=0)
            # bidirectional: no causal mask; scale 1/sqrt(head_dim)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=False)[0]
            a = a.transpose(0, 1).reshape(T, D)
            x = x + F.linear(a, b.o)
            h = self._rmsnorm(x, b.ff_norm)
            m = F.silu(F.linear(h, b.gate)) * F.linear(h, b.up)
            x = x + F.linear(m, b.down)
        x = self._rmsnorm(x, self.ln_f)
        return F.linear(x, self.head).float()

    def _logits(self, ids):
        """Logits in the compute dtype (bf16 stays bf16 for the sampler's arithmetic)."""
        return self.forward(ids).to(self.dtype)

    # -- sampler ----------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt_ids,
        steps=128,
        gen_length=128,
        block_length=None,
        temperature=0.0,
        cfg_scale=0.0,
        remasking="low_confidence",
        mask_id=None,
        logits_eos_inf=False,
        confidence_eos_eot_inf=False,
        eos_id=None,
        eot_id=None,
        threshold=None,
        seed=0,
        round_confidence_bf16=True,
    ):
        """The reference sampler (llada.md 3.1) for one prompt.

        `block_length` defaults to `gen_length` (pure diffusion).  `mask_id` and `eos_id`
        default to the config's `mask_token_id` / `eos_token_id`, `eot_id` to the
        tokenizer's `<|eot_id|>`.  With `threshold`, every masked position of the current
        block whose confidence is >= threshold is committed (at least the most confident
        one) and a block ends when it has no masks left; `steps` is then unused.

        Returns {"output": prompt + canvas, "prompt_ids", "ids": the canvas,
        "steps": [{"block", "step", "positions", "tokens"}]} with plain Python ints.
        """
        cfg = self.config
        mask_id = cfg.get("mask_token_id") if mask_id is None else mask_id
        eos_id = cfg.get("eos_token_id") if eos_id is None else eos_id
        if mask_id is None:
            raise ValueError("mask_id is not given and config.json has no mask_token_id")
        if eot_id is None and self.directory is not None:
            eot_id = special_id(self.directory, "<|eot_id|>")
        if logits_eos_inf and eos_id is None:
            raise ValueError("logits_eos_inf needs eos_id")
        if confidence_eos_eot_inf and (eos_id is None or eot_id is None):
            raise ValueError("confidence_eos_eot_inf needs eos_id and eot_id")
        if remasking not in ("low_confidence", "random"):
            raise ValueError(f"remasking must be low_confidence or random, not {remasking!r}")
        block_length = gen_length if block_length is None else block_length
        if gen_length <= 0 or block_length <= 0 or gen_length % block_length:
            raise ValueError("gen_length must be a positive multiple of block_length")
        num_blocks = gen_length // block_length
        if threshold is None:
            if steps < num_blocks or steps % num_blocks:
                raise ValueError("steps must be a positive multiple of the number of blocks")
            steps_per_block = steps // num_blocks
        else:
            if not 0.0 < threshold <= 1.0:
                raise ValueError("threshold must lie in (0, 1]")
            # the runtime holds the threshold as float32
            threshold = struct.unpack("<f", struct.pack("<f", threshold))[0]

        dev = self.device
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        Lp = len(prompt)
        T = Lp + gen_length
        x = torch.full((T,), mask_id, dtype=torch.long, device=dev)
        x[:Lp] = torch.tensor(prompt, dtype=torch.long, device=dev)
        prompt_index = x != mask_id  # fixed for the whole run (CFG masks exactly these)
        gen = torch.Generator(device=dev)
        gen.manual_seed(int(seed))
        neg_inf = torch.tensor(-math.inf, device=dev)
        records = []

        def model_logits():
            if cfg_scale > 0:
                un = x.clone()
                un[prompt_index] = mask_id
                c, u = self._logits(x), self._logits(un)
                return u + (cfg_scale + 1) * (c - u)  # in the compute dtype, as the reference
            return self._logits(x)

        def step(nb, i, quota):
            block_end = Lp + (nb + 1) * block_length
            mask_index = x == mask_id
            logits = model_logits()
            if logits_eos_inf:
                logits[:, eos_id] = -math.inf
            if temperature > 0:
                l64 = logits.double()
                noise = torch.rand(l64.shape, generator=gen, dtype=torch.float64, device=dev)
                x0 = (l64.exp() / (-torch.log(noise)) ** temperature).argmax(-1)
            else:
                x0 = logits.argmax(-1)  # first maximal index
            if confidence_eos_eot_inf:
                # the reference's chained assignment: at temperature 0 its noisy logits are
                # the logits themselves, so both EOS and EoT leave the confidence softmax;
                # above 0 only EoT does
                if temperature == 0:
                    logits[:, eos_id] = -math.inf
                logits[:, eot_id] = -math.inf
            if remasking == "low_confidence":
                p = torch.softmax(logits.float(), dim=-1)
                x0_p = p.gather(-1, x0[:, None])[:, 0]
                if round_confidence_bf16:
                    x0_p = x0_p.to(torch.bfloat16).float()
            else:
                x0_p = torch.rand((T,), generator=gen, dtype=torch.float32, device=dev)
            x0_p = torch.where(torch.isnan(x0_p), neg_inf, x0_p) + 0.0  # NaN loses; -0.0 == 0.0
            x0_p[block_end:] = -math.inf  # nothing after the current block
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, neg_inf)
            candidates = int(torch.isfinite(confidence).sum())
            # stable descending sort: equal confidences keep position order, so the
            # lowest position wins a tie
            order = torch.sort(confidence, descending=True, stable=True).indices
            if quota is None:
                take = max(int((confidence >= threshold).sum()), 1)
            else:
                take = quota
            take = min(take, candidates)
            chosen = torch.sort(order[:take]).values
            x[chosen] = x0[chosen]
            records.append(
                {
                    "block": nb,
                    "step": i,
                    "positions": chosen.tolist(),
                    "tokens": x[chosen].tolist(),
                }
            )

        for nb in range(num_blocks):
            b0, b1 = Lp + nb * block_length, Lp + (nb + 1) * block_length
            if threshold is None:
                n = int((x[b0:b1] == mask_id).sum())
                base, rem = divmod(n, steps_per_block)
                for i in range(steps_per_block):
                    quota = base + (1 if i < rem else 0)
                    if quota:
                        step(nb, i, quota)
            else:
                i = 0
                while bool((x[b0:b1] == mask_id).any()):
                    if i > 4 * T:  # only when the model keeps predicting mask_id
                        raise RuntimeError("threshold decoding does not finish the block")
                    step(nb, i, None)
                    i += 1
        out = x.tolist()
        return {"output": out, "prompt_ids": prompt, "ids": out[Lp:], "steps": records}


def load(directory, device="cpu", dtype="f32"):
    """Load a Hugging Face-layout LLaDA checkpoint onto `device` in `dtype` ("bf16"/"f32")."""
    device, torch_dtype = torch_common.prepare_device(device, dtype)
    if device.type == "cuda" and dtype == "bf16":
        # as the official LLaDAModel.__init__ does
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    cfg = llada_common.load_config(directory)
    weights = torch_common.load_weights(directory, llada_common.expected_shapes(cfg), device, torch_dtype)
    return LLaDA(cfg, weights, device, torch_dtype, directory)


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--model", required=True, help="checkpoint folder (config.json, *.safetensors)")
        p.add_argument("--ids", required=True, type=llada_common.parse_ids, help="token ids, e.g. 1,2,3")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        p.add_argument("--dtype", choices=sorted(torch_common.DTYPES), default="f32", help="weights and compute (default f32)")

    lg = sub.add_parser("logits", help="write float32 logits [T, embedding_size] to a .npy file")
    common(lg)
    lg.add_argument("--out", required=True, help="output .npy path")

    gn = sub.add_parser("generate", help="run the reference sampler")
    common(gn)
    gn.add_argument("--gen-length", type=int, default=64)
    gn.add_argument("--steps", type=int, default=None, help="default: gen-length")
    gn.add_argument("--block-length", type=int, default=None, help="default: gen-length")
    gn.add_argument("--temperature", type=float, default=0.0)
    gn.add_argument("--cfg-scale", type=float, default=0.0)
    gn.add_argument("--remasking", choices=["low_confidence", "random"], default="low_confidence")
    gn.add_argument("--threshold", type=float, default=None, help="Fast-dLLM confidence threshold")
    gn.add_argument("--seed", type=int, default=0)
    gn.add_argument("--mask-id", type=int, default=None)
    gn.add_argument("--eos-id", type=int, default=None)
    gn.add_argument("--eot-id", type=int, default=None)
    gn.add_argument("--logits-eos-inf", action="store_true")
    gn.add_argument("--confidence-eos-eot-inf", action="store_true")
    gn.add_argument(
        "--exact-confidence",
        action="store_true",
        help="rank unrounded float32 confidences (default: rounded to bf16, as the runtime does)",
    )
    gn.add_argument("--json", action="store_true", help="print one JSON object instead of the ids")
    args = ap.parse_args(argv)

    device = args.device or torch_common.default_device()
    model = load(args.model, device, args.dtype)
    if args.command == "logits":
        torch_common.write_npy(args.out, model.forward(args.ids))
        shape = f"[{len(args.ids)}, {model.config['embedding_size']}]"
        print(f"wrote {args.out}: float32 logits {shape}", file=sys.stderr)
        return 0
    steps = args.steps if args.steps is not None else args.gen_length
    # the sampler options whose flag has the parameter's name, passed through as given
    same_name = (
        "gen_length", "block_length", "temperature", "cfg_scale", "remasking", "mask_id",
        "logits_eos_inf", "confidence_eos_eot_inf", "eos_id", "eot_id", "threshold", "seed"
    )
    result = model.generate(
        args.ids,
        steps=steps,
        round_confidence_bf16=not args.exact_confidence,
        **{key: getattr(args, key) for key in same_name},
    )
    torch_common.print_generation(result, model, args.dtype, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
