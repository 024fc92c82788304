"""Independent numpy reference of the LLaDA forward pass and its reference sampler.

Implements the model of `shared/reference/llada.md` section 2.2 and the `generate`
procedure of section 3.1 (plus the Fast-dLLM confidence-threshold variant), for one
sequence at a time (batch size 1, no attention mask).

Numerics
--------
* Weights are held as float32 arrays.  bf16 checkpoint tensors are widened exactly
  (`f32 bits = u16 << 16`).
* `forward(..., bf16_rounding=False)`: every operation is evaluated in float64 from
  float32 inputs and its result is stored as float32 (one rounding per operation, the
  same places a float32 GPU runtime stores intermediates).  RoPE angles are built in
  float32 as the reference does.
* `forward(..., bf16_rounding=True)`: the result of each operation is rounded
  (nearest-even) to bf16 at every point listed in llada.md section 2.5.  Matrix products
  are accumulated in float64 before that rounding, so this is the correctly rounded
  result rather than a cuBLAS float32 accumulation; attention probabilities stay in
  float32/float64 and only the attention output is rounded.

Sampler conventions (what a second implementation must do to match the goldens)
------------------------------------------------------------------------------
* Confidence for `low_confidence` is the softmax probability (float64 softmax of the
  float32 logits, no temperature) of the chosen token.
* Top-k is a stable ordering by (-confidence, position): ties go to the lowest position.
* `random` remasking: one `numpy.random.Generator(PCG64(seed))` is created per
  `generate` call; each step draws `rng.random(T)` (T = prompt + gen length, float64)
  and the confidences are those numbers rounded to float32.  When `temperature > 0`
  the Gumbel uniforms `rng.random((T, V))` of a step are drawn before the remasking
  uniforms of that step.  Passing `rng_uniform` (one length-T list per step) replaces
  the remasking draws.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llada_common  # noqa: E402

# ---------------------------------------------------------------------------
# bf16 helpers
# ---------------------------------------------------------------------------


def f32_to_bf16_bits(a):
    """Round float32 values to bf16 (nearest, ties to even); returns uint16 bit patterns."""
    u = np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    if np.any(nan):
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded


def bf16_bits_to_f32(bits):
    """Widen bf16 bit patterns (uint16) to float32 exactly."""
    b = np.ascontiguousarray(np.asarray(bits, dtype=np.uint16))
    return (b.astype(np.uint32) << 16).view(np.float32)


def bf16_round(a):
    """Round to the nearest bf16 value, returned as float32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(a))


# ---------------------------------------------------------------------------
# checkpoint loading
# ---------------------------------------------------------------------------

# safetensors dtype name -> numpy dtype of the stored values (BF16 as its bit patterns)
_NP_DTYPES = {
    "BF16": np.uint16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}


def read_safetensors(path):
    """Parse one .safetensors file without the safetensors library.

    Returns (tensors, dtypes): name -> float32 array, name -> dtype string of the file.
    """
    with open(path, "rb") as f:
        header, _ = llada_common.read_safetensors_header(f)
        data = memoryview(f.read())
    tensors, dtypes = {}, {}
    for name, dt, shape, begin, end in llada_common.safetensors_entries(path, header):
        arr = np.frombuffer(data[begin:end], dtype=np.dtype(_NP_DTYPES[dt]).newbyteorder("<")).reshape(shape)
        if dt == "BF16":
            arr = bf16_bits_to_f32(arr)
        tensors[name] = np.array(arr, dtype=np.float32)
        dtypes[name] = dt
    return tensors, dtypes


def read_checkpoint_tensors(directory):
    """Every tensor of a checkpoint folder, single file or sharded by the index (which
    must name no tensor that is absent).  Returns (tensors, dtypes) as read_safetensors;
    tools/dream_ref.py reads its checkpoints with it too."""
    files, index = llada_common.checkpoint_files(directory)
    tensors, dtypes = {}, {}
    for name in files:
        t, d = read_safetensors(os.path.join(directory, name))
        llada_common.check_shard(tensors, t, name, index)
        tensors.update(t)
        dtypes.update(d)
    if index is not None:
        missing = set(index["weight_map"]) - set(tensors)
        if missing:
            raise ValueError(f"tensors listed in the index but absent: {sorted(missing)}")
    return tensors, dtypes


