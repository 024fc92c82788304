"""Independent numpy reference of the Dream forward pass and its samplers.

Dream (Dream-v0-7B, DiffuCoder) is the Qwen2 decoder with the causal mask removed:
q/k/v projections with biases, GQA, half-split ("rotate_half") RoPE, RMSNorm, SwiGLU
MLP, untied LM head.  The prediction for position i is read from the model output at
position i - 1 ("shifted logits"); position 0 reads its own row.  The config, the
expected tensors and the quota rule, shared with tools/dream_torch.py, are in
tools/dream_common.py.

Numerics
--------
The same as the float32 path of tools/llada_ref.py: weights are held as float32 arrays
(bf16 widened exactly); every operation is evaluated in float64 from float32 inputs and
stored as float32.  A linear layer with a bias is one operation (`x @ W.T + b` in
float64, rounded once).  RoPE angles are built in float32 as in HF Qwen2.  Sampler
probabilities are float64 softmaxes of the float32 logits.

Samplers
--------
* `generate(..., block_length=None or gen_length, threshold=None)`: Dream's original
  `diffusion_generate` (one schedule over the whole canvas, algs origin, maskgit_plus,
  topk_margin, entropy; optional alg_temp sampling of the positions).
* block schedule (block_length < gen_length, or threshold set): the Fast-dLLM Dream
  port; each block starts with a step committing its first position with the argmax,
  then either per-step quotas from the block's own timestep table or a confidence
  threshold.  Every step is a full-sequence forward (no cache).

Conventions a second implementation must follow to match the goldens:
* top-n is a stable order by (-confidence, position): ties go to the lowest position;
* random numbers come from one numpy Generator(PCG64(seed)) per call, drawn as float64
  and rounded to float32 (the stored "draws"); origin draws one per masked position in
  ascending order each step; alg_temp > 0 draws n per step (see `choose_sampled`);
* quota n = int(num_masked * (1 - s / t)) in float64 (the generator checks that float32
  gives the same n for every golden step).
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dream_common  # noqa: E402
import llada_common  # noqa: E402
import llada_ref  # noqa: E402

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")

# ---------------------------------------------------------------------------
# config and checkpoint
# ---------------------------------------------------------------------------


def load_checkpoint(directory):
    """config.json and the safetensors weights (single file or sharded by the index).

    Returns {"config", "tensors": name -> float32 array, "dtypes": name -> stored dtype}.
    """
    cfg = dream_common.load_config(directory)
    tensors, dtypes = llada_ref.read_checkpoint_tensors(directory)
    shapes = dream_common.expected_shapes(cfg)
    llada_common.check_shapes(shapes, tensors)
    extra = set(tensors) - set(shapes)
    if extra:
        raise ValueError(f"unexpected tensors: {sorted(extra)}")
    return {"config": cfg, "tensors": tensors, "dtypes": dtypes}


# ---------------------------------------------------------------------------
# forward pass
# ---------------------------------------------------------------------------


def positions_of(attention_mask):
    """Dream's position ids of a left-padded row: cumsum(mask) - 1, pads at 1."""
    m = np.asarray(attention_mask, dtype=np.int64)
    pos = np.cumsum(m) - 1
    pos[m == 0] = 1
    return pos


