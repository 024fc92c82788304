"""Independent numpy reference of DiffusionGemma (encoder, decoder and commit passes, and
the entropy-bound sampler with replayed random draws).

The model is specified in docs/models/diffusion-gemma.md; this file follows it op by op
and is what CI runs against tests/fixtures/tiny-dgemma (made with the transformers
reference by tools/make_dgemma_fixture.py).  numpy and the standard library only.

Numerics: weights are read as float32 (bf16 widened exactly) and every operation is
evaluated in float64.  Where the reference builds a value in float32 that a decision
depends on, this does too: the embedding scale sqrt(D), the RoPE frequencies and angles,
and the sampler temperature.

    python3 tools/dgemma_ref.py --check [--model tests/fixtures/tiny-dgemma]

--check recomputes every golden: logits must agree within 1e-5 of the largest magnitude
of each golden tensor, and every generation, replaying the recorded draws (initial canvas,
the denoiser's tokens, the renoise canvas), must reproduce every step (input canvas,
accepted positions, argmax, stability, stop) and the final sequence exactly.  Exit status
1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dgemma_common  # noqa: E402
import llada_common  # noqa: E402
import llada_ref  # noqa: E402
from dgemma_common import DEC, ENC_SCALAR, SLIDING  # noqa: E402

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                             "tiny-dgemma")
LOGITS_TOLERANCE = 1e-5  # relative to the largest |logit| of a golden tensor
ENTROPY_TOLERANCE = 1e-4  # nats, the recorded mean entropies (decisions are compared exactly)

# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


def rmsnorm(x, w, eps):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def inv_freq(layer):
    """RoPE inverse frequencies [d/2] of a layer, in float32 as the reference builds them:
    `default` rotates every pair; `proportional` rotates the first int(f·d//2) pairs with
    exponents over the whole head dim and leaves the others (frequency 0)."""
    d, base = layer["head_dim"], np.float32(layer["rope_theta"])
    n = d // 2 if layer["rope_type"] == "default" else int(layer["partial_rotary_factor"] * d // 2)
    exps = np.arange(0, 2 * n, 2, dtype=np.float32) / np.float32(d)
    f = (np.float32(1.0) / np.power(base, exps, dtype=np.float32)).astype(np.float32)
    return np.concatenate([f, np.zeros(d // 2 - n, np.float32)])


def rope(x, pos, freqs):
    """Half-split RoPE of x [T, heads, d] at absolute positions pos [T]."""
    ang = (np.asarray(pos, np.float32)[:, None] * freqs[None, :]).astype(np.float64)  # float32 angles
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Cache:
    """Per layer: K (rotated, normed), V (normed) and the absolute position of each row.
    Sliding layers keep only the last W-1 rows after a pass, as the reference's cache."""

    def __init__(self, n_layers):
        self.k = [None] * n_layers
        self.v = [None] * n_layers
        self.pos = [np.zeros(0, np.int64)] * n_layers
        self.length = 0  # positions encoded so far


class Model:
    def __init__(self, directory):
        self.cfg = dgemma_common.load_config(directory)
        self.gen = dgemma_common.load_generation_config(directory)
        tensors, _ = llada_ref.read_checkpoint_tensors(directory)
        shapes = dgemma_common.expected_shapes(self.cfg)
        llada_common.check_shapes(shapes, tensors)
        extra = [n for n in tensors if n not in shapes and not dgemma_common.is_vision_tensor(n)]
        if extra:
            raise ValueError(f"unexpected tensors: {sorted(extra)}")
        self.W = {n: tensors[n].astype(np.float64) for n in shapes}
        self.E = self.W[DEC + "embed_tokens.weight"]
        self.head = self.W.get("lm_head.weight", self.E)
        self.scale = float(np.float32(math.sqrt(self.cfg["hidden_size"])))
        self.freqs = [inv_freq(ly) for ly in self.cfg["layers"]]

    def _w(self, i, name):
        return self.W[f"{DEC}layers.{i}.{name}"]

    def attention(self, i, h, pos, cache, mode):
        """Self-attention of layer i for rows h [T, D] at positions pos.  mode "encode"
        appends the rows to the cache (causal / sliding mask); "decode" reads the cache and
        attends over every cached and every new row."""
        cfg, ly = self.cfg, self.cfg["layers"][i]
        H, d, K, eps = cfg["num_heads"], ly["head_dim"], ly["kv_heads"], cfg["rms_norm_eps"]
        T = h.shape[0]
        q = rope(rmsnorm((h @ self._w(i, "self_attn.q_proj.weight").T).reshape(T, H, d),
                         self._w(i, "self_attn.q_norm.weight"), eps), pos, self.freqs[i])
        kr = (h @ self._w(i, "self_attn.k_proj.weight").T).reshape(T, K, d)
        vr = (h @ self._w(i, "self_attn.v_proj.weight").T).reshape(T, K, d) if ly["type"] == SLIDING else kr
        k = rope(rmsnorm(kr, self._w(i, "self_attn.k_norm.weight"), eps), pos, self.freqs[i])
        v = rmsnorm(vr, None, eps)
        keys, vals, kpos = k, v, np.asarray(pos)
        if cache.k[i] is not None:
            keys = np.concatenate([cache.k[i], k])
            vals = np.concatenate([cache.v[i], v])
            kpos = np.concatenate([cache.pos[i], kpos])
        if mode == "encode":
            qp, kp = np.asarray(pos)[:, None], kpos[None, :]
            allowed = kp <= qp
            if ly["type"] == SLIDING:
                allowed &= kp > qp - cfg["sliding_window"]
            keep = cfg["sliding_window"] - 1 if ly["type"] == SLIDING else len(kpos)
            cache.k[i], cache.v[i], cache.pos[i] = keys[-keep:], vals[-keep:], kpos[-keep:]
        else:
            allowed = np.ones((T, len(kpos)), bool)
        kv_of = np.arange(H) * K // H  # query head -> its key/value head
        scores = np.einsum("thd,jhd->htj", q, keys[:, kv_of])  # scaling 1.0
        scores = np.where(allowed[None], scores, -np.inf)
        p = softmax(scores)
        o = np.einsum("htj,jhd->thd", p, vals[:, kv_of]).reshape(T, H * d)
        return o @ self._w(i, "self_attn.o_proj.weight").T

    def moe(self, i, x):
        """Router on the residual x, experts on its pre_feedforward_layernorm_2 norm."""
        cfg, eps = self.cfg, self.cfg["rms_norm_eps"]
        n = rmsnorm(x, None, eps) * self._w(i, "router.scale") * cfg["hidden_size"] ** -0.5
        p = softmax(n @ self._w(i, "router.proj.weight").T)
        # top-k by probability, ties to the lower expert index
        top = np.argsort(-p, axis=-1, kind="stable")[:, : cfg["top_k"]]
        w = np.take_along_axis(p, top, -1)
        w = w / w.sum(-1, keepdims=True) * self._w(i, "router.per_expert_scale")[top]
        y = rmsnorm(x, self._w(i, "pre_feedforward_layernorm_2.weight"), eps)
        gu, dn, Fe = self._w(i, "experts.gate_up_proj"), self._w(i, "experts.down_proj"), cfg["expert_size"]
        out = np.zeros_like(x)
        for e in range(cfg["num_experts"]):
            rows, slot = np.nonzero(top == e)
            if len(rows):
                a = y[rows] @ gu[e].T
                out[rows] += w[rows, slot][:, None] * ((gelu_tanh(a[:, :Fe]) * a[:, Fe:]) @ dn[e].T)
        return out

    def layer(self, i, x, pos, cache, mode):
        eps, w = self.cfg["rms_norm_eps"], lambda n: self._w(i, n + ".weight")
        a = self.attention(i, rmsnorm(x, w("input_layernorm"), eps), pos, cache, mode)
        x = x + rmsnorm(a, w("post_attention_layernorm"), eps)
        y = rmsnorm(x, w("pre_feedforward_layernorm"), eps)
        h1 = (gelu_tanh(y @ w("mlp.gate_proj").T) * (y @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
        h1 = rmsnorm(h1, w("post_feedforward_layernorm_1"), eps)
        h2 = rmsnorm(self.moe(i, x), w("post_feedforward_layernorm_2"), eps)
        x = x + rmsnorm(h1 + h2, w("post_feedforward_layernorm"), eps)
        scalar = self.W[ENC_SCALAR.format(i)] if mode == "encode" else self._w(i, "layer_scalar")
        return x * scalar[0]

    def logits(self, x):
        h = rmsnorm(x, self.W[DEC + "norm.weight"], self.cfg["rms_norm_eps"])
        c = self.cfg["softcap"]
        return c * np.tanh((h @ self.head.T) / c)

    def encode(self, ids, cache):
        """Encoder (prefill) or commit pass: appends the ids at the next positions to the
        cache; returns the soft-capped logits of the final normed hidden states."""
        pos = np.arange(cache.length, cache.length + len(ids))
        x = self.E[np.asarray(ids)] * self.scale
        for i in range(self.cfg["num_layers"]):
            x = self.layer(i, x, pos, cache, "encode")
        cache.length += len(ids)
        return self.logits(x)

    def decode(self, canvas, cache, sc_logits=None):
        """Decoder pass over the canvas at the positions after the cache (read only), with
        the previous step's temperature-scaled logits as self-conditioning (or none)."""
        eps = self.cfg["rms_norm_eps"]
        pos = np.arange(cache.length, cache.length + len(canvas))
        e = self.E[np.asarray(canvas)] * self.scale
        sc = DEC + "self_conditioning."
        if sc_logits is None:
            signal = np.zeros_like(e)
        else:
            soft = softmax(np.asarray(sc_logits, np.float64)) @ self.E * self.scale
            u = rmsnorm(soft, self.W[sc + "pre_norm.weight"], eps)
            gate, up = u @ self.W[sc + "gate_proj.weight"].T, u @ self.W[sc + "up_proj.weight"].T
            signal = (gelu_tanh(gate) * up) @ self.W[sc + "down_proj.weight"].T
        x = rmsnorm(e + signal, None, eps)
        for i in range(self.cfg["num_layers"]):
            x = self.layer(i, x, pos, cache, "decode")
        return self.logits(x)

    def new_cache(self):
        return Cache(self.cfg["num_layers"])


# ---------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------


def temperature(t, n, t_min, t_max):
    """t_min + (t_max - t_min) * (t / n) in float32, t the steps left (n .. 1)."""
    frac = np.float32(t) / np.float32(n)
    return float(np.float32(t_min) + np.float32(np.float32(t_max - t_min) * frac))


def entropies(z):
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(-1)


def accepted_positions(ent, bound):
    """Ascending entropy; a position is accepted if the entropies ranked before it sum to at
    most `bound` (always the lowest one).  Returns the accepted positions, ascending."""
    order = np.argsort(ent, kind="stable")
    srt = ent[order]
    ok = (np.cumsum(srt) - srt) <= bound
    return sorted(int(p) for p in order[ok])


def generate(model, prompt, p, draws):
    """The reference's `generate` for one prompt with its random draws replayed.

    p: the sampler settings (keys of generation_config); draws: per canvas
    {"init": [L], "steps": [{"sampled": [L], "renoise": [L]}, ...]}.  Returns the sequence
    and, per canvas, the steps as the goldens record them."""
    L, V = model.cfg["canvas_length"], model.cfg["vocab_size"]
    N, S = p["max_denoising_steps"], p["stability_threshold"]
    eos, pad = set(p["eos_token_id"] or []), p["pad_token_id"]
    cache = model.new_cache()
    model.encode(prompt, cache)
    seq, canvases = list(prompt), []
    for c in range(math.ceil(p["max_new_tokens"] / L)):
        if c > 0:
            model.encode(canvases[-1]["output"], cache)  # commit the previous canvas
        if c >= len(draws):
            raise IndexError("the recorded draws end before the generation does")
        x, zsc, hist, steps = list(draws[c]["init"]), None, [None] * S, []
        for k, t in enumerate(range(N, 0, -1)):
            if k >= len(draws[c]["steps"]):
                raise IndexError(f"canvas {c}: the recorded draws end after {k} steps")
            d = draws[c]["steps"][k]
            if len(x) != L or not all(0 <= tok < V for tok in x):
                raise ValueError(f"canvas {c} step {k}: the canvas is not {L} token ids below {V}")
            temp = temperature(t, N, p["t_min"], p["t_max"])
            z = model.decode(x, cache, zsc) / temp
            a = [int(i) for i in np.argmax(z, axis=-1)]
            ent = entropies(z)
            acc = accepted_positions(ent, p["entropy_bound"])
            nxt = list(d["renoise"])
            for i in acc:
                nxt[i] = d["sampled"][i]
            stable = all(h == a for h in hist)
            hist = hist[1:] + [a] if S > 0 else hist
            stop = bool(stable and float(ent.mean()) < p["confidence_threshold"])
            steps.append({"t": t, "temperature": temp, "input": x, "accepted": acc, "argmax": a,
                          "mean_entropy": float(ent.mean()), "stable": stable, "stop": stop})
            zsc, x = z, nxt
            if stop:
                break
        out = steps[-1]["argmax"]
        canvases.append({"steps": steps, "output": out})
        seq += out
        if any(tok in eos for tok in out):
            if pad is not None:
                first = next(j for j, tok in enumerate(out) if tok in eos)
                seq[len(seq) - L + first + 1:] = [pad] * (L - first - 1)
            break
    return seq, canvases


# ---------------------------------------------------------------------------
# checks against the goldens
# ---------------------------------------------------------------------------


def check_logits(model, directory):
    with open(os.path.join(directory, "goldens", "logits.json"), encoding="utf-8") as f:
        meta = json.load(f)
    golden, _ = llada_ref.read_safetensors(os.path.join(directory, "goldens", "logits.safetensors"))
    failures, worst = [], 0.0
    for case in meta["cases"]:
        cache = model.new_cache()
        if case["pass"] == "encoder":
            got = model.encode(case["prompt"], cache)
        else:
            model.encode(case["prompt"], cache)
            if case["pass"] == "commit":
                got = model.encode(case["canvas"], cache)
            else:
                for c in case["commits"]:
                    model.encode(c, cache)
                sc = case["self_conditioning"]
                got = model.decode(case["canvas"], cache, None if sc is None else golden[sc])
            if cache.length != case["start"] + (len(case["canvas"]) if case["pass"] == "commit" else 0):
                failures.append(f"{case['name']}: positions start at {cache.length}, golden says {case['start']}")
        want = golden[case["name"]].astype(np.float64)
        err = float(np.abs(got - want).max() / np.abs(want).max())
        worst = max(worst, err)
        print(f"  {case['name']}: max |diff| / max |logit| = {err:.2e}")
        if err > LOGITS_TOLERANCE:
            failures.append(f"{case['name']}: logits differ by {err:.2e} of the largest")
    return failures, worst


def check_generate(model, directory):
    with open(os.path.join(directory, "goldens", "generate.json"), encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    failures = []
    # generation_config.json holds the settings of the "defaults" case (but max_new_tokens)
    for case in cases:
        if case["name"] == "defaults":
            mismatch = [k for k, v in case["params"].items() if k != "max_new_tokens" and model.gen[k] != v]
            if mismatch:
                failures.append(f"generation_config.json differs from the defaults case in {mismatch}")
    for case in cases:
        name = case["name"]
        try:
            seq, canvases = generate(model, case["prompt"], case["params"], case["canvases"])
        except IndexError as e:
            failures.append(f"{name}: {e}")
            continue
        bad = []
        if len(canvases) != len(case["canvases"]):
            bad.append(f"{len(canvases)} canvases, golden {len(case['canvases'])}")
        for ci, (mine, gold) in enumerate(zip(canvases, case["canvases"])):
            if len(mine["steps"]) != len(gold["steps"]):
                bad.append(f"canvas {ci}: {len(mine['steps'])} steps, golden {len(gold['steps'])}")
            for si, (m, g) in enumerate(zip(mine["steps"], gold["steps"])):
                for key in ("t", "input", "accepted", "argmax", "stable", "stop"):
                    if m[key] != g[key]:
                        bad.append(f"canvas {ci} step {si}: {key} differs")
                if np.float32(m["temperature"]) != np.float32(g["temperature"]):  # float32 values
                    bad.append(f"canvas {ci} step {si}: temperature {m['temperature']!r}, golden {g['temperature']!r}")
                if abs(m["mean_entropy"] - g["mean_entropy"]) > ENTROPY_TOLERANCE:
                    bad.append(f"canvas {ci} step {si}: mean entropy {m['mean_entropy']:.6g}, golden "
                               f"{g['mean_entropy']:.6g}")
            if mine["output"] != gold["output"]:
                bad.append(f"canvas {ci}: output differs")
        if seq != case["sequence"]:
            bad.append("sequence differs")
        steps = sum(len(c["steps"]) for c in canvases)
        print(f"  {name}: {len(canvases)} canvas(es), {steps} steps, "
              f"{'identical' if not bad else str(len(bad)) + ' difference(s)'}")
        failures += [f"{name}: {b}" for b in bad[:10]]
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint folder with goldens/ (default: the fixture)")
    ap.add_argument("--check", action="store_true", help="recompute the goldens and compare; exit 1 on a difference")
    args = ap.parse_args()
    model = Model(args.model)
    if not args.check:
        ap.print_help()
        return
    print("logits")
    failures, worst = check_logits(model, args.model)
    print("generations (recorded draws replayed)")
    failures += check_generate(model, args.model)
    for f in failures:
        print("FAIL:", f)
    if failures:
        sys.exit(1)
    print(f"all goldens reproduced (largest relative logits difference {worst:.2e})")


if __name__ == "__main__":
    main()