def load_checkpoint(directory):
    """Load config.json and the safetensors weights (single file or sharded by index).

    Returns {"config": resolved config dict, "tensors": name -> float32 array,
    "dtypes": name -> dtype string as stored}.
    """
    cfg = llada_common.load_config(directory)
    tensors, dtypes = read_checkpoint_tensors(directory)
    if any(k.endswith(".bias") for k in tensors):
        raise NotImplementedError("checkpoints with bias tensors are not supported")
    llada_common.check_shapes(llada_common.expected_shapes(cfg), tensors)
    return {"config": cfg, "tensors": tensors, "dtypes": dtypes}


# ---------------------------------------------------------------------------
# forward pass
# ---------------------------------------------------------------------------


def rope_tables(T, head_dim, theta):
    """cos/sin tables [T, head_dim] for half-split RoPE; angles built in float32."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    pos = np.arange(T, dtype=np.float32)
    freqs = (pos[:, None] * inv_freq[None, :]).astype(np.float32)
    ang = np.concatenate([freqs, freqs], axis=-1)
    # sin/cos of the float32 angle, evaluated in float64 and rounded once to float32
    cos = np.cos(ang.astype(np.float64)).astype(np.float32)
    sin = np.sin(ang.astype(np.float64)).astype(np.float32)
    return cos, sin


class _Numerics:
    """Storage rounding of one forward pass: float32 or bf16 after every operation."""

    def __init__(self, bf16):
        self.bf16 = bf16

    def store(self, a):
        a32 = np.asarray(a).astype(np.float32)
        return bf16_round(a32) if self.bf16 else a32

    def matmul(self, x, w):
        """x [T, in] times w[out, in] transposed, float64 accumulation."""
        return self.store(x.astype(np.float64) @ w.astype(np.float64).T)

    def rmsnorm(self, x, w, eps):
        x64 = x.astype(np.float64)
        if self.bf16:
            # reference: f32 variance, normalized x rounded, then weight * x rounded
            xf = x.astype(np.float32)
            var = np.mean(x64 * x64, axis=-1, keepdims=True).astype(np.float32)
            r = (np.float32(1.0) / np.sqrt(var + np.float32(eps))).astype(np.float32)
            n = bf16_round(xf * r)
            return bf16_round(w.astype(np.float32) * n)
        var = np.mean(x64 * x64, axis=-1, keepdims=True)
        return (x64 / np.sqrt(var + eps) * w.astype(np.float64)).astype(np.float32)

    def rope(self, t, cos, sin):
        """t [heads, T, hd]; rotate_half pairs dimension d with d + hd/2."""
        half = t.shape[-1] // 2
        if self.bf16:
            tf = t.astype(np.float32)
            rot = np.concatenate([-tf[..., half:], tf[..., :half]], axis=-1)
            return bf16_round(tf * cos + rot * sin)
        t64 = t.astype(np.float64)
        rot = np.concatenate([-t64[..., half:], t64[..., :half]], axis=-1)
        return (t64 * cos.astype(np.float64) + rot * sin.astype(np.float64)).astype(np.float32)


def forward(params, ids, bf16_rounding=False):
    """Logits float32 [T, embedding_size] of one sequence of token ids (llada.md 2.2)."""
    cfg, W = params["config"], params["tensors"]
    ids = np.asarray(ids, dtype=np.int64)
    T = ids.shape[0]
    D, H, Hkv, hd = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    group = H // Hkv
    nm = _Numerics(bf16_rounding)
    cos, sin = rope_tables(T, hd, cfg["rope_theta"])
    scale = 1.0 / math.sqrt(hd)

    x = W["model.transformer.wte.weight"][ids].astype(np.float32)  # exact copy of rows
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        h = nm.rmsnorm(x, W[p + "attn_norm.weight"], eps)
        q = nm.matmul(h, W[p + "q_proj.weight"]).reshape(T, H, hd).transpose(1, 0, 2)
        k = nm.matmul(h, W[p + "k_proj.weight"]).reshape(T, Hkv, hd).transpose(1, 0, 2)
        v = nm.matmul(h, W[p + "v_proj.weight"]).reshape(T, Hkv, hd).transpose(1, 0, 2)
        q = nm.rope(q, cos, sin)
        k = nm.rope(k, cos, sin)
        kv_of_q = np.arange(H) // group  # query head h reads kv head h // (H / Hkv)
        k64 = k.astype(np.float64)[kv_of_q]
        v64 = v.astype(np.float64)[kv_of_q]
        s = np.einsum("htd,hsd->hts", q.astype(np.float64), k64) * scale  # bidirectional
        s -= s.max(axis=-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(axis=-1, keepdims=True)
        a = nm.store(np.einsum("hts,hsd->htd", pr, v64))
        a = a.transpose(1, 0, 2).reshape(T, D)
        x = nm.store(x.astype(np.float64) + nm.matmul(a, W[p + "attn_out.weight"]))

        h = nm.rmsnorm(x, W[p + "ff_norm.weight"], eps)
        g = nm.matmul(h, W[p + "ff_proj.weight"])  # gate
        u = nm.matmul(h, W[p + "up_proj.weight"])
        g64 = g.astype(np.float64)
        silu = g64 / (1.0 + np.exp(-g64))
        if bf16_rounding:
            m = nm.store(nm.store(silu).astype(np.float64) * u)
        else:
            m = nm.store(silu * u)
        x = nm.store(x.astype(np.float64) + nm.matmul(m, W[p + "ff_out.weight"]))

    x = nm.rmsnorm(x, W["model.transformer.ln_f.weight"], eps)
    head = W["model.transformer.wte.weight" if cfg["weight_tying"] else "model.transformer.ff_out.weight"]
    return nm.matmul(x, head)


# ---------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------


def num_transfer_tokens(mask_count, steps):
    """Per-step commit quotas of one block: n // steps, +1 on the first n % steps steps."""
    base, rem = divmod(int(mask_count), int(steps))
    return [base + (1 if i < rem else 0) for i in range(steps)]


