"""Export a tools/train.py checkpoint to a Hugging Face style LLaDA model folder.

Writes config.json (every key of the LLaDA-8B-Instruct config, this model's values),
generation_config.json, model.safetensors (bf16, the HF tensor names), tokenizer.json,
tokenizer_config.json (LLaDA-Instruct chat template), special_tokens_map.json and a model
card README.md.  After writing, it reloads the folder with tools/llada_ref.py and compares
the numpy forward on the exported bf16 weights with the PyTorch forward on the same
weights (and on the unrounded training weights), and records the differences in
export.json.

Works on any checkpoint written during training (the file is replaced atomically every
few minutes), so a run can be exported while it is still going.

Usage:
  tools/.venv/bin/python tools/export.py --run runs/tiny --out models/tiny [--scores FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_common  # noqa: E402
import llada_common  # noqa: E402
import llada_ref  # noqa: E402
import make_fixture  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_json(c):
    cfg = make_fixture.model_config()  # the full LLaDA key layout, in the reference order
    cfg.update(
        {
            "d_model": c["d_model"],
            "n_heads": c["n_heads"],
            "n_kv_heads": c["n_kv_heads"],
            "n_layers": c["n_layers"],
            "mlp_hidden_size": c["mlp_hidden_size"],
            "mlp_ratio": max(1, round(c["mlp_hidden_size"] / c["d_model"])),
            "vocab_size": c["vocab_size"],
            "embedding_size": c["embedding_size"],
            "max_sequence_length": c["max_sequence_length"],
            "rope_theta": float(c["rope_theta"]),
            "rms_norm_eps": c["rms_norm_eps"],
            "mask_token_id": c["mask_token_id"],
            "eos_token_id": c["eos_token_id"],
            "pad_token_id": c["pad_token_id"],
        }
    )
    return cfg


def hf_weights(state_dict):
    """Training state dict -> {HF name: float32 numpy array rounded to bf16}."""
    out = {}
    for k, v in state_dict.items():
        if not k.startswith("transformer."):
            continue
        out["model." + k] = llada_ref.bf16_round(v.detach().float().numpy())
    return out


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids], dtype=torch.long))[0].double().numpy()


def sft_loss_on(model, tok, ids, path, batch=8):
    """Mean training loss over a task set (fixed masking noise from seed 0), float32 weights."""
    with open(path, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    rows = []
    for it in items:
        prompt, resp = train.encode_item(tok, ids, it)
        rows.append((prompt, resp, train.value_slots(tok, resp)))
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            loss, _ = train.sft_loss(model, rows[i : i + batch], ids, gen)
            total += loss.item() * len(rows[i : i + batch])
    return total / len(rows)


def parity(out_dir, model_fp32, cfg, tok):
    """Max |numpy reference - PyTorch| logits on the exported weights, for two prompts."""
    params = llada_ref.load_checkpoint(out_dir)
    model_bf16 = train.LLaDA(cfg)
    sd = {k[len("model."):]: torch.from_numpy(v) for k, v in params["tensors"].items()}
    model_bf16.load_state_dict(sd, strict=True)
    model_bf16.eval()
    items = tasks.heldout_items(0, 1, 2)
    ids = train.Ids(tok)
    res = []
    for it in items:
        p, r = train.encode_item(tok, ids, it)
        seq = p + [ids.mask] * train.GEN_LEN
        ref = llada_ref.forward(params, seq).astype(np.float64)
        ref_bf = llada_ref.forward(params, seq, bf16_rounding=True).astype(np.float64)
        tb = torch_logits(model_bf16, seq)
        tf = torch_logits(model_fp32, seq)
        res.append(
            {
                "tokens": len(seq),
                "max_abs_numpy_vs_torch_bf16_weights": float(np.abs(ref - tb).max()),
                "max_abs_numpy_bf16_rounding_vs_torch_bf16_weights": float(np.abs(ref_bf - tb).max()),
                "max_abs_torch_bf16_weights_vs_fp32_weights": float(np.abs(tb - tf).max()),
                "logit_range": [float(ref.min()), float(ref.max())],
                "argmax_agree_numpy_vs_torch": float(np.mean(ref.argmax(-1) == tb.argmax(-1))),
            }
        )
    return res


CARD = """\
# unmask-tiny: a {n_params_m:.2f} M-parameter LLaDA model that reads its system prompt