def forward(params, ids, attention_mask=None, return_hidden=False):
    """Unshifted logits float32 [T, vocab_size] of one sequence (with return_hidden,
    also the final normed hidden states [T, hidden_size] the LM head reads).

    Without `attention_mask` the positions are 0..T-1 and every position attends to
    every position.  With it (1 = real token, 0 = pad), positions follow
    `positions_of` and pad keys are masked out for every query; the rows of pads are
    computed (over the real keys) but carry no meaning.
    """
    cfg, W = params["config"], params["tensors"]
    ids = np.asarray(ids, dtype=np.int64)
    T = ids.shape[0]
    D, H, Hkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    nm = llada_ref._Numerics(False)
    if attention_mask is None:
        pos = np.arange(T)
        key_ok = np.ones(T, dtype=bool)
    else:
        am = np.asarray(attention_mask, dtype=np.int64)
        if am.shape != (T,):
            raise ValueError("attention_mask must have one entry per token")
        if not am.any():
            raise ValueError("attention_mask masks every token")
        pos = positions_of(am)
        key_ok = am != 0
    # a row of the RoPE tables depends only on its position, so index a 0..max table
    cos_t, sin_t = llada_ref.rope_tables(int(pos.max()) + 1, hd, cfg["rope_theta"])
    cos, sin = cos_t[pos], sin_t[pos]
    scale = 1.0 / math.sqrt(hd)
    group = H // Hkv
    kv_of_q = np.arange(H) // group  # q head j reads kv head j // (H / Hkv)

    def linear(x, w, b=None):
        acc = x.astype(np.float64) @ w.astype(np.float64).T
        if b is not None:
            acc = acc + b.astype(np.float64)
        return nm.store(acc)

    h = W["model.embed_tokens.weight"][ids].astype(np.float32)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = nm.rmsnorm(h, W[p + "input_layernorm.weight"], eps)
        q = linear(x, W[p + "self_attn.q_proj.weight"], W[p + "self_attn.q_proj.bias"])
        k = linear(x, W[p + "self_attn.k_proj.weight"], W[p + "self_attn.k_proj.bias"])
        v = linear(x, W[p + "self_attn.v_proj.weight"], W[p + "self_attn.v_proj.bias"])
        q = nm.rope(q.reshape(T, H, hd).transpose(1, 0, 2), cos, sin)
        k = nm.rope(k.reshape(T, Hkv, hd).transpose(1, 0, 2), cos, sin)
        v = v.reshape(T, Hkv, hd).transpose(1, 0, 2)
        k64 = k.astype(np.float64)[kv_of_q]
        v64 = v.astype(np.float64)[kv_of_q]
        s = np.einsum("htd,hsd->hts", q.astype(np.float64), k64) * scale  # no causal mask
        s[:, :, ~key_ok] = -np.inf
        s -= s.max(axis=-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(axis=-1, keepdims=True)
        a = nm.store(np.einsum("hts,hsd->htd", pr, v64)).transpose(1, 0, 2).reshape(T, D)
        h = nm.store(h.astype(np.float64) + linear(a, W[p + "self_attn.o_proj.weight"]))

        x = nm.rmsnorm(h, W[p + "post_attention_layernorm.weight"], eps)
        g = linear(x, W[p + "mlp.gate_proj.weight"]).astype(np.float64)
        u = linear(x, W[p + "mlp.up_proj.weight"]).astype(np.float64)
        m = nm.store(g / (1.0 + np.exp(-g)) * u)
        h = nm.store(h.astype(np.float64) + linear(m, W[p + "mlp.down_proj.weight"]))

    h = nm.rmsnorm(h, W["model.norm.weight"], eps)
    head = W["model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"]
    logits = linear(h, head)
    return (logits, h) if return_hidden else logits


def shift_logits(logits):
    """Row i holds the prediction for position i: output i - 1 (row 0 keeps its own)."""
    return np.concatenate([logits[:1], logits[:-1]], axis=0)


def shifted_forward(params, ids, attention_mask=None):
    return shift_logits(forward(params, ids, attention_mask))


# ---------------------------------------------------------------------------
# token choice and confidences (Dream `sample_tokens`)
# ---------------------------------------------------------------------------

_F32_MIN = float(np.finfo(np.float32).min)


def top_p_filter(logits, top_p):
    """Keep the smallest descending prefix whose probability reaches top_p (the first
    token always); the rest get float32's lowest value."""
    out = np.array(logits, dtype=np.float64)
    for r in range(out.shape[0]):
        order = np.argsort(-out[r], kind="stable")
        cum = np.cumsum(llada_ref.softmax64(out[r][order]))
        remove = np.zeros_like(cum, dtype=bool)
        remove[1:] = cum[:-1] > top_p
        out[r, order[remove]] = _F32_MIN
    return out


def top_k_filter(logits, top_k):
    """Logits below the k-th largest of their row get float32's lowest value."""
    out = np.array(logits, dtype=np.float64)
    k = min(int(top_k), out.shape[-1])
    kth = np.sort(out, axis=-1)[:, -k][:, None]
    out[out < kth] = _F32_MIN
    return out


def sample_tokens(logits, temperature=0.0, top_p=None, top_k=None, margin_confidence=False, neg_entropy=False):
    """(confidence float64 [n], x0 int64 [n]) of logit rows [n, V], temperature 0 only.

    confidence: max probability; with margin_confidence top1 - top2 probability; with
    neg_entropy sum(p * log(p + 1e-10)).
    """
    if temperature and temperature > 0:
        raise NotImplementedError("temperature > 0 (categorical sampling) is not implemented")
    lg = np.asarray(logits, dtype=np.float64)
    if lg.shape[0] == 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    if top_p is not None and top_p < 1:
        lg = top_p_filter(lg, top_p)
    if top_k is not None:
        lg = top_k_filter(lg, top_k)
    probs = llada_ref.softmax64(lg)
    x0 = np.argmax(probs, axis=-1)  # first maximal index
    confidence = probs[np.arange(probs.shape[0]), x0]
    if margin_confidence:
        top2 = np.sort(probs, axis=-1)[:, -2:]
        confidence = top2[:, 1] - top2[:, 0]
    if neg_entropy:
        confidence = np.sum(probs * np.log(probs + 1e-10), axis=-1)
    return confidence, x0


def alg_confidence(alg, logits, temperature=0.0, top_p=None, top_k=None):
    if alg == "maskgit_plus":
        return sample_tokens(logits, temperature, top_p, top_k)
    if alg == "topk_margin":
        return sample_tokens(logits, temperature, top_p, top_k, margin_confidence=True)
    if alg == "entropy":
        return sample_tokens(logits, temperature, top_p, top_k, neg_entropy=True)
    raise ValueError(f"unknown alg {alg!r}")


def _top2_gap(row):
    top = np.partition(np.asarray(row, dtype=np.float64), -2)[-2:]
    return float(top[1] - top[0])


# ---------------------------------------------------------------------------
# choosing positions
# ---------------------------------------------------------------------------


def choose_top(positions, confidence, n):
    """The n positions of highest confidence (ties: lowest position) and the gap
    between the n-th and the (n+1)-th confidence (inf when no boundary)."""
    order = llada_ref.rank_order(np.asarray(confidence, dtype=np.float64))
    chosen = [int(positions[j]) for j in order[:n]]
    margin = math.inf
    if 0 < n < len(positions):
        margin = float(confidence[order[n - 1]] - confidence[order[n]])
    return chosen, margin


def sampling_weights(confidence, alg_temp):
    """softmax(confidence / alg_temp) over the candidate positions (float64)."""
    z = np.asarray(confidence, dtype=np.float64) / alg_temp
    e = np.exp(z - z.max())
    return e / e.sum()


def choose_sampled(positions, weights, draws):
    """Sampling without replacement, one draw per pick (the rule the runtime replays).

    For each draw u: over the not-yet-chosen positions in ascending order, accumulate
    the weights (float64) and take the first position whose running sum exceeds
    u * (sum of the remaining weights); if rounding leaves none, the last remaining.
    Returns (chosen positions in pick order, margin): margin is the smallest distance,
    relative to the remaining sum, between u * sum and a running sum.
    """
    remaining = list(range(len(positions)))  # indices into positions, ascending
    chosen, margin = [], math.inf
    for u in draws:
        w = np.array([weights[j] for j in remaining], dtype=np.float64)
        total = float(np.sum(w))
        target = float(u) * total
        run, pick = 0.0, len(remaining) - 1
        for idx, wj in enumerate(w):
            run += float(wj)
            margin = min(margin, abs(run - target) / total)
            if run > target:
                pick = idx
                break
        chosen.append(int(positions[remaining[pick]]))
        del remaining[pick]
    return chosen, margin


# ---------------------------------------------------------------------------
# samplers
# ---------------------------------------------------------------------------


def generate(
    params,
    prompt_ids,
    gen_length,
    steps,
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
    suffix_ids=(),
):
    """Reference Dream sampler for one prompt (batch 1, no padding).

    `suffix_ids` (infilling) follow the canvas: x = prompt, gen_length masks, suffix; they
    hold no mask, so no schedule ever picks them.

    block_length None or equal to gen_length and no threshold: Dream's original
    schedule; otherwise the block schedule (see the module docstring).  `draws`, one
    entry per step (a list, or None for steps without random numbers), replaces the
    generator's draws, to replay stored goldens.

    Returns (tokens int64 [Lp + gen_length + len(suffix_ids)], trace): one dict per step with block,
    step, committed (ascending positions), tokens, draws (float32 list, only where the
    step used random numbers), conf_margin (how far the step's confidence decision is
    from a different one; inf if no decision) and logit_margin (smallest top-1 minus
    top-2 logit gap at a committed position; inf if nothing was committed); quota steps
    also carry quota_args (num_masked, timestep index, timestep table length, last).
    """
    cfg = params["config"]
    if mask_id is None:
        mask_id = cfg["mask_token_id"]
    if alg not in ALGS:
        raise ValueError(f"unknown alg {alg!r}")
    if temperature and temperature > 0:
        raise NotImplementedError("temperature > 0 is not implemented")
    if block_length is None:
        block_length = gen_length
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    Lp = prompt.shape[0]
    suffix = np.asarray(suffix_ids, dtype=np.int64)
    x = np.concatenate([prompt, np.full(gen_length, mask_id, dtype=np.int64), suffix])
    rng = np.random.Generator(np.random.PCG64(seed))
    trace = []

    def draw(n):
        k = len(trace)
        if draws is not None:
            d = np.asarray(draws[k] if draws[k] is not None else [], dtype=np.float32)
            if d.shape != (n,):
                raise ValueError(f"step {k}: {d.shape[0]} stored draws, {n} needed")
            return d
        return rng.random(n).astype(np.float32)

    def record(block, step, chosen, x0_of, logits, conf_margin, used_draws):
        chosen = sorted(chosen)
        logit_margin = math.inf
        for j in chosen:
            logit_margin = min(logit_margin, _top2_gap(logits[j]))
            x[j] = x0_of[j]
        entry = {
            "block": block,
            "step": step,
            "committed": chosen,
            "tokens": [int(x[j]) for j in chosen],
            "conf_margin": float(conf_margin),
            "logit_margin": float(logit_margin),
        }
        if used_draws is not None:
            entry["draws"] = [float(u) for u in used_draws]
        trace.append(entry)

    def quota_step(block, step, masked, n, logits, qargs):
        """Commit n of the masked positions per alg / alg_temp.  qargs = (num_masked,
        timestep index, timestep table length, last) is kept in the trace so that the
        quota can be recomputed in another precision."""
        conf, x0 = alg_confidence(alg, logits[masked], temperature, top_p, top_k)
        x0_of = dict(zip((int(j) for j in masked), (int(t) for t in x0)))
        used = None
        if n <= 0:
            chosen, margin = [], math.inf
        elif alg_temp is None or alg_temp == 0:
            chosen, margin = choose_top(masked, conf, n)
        else:
            used = draw(n)
            chosen, margin = choose_sampled(masked, sampling_weights(conf, alg_temp), used)
        record(block, step, chosen, x0_of, logits, margin, used)
        trace[-1]["quota_args"] = qargs

    block_mode = threshold is not None or block_length < gen_length
    if not block_mode:
        ts = np.linspace(1.0, eps, steps + 1)
        for i in range(steps):
            masked = np.flatnonzero(x == mask_id)
            logits = shifted_forward(params, x)
            t, s = float(ts[i]), float(ts[i + 1])
            last = i == steps - 1
            if alg == "origin":
                p_transfer = 1.0 if last else 1.0 - s / t
                used = draw(masked.shape[0]) if masked.shape[0] else None
                chosen, margin = [], math.inf
                if used is not None:
                    chosen = [int(j) for j, u in zip(masked, used) if float(u) < p_transfer]
                    if not last:
                        margin = min(abs(float(u) - p_transfer) for u in used)
                _, x0 = sample_tokens(logits[chosen], temperature, top_p, top_k)
                record(0, i, chosen, dict(zip(chosen, (int(t) for t in x0))), logits, margin, used)
            else:
                n = dream_common.quota(masked.shape[0], t, s, last)
                quota_step(0, i, masked, n, logits, (int(masked.shape[0]), i, steps + 1, last))
        return x, trace

    if alg == "origin":
        raise ValueError("alg origin is not available with the block schedule")
    if gen_length % block_length:
        raise ValueError("gen_length must be a multiple of block_length")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError("steps must be a multiple of the number of blocks")
    spb = steps // num_blocks
    if spb < 2:
        raise ValueError("the block schedule needs at least 2 steps per block")
    ts = np.linspace(1.0, eps, spb + 1)
    for nb in range(num_blocks):
        bs, be = Lp + nb * block_length, Lp + (nb + 1) * block_length
        logits = shifted_forward(params, x)
        _, x0 = sample_tokens(logits[bs : bs + 1], temperature, top_p, top_k)
        record(nb, 0, [bs], {bs: int(x0[0])}, logits, math.inf, None)
        if threshold is None:
            for i in range(1, spb):
                masked = bs + np.flatnonzero(x[bs:be] == mask_id)
                logits = shifted_forward(params, x)
                last = i == spb - 1
                n = dream_common.quota(masked.shape[0], float(ts[i]), float(ts[i + 1]), last)
                quota_step(nb, i, masked, n, logits, (int(masked.shape[0]), i, spb + 1, last))
        else:
            i = 1
            while (x[bs:be] == mask_id).any():
                if i > 4 * block_length:  # only if the model keeps predicting mask_id
                    raise RuntimeError("threshold decoding does not finish the block")
                masked = bs + np.flatnonzero(x[bs:be] == mask_id)
                logits = shifted_forward(params, x)
                conf, x0 = sample_tokens(logits[masked], temperature, top_p, top_k)
                order = llada_ref.rank_order(conf)
                chosen = [int(masked[order[0]])] + [int(masked[j]) for j in order[1:] if conf[j] >= threshold]
                margin = math.inf
                for j in order[1:]:
                    margin = min(margin, abs(float(conf[j]) - threshold))
                if len(order) > 1 and conf[order[0]] < threshold:
                    margin = min(margin, float(conf[order[0]] - conf[order[1]]))
                x0_of = dict(zip((int(j) for j in masked), (int(t) for t in x0)))
                record(nb, i, chosen, x0_of, logits, margin, None)
                i += 1
    return x, trace