def softmax64(logits):
    l64 = np.asarray(logits, dtype=np.float64)
    m = np.max(l64, axis=-1, keepdims=True)
    e = np.exp(l64 - m)
    return e / e.sum(axis=-1, keepdims=True)


def rank_order(confidence):
    """Positions sorted by (-confidence, position): stable top-k with lowest-index ties."""
    pos = np.arange(confidence.shape[0])
    return np.lexsort((pos, -confidence))


def _top2_gap(row):
    finite = row[np.isfinite(row)]
    if finite.shape[0] < 2:
        return math.inf
    top = np.partition(finite, -2)[-2:]
    return float(top[1] - top[0])


def generate(
    params,
    prompt_ids,
    gen_length,
    steps,
    block_length,
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
    rng_uniform=None,
    bf16_rounding=False,
    suffix_ids=(),
):
    """Reference LLaDA sampler (llada.md 3.1) for one prompt.

    `suffix_ids` (infilling) follow the generated canvas: x = prompt, gen_length masks,
    suffix. They are real tokens like the prompt's (CFG masks them too), and lie past every
    block's end, so they are never candidates.

    `mask_id` and `eos_id` default to the config's `mask_token_id` / `eos_token_id`;
    `eot_id` must be given when `confidence_eos_eot_inf` is set.  With `threshold` set,
    Fast-dLLM decoding is used instead of fixed quotas: each step commits every masked
    position of the current block whose confidence is >= threshold and at least the
    most confident one, and a block ends when it has no masks left (`steps` is unused).

    Returns (tokens int64 [Lp + gen_length + len(suffix_ids)], trace).  trace has one dict per step with
    keys block, step, committed (ascending positions), tokens (committed token ids),
    conf_margin (gap between the weakest committed and the strongest non-committed
    confidence; distance to the threshold in threshold mode), logit_margin (smallest
    top-1 minus top-2 logit gap over the candidate positions), zero_tie (the top-k
    boundary fell inside a run of exactly-zero confidences, decided by position) and,
    for random remasking, uniforms (the float32 confidences of all T positions).

    A committed prediction equal to `mask_id` leaves the position masked, as in the
    reference (it is predicted again at the next step).
    """
    cfg = params["config"]
    if mask_id is None:
        mask_id = cfg["mask_token_id"]
    if eos_id is None:
        eos_id = cfg["eos_token_id"]
    if confidence_eos_eot_inf and eot_id is None:
        raise ValueError("confidence_eos_eot_inf needs eot_id")
    if remasking not in ("low_confidence", "random"):
        raise NotImplementedError(remasking)
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    Lp = prompt.shape[0]
    suffix = np.asarray(suffix_ids, dtype=np.int64)
    T = Lp + gen_length + suffix.shape[0]
    x = np.full(T, mask_id, dtype=np.int64)
    x[:Lp] = prompt
    x[Lp + gen_length :] = suffix
    prompt_index = x != mask_id  # fixed for the whole run
    if gen_length % block_length:
        raise ValueError("gen_length must be a multiple of block_length")
    num_blocks = gen_length // block_length
    if threshold is None:
        if steps % num_blocks:
            raise ValueError("steps must be a multiple of the number of blocks")
        steps_per_block = steps // num_blocks
    rng = np.random.Generator(np.random.PCG64(seed))
    trace = []
    step_counter = [0]

    def model_logits(seq):
        if cfg_scale > 0:
            un = seq.copy()
            un[prompt_index] = mask_id
            c = forward(params, seq, bf16_rounding)
            u = forward(params, un, bf16_rounding)
            w1 = np.float32(cfg_scale + 1.0)
            if bf16_rounding:  # each bf16 tensor operation of the reference rounds
                return bf16_round(u + bf16_round(w1 * bf16_round(c - u)))
            return (u + w1 * (c - u)).astype(np.float32)  # float32 arithmetic
        return forward(params, seq, bf16_rounding)

    def one_step(nb, i, k):
        """Run one denoising step; k = quota, or None in threshold mode."""
        block_end = Lp + (nb + 1) * block_length
        mask_index = x == mask_id
        logits = model_logits(x).astype(np.float64)
        if logits_eos_inf:
            logits[:, eos_id] = -np.inf
        argmax_logits = logits.copy()  # what the argmax saw, kept for the margins
        if temperature > 0:
            uni = rng.random(logits.shape)
            with np.errstate(divide="ignore"):
                gumbel = -np.log(-np.log(uni))
            x0 = np.argmax(logits + temperature * gumbel, axis=-1)
        else:
            x0 = np.argmax(logits, axis=-1)  # first maximal index
        if confidence_eos_eot_inf:
            # quirk of the reference's chained assignment: at temperature 0 both EOS and
            # EoT are removed from the confidence softmax, above it only EoT
            if temperature == 0:
                logits[:, eos_id] = -np.inf
            logits[:, eot_id] = -np.inf
        uniforms = None
        if remasking == "low_confidence":
            p = softmax64(logits)
            x0_p = p[np.arange(T), x0]
            if bf16_rounding:  # the reference softmax returns bf16
                x0_p = bf16_round(x0_p).astype(np.float64)
        else:
            if rng_uniform is not None:
                uniforms = np.asarray(rng_uniform[step_counter[0]], dtype=np.float32)
                if uniforms.shape != (T,):
                    raise ValueError("rng_uniform rows must have length T")
            else:
                uniforms = rng.random(T).astype(np.float32)
            x0_p = uniforms.astype(np.float64)
        x0_p = x0_p.copy()
        x0_p[block_end:] = -np.inf
        x0 = np.where(mask_index, x0, x)
        confidence = np.where(mask_index, x0_p, -np.inf)
        order = rank_order(confidence)
        n_cand = int(np.isfinite(confidence).sum())
        if k is None:
            if n_cand == 0:
                raise RuntimeError("no masked position left to decode")
            chosen = [int(order[0])] + [int(j) for j in order[1:n_cand] if confidence[j] >= threshold]
        else:
            if k > n_cand:
                raise RuntimeError("quota exceeds the number of candidate positions")
            chosen = [int(j) for j in order[:k]]
        chosen_sorted = sorted(chosen)

        # decision margins (how far the result is from a different choice)
        cand = [int(j) for j in order[:n_cand]]
        conf_margin = math.inf
        zero_tie = False
        if k is None:
            top = cand[0]
            for j in cand[1:]:
                conf_margin = min(conf_margin, abs(confidence[j] - threshold))
            if n_cand > 1 and confidence[top] < threshold:
                conf_margin = min(conf_margin, confidence[top] - confidence[cand[1]])
        elif 0 < k < n_cand:
            lo, hi = confidence[cand[k - 1]], confidence[cand[k]]
            if lo == hi == 0.0:
                # exact zeros come from -inf logits (EOS/EoT ban) and tie exactly in any
                # implementation; the lowest position wins
                zero_tie = True
            else:
                conf_margin = lo - hi
        logit_margin = math.inf
        if temperature == 0:
            # the EOS/EoT confidence quirk makes p(x0) jump when the argmax crosses
            # those ids, so every candidate's argmax counts, not only the committed ones
            for j in cand:
                logit_margin = min(logit_margin, _top2_gap(argmax_logits[j]))
        for j in chosen:
            x[j] = x0[j]
        entry = {
            "block": nb,
            "step": i,
            "committed": chosen_sorted,
            "tokens": [int(x[j]) for j in chosen_sorted],
            "conf_margin": float(conf_margin),
            "logit_margin": float(logit_margin),
            "zero_tie": zero_tie,
        }
        if uniforms is not None:
            entry["uniforms"] = [float(u) for u in uniforms]
        trace.append(entry)
        step_counter[0] += 1

    for nb in range(num_blocks):
        b0, b1 = Lp + nb * block_length, Lp + (nb + 1) * block_length
        if threshold is None:
            quotas = num_transfer_tokens(int((x[b0:b1] == mask_id).sum()), steps_per_block)
            for i, k in enumerate(quotas):
                one_step(nb, i, k)
        else:
            i = 0
            while (x[b0:b1] == mask_id).any():
                if i > 4 * T:  # only reachable when the model keeps predicting mask_id
                    raise RuntimeError("threshold decoding does not finish the block")
                one_step(nb, i, None)
                i += 1
    return x, trace