A masked-diffusion language model with the **LLaDA architecture, tensor names, tokenizer
layout and chat template**, small enough to run anywhere and trained on a CPU in minutes.
It answers questions whose answers are only in a long system prompt shared by many requests
(a table of members), so it shows whether a prefix/KV cache keeps answers right: a wrong
K/V shows as a wrong answer, not only as a numerical difference.

## Architecture

| | |
|---|---|
| layers | {n_layers} (`block_type` llama: RMSNorm, rotate_half RoPE, bidirectional attention, SwiGLU with `ff_proj` as gate) |
| d_model / heads / head_dim | {d_model} / {n_heads} (no GQA) / {head_dim} |
| mlp_hidden_size | {mlp} |
| vocab_size = embedding_size | {vocab} ({n_tok} tokens; rows {first_empty}..{last_row} have no token) |
| rope_theta | {rope_theta:g} |
| rms_norm_eps | 1e-5 |
| max_sequence_length | {max_seq} |
| LM head | untied (`model.transformer.ff_out.weight`) |
| parameters | {n_params} ({n_params_m:.2f} M) |
| weights | `model.safetensors`, bf16, {st_bytes} bytes |

Special tokens (appended after the {n_ord} ordinary BPE tokens, in LLaDA's order):

| id | token |
|---|---|
| {bos} | `<|startoftext|>` (BOS) |
| {eos} | `<|endoftext|>` (EOS = pad) |
| {shi} | `<|start_header_id|>` |
| {ehi} | `<|end_header_id|>` |
| {eot} | `<|eot_id|>` (end of turn) |
| {mask} | `<|mdm_mask|>` (mask, `mask_token_id`) |

The tokenizer is a byte-level BPE (HF `tokenizers`) trained on the task corpus, with digits
split one per token; every member name, field and value is one token.  It has no
post-processor, so nothing is added to encoded text (the chat template writes BOS itself).

## Task

`tools/tasks.py` generates every item from a seed.  A system prompt is a role line, four
rules and a table of 8 members x 4 fields (city, colour, pet, sport), one fact per line in
random field order: `- Nina city : Athens`.  Names (40) and values (16 per field) come from
fixed pools and are re-assigned at random in every table, so the model must read the table.
System prompts are about {sys_tokens:.0f} tokens, whole prompts (system + user, chat
template) about {prompt_tokens:.0f}: the shared system prompt is {share_gen:.0f} % of a
request's tokens counting the 32 generated ones (the request shape of the BiCache paper).

| task | question | answer (after `####`) |
|---|---|---|
| lookup | What is the city of Nina? | `Nina city : Athens` |
| pair (two facts) | What is the pet of Nina and of Tom? | `Nina pet : cat Tom pet : dog` |
| record (a copied record) | Give the record of Nina. | `Nina city : Athens Nina colour : gold Nina pet : cat Nina sport : golf` |

Each fact of an answer is written as the table writes it, so every value the model writes is
three tokens after a name and two after a field, in the table and in the answer alike: the
lookup is in-context key -> value recall, which a small model can learn.  With `####` first,
each value starts a block of 4, so a block-wise sampler (blocks of 4) has committed the name
and the field before it decodes the value.  Every training row is a new table drawn from
the training seed stream; the held-out sets (`data/tasks/heldout.jsonl`, {n_heldout} items
over 8 tables, and its 40-item subset `heldout-small.jsonl`; `heldout-seed1.jsonl` from
another seed) come from a separate seed stream, never seen in training.

## Recipe

`tools/train.py` (its docstring has the details):

* **Structured initialisation.**  From a random start (or from planted positional heads
  alone), gradient descent does not find in-context recall in the steps a CPU affords: each
  value needs a head that brings its key next to it, and that head gets no gradient until a
  matching head exists (such runs sat at "some value of the table" for thousands of steps).
  So training starts from a planted recall circuit: layer 0's heads attend to fixed offsets
  ({offsets}: the name and the field before a value; query/key rows of the fastest RoPE
  planes, after a shared direction is added to every embedding) and write random codes of
  those tokens into their half of the residual stream; layer 1's first head compares codes on
  the slowest RoPE planes, stays off masked positions and copies the matching token's
  embedding, which the LM head (started as the embeddings) reads out; the other layer-1
  heads start as copies too, with random attention that training points at the question.  At initialisation
  this answers about half of the lookups of a full table; every weight is then trained,
  which makes the lookup exact and learns the rest (copying the asked names and fields into
  the answer, the format, end of turn and padding, pairs and records).  Token embeddings
  start at std {emb_std:g} and equal norms (the others 0.02); `rope_theta` is LLaDA-8B's
  500000, which leaves enough slow planes for the comparison.
* **Objective.**  Masked-diffusion SFT on the 32-token response (the prompt is never
  masked), plain cross-entropy over masked tokens, trailing EOS padding weighted 0.1.  60 %
  of rows mask every value and each other response token with probability 0.15, so values
  are learned with their name and field shown (a value predicted with its key masked only
  teaches a prior); 20 % use LLaDA's noise (each response token masked with one probability
  t ~ U(0, 1)); 20 % mask everything from a random cut on, as a block-wise sampler leaves
  it.
* **Curriculum.**  Tables of 1, 2, 4, then 8 members with bare system prompts (role line
  and table), then the full prompts with the rules paragraph; a stage ends when the running
  accuracy on masked values whose name and field are shown reaches {grow_at:g}.
  {stages}
* **Optimiser.**  AdamW (0.9, 0.98), no weight decay, peak lr {lr:g}, {warmup} warmup steps,
  constant until the full table size, then cosine decay to 10 % over {final_steps} steps (the
  schedule of the last invocation; see Regenerate);
  gradient clipping 1.0; batch {batch}; float32 on {threads} CPU thread{threads_s}.
* **Run.**  {steps} steps, {wall_min:.1f} min of a shared 2-core CPU, stopped by {stopped_by};
  final training loss (EMA) {loss_ema:.4f}; loss on the held-out set (fixed noise) {heldout_loss:.4f}; seed {seed}.

### Accuracy curve

Exact match during training on {n_valid} monitoring questions (training-stream tables of 8
members set aside for this, never trained on), decoded as `unmask` decodes by default for
this model: 32 tokens, blocks of 4, 16 steps, temperature 0, low-confidence remasking.

{curve}

## Regenerate

    tools/.venv/bin/python tools/tasks.py heldout --seed 0
    tools/.venv/bin/python tools/train.py --out runs/tiny --seed {seed}{resume_cmds}
    tools/.venv/bin/python tools/export.py --run runs/tiny --out models/tiny
    tools/.venv/bin/python tools/py_eval.py --model models/tiny --set data/tasks/heldout.jsonl --also-set data/tasks/heldout-seed1.jsonl --also-set data/tasks/heldout-small.jsonl --also-set data/tasks/heldout-small-seed1.jsonl --ref-set data/tasks/heldout-small.jsonl --ref-items 8 --out models/tiny/eval_python.json
    tools/.venv/bin/python tools/export.py --run runs/tiny --out models/tiny --scores models/tiny/eval_python.json
    scripts/evaluate-model.sh     # unmask eval, BiCache depth table, cache modes, quantized weights

Every batch and mask is drawn from (seed, step), and `ckpt.pt` (every 5 minutes and at the
end) holds the model, the optimiser and the curriculum state, so a stopped run continues
exactly with `--resume` (on the same PyTorch build; CPU float32 kernels may differ between
builds).

## Export check

`tools/export.py` reloads this folder with the numpy reference (`tools/llada_ref.py`) and
compares its logits with the PyTorch training forward on the same bf16 weights
(prompt + 32 masks): max |difference| {parity_max:.2e} (logits range about {logit_span:.0f});
the numpy reference with bf16 rounding at the reference points (as a bf16 PyTorch run
rounds activations) differs by at most {parity_bf16:.2e}: the recall head's attention scores
are large (about 100), so a run with bf16 activations is not token-exact with this model.
The runtime keeps activations in f32.  Details in `export.json`.

## Scores (Python reference sampler)

`tools/py_eval.py`: temperature 0, low_confidence remasking, no cache; exact match of the
text after the last `####` (special tokens skipped, cut at the first
`<|eot_id|>`/`<|endoftext|>`).

{scores}

## Scores in the runtime

`unmask eval` on lavapipe, every cache mode, quantized weights and the BiCache depth table
are measured by `scripts/evaluate-model.sh`: `eval_unmask*.md` here, and
`docs/benchmarks/cache-modes.md`, `quant-heldout.md` and `bicache-batch-heldout.md`.

{runtime_scores}

## Limits