# ---------------------------------------------------------------------------
# log-likelihood (get_log_likelihood.py, llada.md 3.3)
# ---------------------------------------------------------------------------


def draw_likelihood_masks(answer_len, mc_num, batch_size, rng):
    """The reference's forward_process masks for mc_num // batch_size batches: k ~ U{1..L},
    row i masks ((round(linspace(k, k + (b-1) L/b, b))[i] - 1) mod L) + 1 positions of a
    random permutation. Returns [(sorted masked answer positions, p_mask)]."""
    L, b = answer_len, batch_size
    out = []
    for _ in range(mc_num // b):
        k = int(rng.integers(1, L + 1))
        x = np.round(np.linspace(float(k), k + (b - 1) * (L / b), num=b, dtype=np.float32)).astype(np.int64)
        x = ((x - 1) % L) + 1
        for i in range(b):
            perm = rng.permutation(L)
            masked = sorted(int(j) for j in perm[: x[i]])
            out.append((masked, float(x[i]) / L))
    return out


MASK64 = (1 << 64) - 1


def splitmix64(state):
    """unmask_core::rng::SplitMix64: (next state, next value)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def draw_seeded_masks(answer_len, mc_num, batch_size, seed):
    """unmask_core::likelihood::draw_masks, ported: the runtime's seeded draw of the same
    scheme as draw_likelihood_masks (SplitMix64, k and every permutation drawn below n
    without modulo bias, the counts rounded ties-to-even in float64), so goldens can hold
    the masks a seed gives. Returns [(sorted masked answer positions, p_mask)]."""
    state = seed & MASK64

    def below(n):
        nonlocal state
        zone = MASK64 - MASK64 % n
        while True:
            state, v = splitmix64(state)
            if v < zone:
                return v % n

    L, b = answer_len, batch_size
    out = []
    for _ in range(mc_num // b):
        k = 1 + below(L)
        for i in range(b):
            x = round(k + i * (L / b))
            count = (x - 1) % L + 1
            order = list(range(L))
            for j in range(L - 1, 0, -1):
                r = below(j + 1)
                order[j], order[r] = order[r], order[j]
            out.append((sorted(order[:count]), count / L))
    return out


def log_likelihood(params, prompt_ids, answer_ids, samples, cfg_scale=0.0, mask_id=None, logits_fn=None):
    """The Monte Carlo estimate over the given samples [(masked answer positions, p_mask)]:
    each sample's loss is the masked tokens' cross-entropy (float64 log-softmax of the
    float32 logits) over p_mask, the estimate minus their mean. With cfg_scale > 0 the
    logits are u + (w + 1)(c - u), u from the sequence with the prompt masked.
    `logits_fn(params, ids)` gives the logits whose row p predicts position p (llada's
    forward by default; Dream passes its shifted forward). Returns (estimate, losses)."""
    if mask_id is None:
        mask_id = params["config"]["mask_token_id"]
    if logits_fn is None:
        logits_fn = forward
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    answer = np.asarray(answer_ids, dtype=np.int64)
    Lp = prompt.shape[0]
    seq = np.concatenate([prompt, answer])
    losses = []
    for masked, p_mask in samples:
        x = seq.copy()
        idx = np.asarray(masked, dtype=np.int64) + Lp
        x[idx] = mask_id
        logits = logits_fn(params, x).astype(np.float64)
        if cfg_scale > 0:
            un = x.copy()
            un[:Lp] = mask_id
            u = logits_fn(params, un).astype(np.float64)
            logits = u + (cfg_scale + 1.0) * (logits - u)
        rows = logits[idx]
        m = rows.max(axis=1, keepdims=True)
        lse = (m + np.log(np.exp(rows - m).sum(axis=1, keepdims=True)))[:, 0]
        ce = lse - rows[np.arange(idx.shape[0]), seq[idx]]
        losses.append(float(ce.sum() / p_mask))
    return -float(np.mean(losses)), losses