A toy: it only knows this task format and its name and value pools; it is not a general
chat model.  Its questions have one wording each (the position of the asked name relative to
the answer is fixed).
"""


def curve_table(curve):
    if not curve:
        return "(no evaluation recorded)"
    tasks_seen = sorted({t for r in curve for t in r["per_task"]})
    lines = ["| step | minutes | table members | exact | " + " | ".join(tasks_seen) + " |",
             "|---|---|---|---|" + "---|" * len(tasks_seen)]
    for r in curve:
        cells = " | ".join(f"{100 * r['per_task'].get(t, 0):.0f} %" for t in tasks_seen)
        lines.append(f"| {r['step']} | {r['min']:.1f} | {r['members']} | {100 * r['exact']:.1f} % | {cells} |")
    return "\n".join(lines)


def scores_table(path):
    if not path or not os.path.exists(path):
        return "(not evaluated yet)"
    with open(path, encoding="utf-8") as f:
        s = json.load(f)
    lines = [f"gen_length {s['gen_length']}, block_length {s['block_length']}, steps {s['steps']}.", ""]
    for run in s["runs"]:
        lines.append(f"`{run['set']}` ({run['n']} items, {run['sampler']}):")
        lines.append("")
        lines.append("| task | correct | accuracy |")
        lines.append("|---|---|---|")
        for t in tasks.TASK_MIX:
            if t[0] in run["per_task"]:
                c, n = run["per_task"][t[0]]
                lines.append(f"| {t[0]} | {c}/{n} | {100 * c / n:.1f} % |")
        lines.append(f"| **overall** | {run['correct']}/{run['n']} | **{100 * run['accuracy']:.1f} %** |")
        lines.append("")
    return "\n".join(lines).rstrip()


def runtime_scores(out_dir):
    """The tables of the `unmask eval` runs in the folder (written by scripts/evaluate-model.sh)."""
    parts = []
    for name in ("eval_unmask.md", "eval_unmask-seed1.md"):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                parts.append(f"`{name}`:\n\n" + f.read().strip())
    return "\n\n".join(parts) or "(not measured yet)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="training output folder (ckpt.pt, tokenizer.json)")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "models", "tiny"))
    ap.add_argument("--scores", default=None, help="JSON written by tools/py_eval.py, for the model card")
    args = ap.parse_args()
    torch.set_num_threads(2)

    ck = torch.load(os.path.join(args.run, "ckpt.pt"), map_location="cpu", weights_only=False)
    cfg, state = ck["config"], ck["state"]
    tok = train.Tokenizer.from_file(os.path.join(args.run, "tokenizer.json"))
    ids = train.Ids(tok)
    if ids.vocab != cfg["vocab_size"] or ids.mask != cfg["mask_token_id"]:
        raise RuntimeError("tokenizer and checkpoint disagree")

    scores_path = os.path.abspath(args.scores) if args.scores else None
    # Only the files listed in the module docstring (and export.json) are written; anything
    # else in the folder (evaluation results, cache profiles) is left alone.
    os.makedirs(args.out, exist_ok=True)
    for stale in ("model.safetensors.index.json",):
        if os.path.exists(os.path.join(args.out, stale)):
            os.remove(os.path.join(args.out, stale))

    weights = hf_weights(ck["model"])
    st_bytes = fixture_common.write_safetensors(os.path.join(args.out, "model.safetensors"), weights)
    fixture_common.write_json(os.path.join(args.out, "config.json"), config_json(cfg))
    fixture_common.write_json(
        os.path.join(args.out, "generation_config.json"),
        {"_from_model_config": True, "bos_token_id": ids.bos, "eos_token_id": ids.eos, "transformers_version": "4.38.2"},
    )
    train.save_tokenizer(tok, os.path.join(args.out, "tokenizer.json"))
    special_ids = [tok.token_to_id(t) for t in llada_common.SPECIAL_TOKENS]
    fixture_common.write_json(os.path.join(args.out, "tokenizer_config.json"), make_fixture.tokenizer_config(special_ids))
    fixture_common.write_json(os.path.join(args.out, "special_tokens_map.json"), make_fixture.special_tokens_map())

    model = train.LLaDA(cfg)
    model.load_state_dict(ck["model"])
    model.eval()
    par = parity(args.out, model, cfg, tok)
    heldout_loss = sft_loss_on(model, tok, ids, os.path.join(REPO_ROOT, "data", "tasks", "heldout.jsonl"))
    n_params = sum(v.size for v in weights.values())

    items = list(tasks.train_items(0, 0, 40))
    p_lens = [len(train.encode_item(tok, ids, it)[0]) for it in items]
    s_lens = [len(tok.encode(it["system"], add_special_tokens=False).ids) for it in items]
    with open(os.path.join(REPO_ROOT, "data", "tasks", "heldout.jsonl"), encoding="utf-8") as f:
        n_heldout = sum(1 for _ in f)
    a = state["args"]
    stages = "; ".join(f"{s['members']} member{'s' if s['members'] > 1 else ''}"
                       f"{' (bare prompts)' if s.get('bare') else ''} until step {s['until_step']} ({s['min']:.1f} min)"
                       for s in state.get("stages", []))
    stopped = {"steps": "the end of its learning-rate schedule",
               "target": "reaching the target (the first monitoring evaluation at or above "
               f"{a.get('target', 0):g})"}.get(state.get("stopped_by"), state.get("stopped_by", "a checkpoint"))
    info = {
        "step": state["step"],
        "stopped_by": state.get("stopped_by", "checkpoint (run still going)"),
        "loss_ema": state["loss_ema"],
        "heldout_loss": heldout_loss,
        "elapsed_s": state["elapsed_s"],
        "seed": state["seed"],
        "n_params": int(n_params),
        "safetensors_bytes": int(st_bytes),
        "stages": state.get("stages", []),
        "curve": state.get("curve", []),
        "parity": par,
        "train_args": a,
    }
    fixture_common.write_json(os.path.join(args.out, "export.json"), info)
    card = CARD.format(
        n_params=n_params, n_params_m=n_params / 1e6, n_layers=cfg["n_layers"], d_model=cfg["d_model"],
        n_heads=cfg["n_heads"], head_dim=cfg["d_model"] // cfg["n_heads"], mlp=cfg["mlp_hidden_size"],
        vocab=cfg["vocab_size"], n_tok=tok.get_vocab_size(), first_empty=ids.mask + 1, last_row=cfg["vocab_size"] - 1,
        rope_theta=cfg["rope_theta"], max_seq=cfg["max_sequence_length"], st_bytes=st_bytes,
        n_ord=ids.bos, bos=ids.bos, eos=ids.eos, shi=ids.shi, ehi=ids.ehi, eot=ids.eot, mask=ids.mask,
        sys_tokens=np.mean(s_lens), prompt_tokens=np.mean(p_lens),
        share_gen=100 * (np.mean(s_lens) + 6) / (np.mean(p_lens) + train.GEN_LEN),
        n_heldout=n_heldout, offsets=", ".join(a["plant"].split(",")), emb_std=a["emb_std"],
        grow_at=a["grow_at"], threads_s="s" if a["threads"] > 1 else "",
        stages=("Stages: " + stages + ".") if stages else "",
        lr=a["lr"], warmup=a["warmup"], final_steps=a["final_steps"], batch=a["batch"], threads=a["threads"],
        steps=state["step"], wall_min=state["elapsed_s"] / 60, stopped_by=stopped,
        loss_ema=state["loss_ema"], heldout_loss=heldout_loss, seed=state["seed"],
        n_valid=len(train.valid_items(state["seed"])), curve=curve_table(state.get("curve", [])),
        parity_max=max(r["max_abs_numpy_vs_torch_bf16_weights"] for r in par),
        parity_bf16=max(r["max_abs_numpy_bf16_rounding_vs_torch_bf16_weights"] for r in par),
        logit_span=max(r["logit_range"][1] - r["logit_range"][0] for r in par),
        scores=scores_table(scores_path), runtime_scores=runtime_scores(args.out),
        resume_cmds=("\n    # then, from the checkpoint it stopped at, on to the end of the learning-rate decay:\n"
                     "    # (the first invocation ran on one thread with --final-steps 1500 and stopped at step 800,\n"
                     "    # the first monitoring evaluation at 100 %)\n"
                     "    tools/.venv/bin/python tools/train.py --out runs/tiny --resume --threads 2 --final-steps 1025 --target 0"
                     if a.get("final_steps") == 1025 else "    # --resume continues a stopped run"),
    )
    fixture_common.write_text(os.path.join(args.out, "README.md"), card)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
    print(json.dumps({k: v for k, v in info.items() if k not in ("train_args", "curve")}, indent=1))
    print(f"wrote {args.out} ({size} bytes)")
    if size >= 20 * 1024 * 1024:
        raise SystemExit("model folder is larger than 20 MB")


if __name__ == "__main__":
    main()
