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


def tokenizer_config(tok):
    decoder = {}
    for t in train.SPECIAL_TOKENS:
        decoder[str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": decoder,
        "bos_token": "<|startoftext|>",
        "chat_template": make_fixture.CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "fast_tokenizer": True,
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


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
    """Mean SFT loss over a task set (fixed masking noise from seed 0), float32 weights."""
    with open(path, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    # single-turn conversations: the prompt, then the GEN_LEN response region
    seqs = [train.encode_conversation(tok, ids, [it]) for it in items]
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            loss, _ = train.sft_loss(model, seqs[i : i + batch], ids, gen)
            total += loss.item() * len(seqs[i : i + batch])
    return total / len(seqs)


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
# unmask-tiny: a {n_params_m:.2f} M-parameter LLaDA model for shared-system-prompt QA

A masked-diffusion language model with the **LLaDA architecture, tensor names, tokenizer
layout, chat template and training objective**, small enough to run anywhere.  It answers
questions whose answers are only in a long system prompt shared by many requests, so it
can show whether a prefix/KV cache keeps answers right (a random-weight model can only
show numerical parity).

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
split one per token; it has no post-processor, so nothing is added to encoded text (the
chat template writes BOS itself).

## Data

`tools/tasks.py` generates every item from a seed.  A prompt group is one system prompt:
a role line, four formatting rules in random order (including "Put the final answer
after ####" and the fields and separator to use for records) and a table of 6-8 members,
each with two text attributes (from city, colour, pet, sport, fruit) and two numbers (from
age, coins, score), written one fact per line (`- Alice city Paris`, `- Alice age 34`).  Names (40) and values (16 per attribute) come from fixed pools and are
re-assigned at random in every group, so the model must read the table.  System prompts
are about {sys_tokens:.0f} tokens, whole prompts (system + user, chat template) about
{prompt_tokens:.0f} tokens: the shared system prompt is about {share:.0f} % of the prompt
tokens ({share_gen:.0f} % counting the 32 generated tokens).

| task | example question | answer |
|---|---|---|
| lookup | Which city is Alice from? | `Paris` |
| combine | What is the age of the person who plays golf? / Who is older, Alice or Bruno? | `34` / `Bruno` |
| arithmetic | How many coins do Alice and Bruno have together? | `124` |
| format | Give the record of Alice. | `Alice / Paris / 34` (separator and fields from the rules) |

Training groups are streamed from the training seed (16 questions per group; about
{groups_seen} different system prompts were seen).  The held-out set
`data/tasks/heldout.jsonl` ({n_heldout} items, 8 system prompts from a separate seed,
never seen in training) and `data/tasks/heldout-small.jsonl` (40 of them) are for
evaluation.

## Objective and training

LLaDA SFT: the prompt is never masked; the response region is exactly 32 tokens
(`#### answer`, `<|eot_id|>`, then `<|endoftext|>` padding, which the model learns to
predict).  Per sequence t ~ U(0, 1), p = (1 - 1e-3) t + 1e-3, each response token is
replaced by `<|mdm_mask|>` with probability p, and the loss is the cross-entropy over
masked tokens divided by p, summed and divided by 32 x batch.

{phases}

| | |
|---|---|
| optimiser | AdamW (beta 0.9/0.95, weight decay 0.1), linear warmup, cosine decay to 10 % of the peak lr, gradient clipping 1.0 (fresh optimiser state in each phase) |
| batch | {batch} sequences, grouped by similar length (shorter ones padded at the end, padding masked as keys) |
| steps | {steps_total} in all |
| sequences seen | {seqs_seen} |
| wall time | {wall_min:.1f} min in all on a shared 2-core CPU (float32, `torch.set_num_threads(2)`, `nice -n 5`) |
| final training loss (EMA over the last steps, objective mix of the last phase) | {loss_ema:.4f} |
| SFT loss on the held-out set (fixed masking noise) | {heldout_loss:.4f} |
| seed | {seed} |

## Regenerate

    tools/.venv/bin/python tools/tasks.py heldout --seed 0
{train_cmds}
    tools/.venv/bin/python tools/export.py --run runs/tiny --out models/tiny
    tools/.venv/bin/python tools/py_eval.py --model models/tiny --set data/tasks/heldout.jsonl --ref-set data/tasks/heldout-small.jsonl --ref-items 12 --out models/tiny/eval_python.json
    tools/.venv/bin/python tools/export.py --run runs/tiny --out models/tiny --scores models/tiny/eval_python.json

Everything is derived from the seed; each phase is repeated exactly by its schedule
length (`--steps`) and the step it reached (`--stop-step`); `--minutes` is only a safety
limit (on the same PyTorch build; CPU float32 kernels may differ between builds).

## Export check

`tools/export.py` reloads this folder with the numpy reference (`tools/llada_ref.py`) and
compares its logits with the PyTorch training forward on the same bf16 weights
(prompt + 32 masks): max |difference| {parity_max:.2e} (logits range about {logit_span:.0f});
the numpy reference with bf16 rounding at the reference points differs by at most
{parity_bf16:.2e}.  Details in `export.json`.

## Status

{status}

## Scores (Python reference sampler)

`tools/py_eval.py`: gen_length 32, block_length 32, steps 32, temperature 0,
low_confidence remasking, no cache; exact match of the text after the last `####`
(special tokens skipped, cut at the first `<|eot_id|>`/`<|endoftext|>`).

{scores}

## Scores (`unmask eval`, lavapipe)

<!-- UNMASK-EVAL: to be filled in from `unmask eval --model models/tiny --set data/tasks/heldout.jsonl --cache none --json` -->

| cache | lookup | combine | arithmetic | format | overall |
|---|---|---|---|---|---|
| none | | | | | |

## Limits

A toy: it only knows this task format and its small name and value pools; it is not a
general chat model.
"""


def status_text(path):
    """Whether the Python-side scores meet the targets (lookup >= 90 %, overall >= 70 %)."""
    if not path or not os.path.exists(path):
        return "Not evaluated yet."
    with open(path, encoding="utf-8") as f:
        s = json.load(f)
    run = s["runs"][0]
    c, n = run["per_task"].get("lookup", (0, 0))
    look = c / n if n else 0.0
    ok = look >= 0.9 and run["accuracy"] >= 0.7
    verdict = "meets" if ok else "**does not meet**"
    text = (f"On `{run['set']}` this checkpoint {verdict} the targets of at least 90 % exact match on "
            f"lookups and at least 70 % overall (Python sampler: lookup {100 * look:.1f} %, overall "
            f"{100 * run['accuracy']:.1f} %).")
    if not ok:
        text += (" The training budget (a shared 2-core CPU, about an hour, most of it with other jobs "
                 "competing for the cores) gave only the number of steps listed above; the model learned "
                 "the response format (`#### ...`, `<|eot_id|>`, EOS padding) but its answers are still "
                 "nearly constant (the same few numbers and names whatever the table says): it has not yet "
                 "learned to read the table. The files are complete and in the LLaDA layout, "
                 "so the runtime can load and run them; a longer run of the same scripts (more steps) is "
                 "what is missing.")
    return text


def scores_table(path):
    if not path or not os.path.exists(path):
        return "(not evaluated yet)"
    with open(path, encoding="utf-8") as f:
        s = json.load(f)
    lines = []
    for run in s["runs"]:
        lines.append(f"`{run['set']}` ({run['n']} items, {run['sampler']}):")
        lines.append("")
        lines.append("| task | correct | accuracy |")
        lines.append("|---|---|---|")
        for t in ["lookup", "combine", "arithmetic", "format"]:
            if t in run["per_task"]:
                c, n = run["per_task"][t]
                lines.append(f"| {t} | {c}/{n} | {100 * c / n:.1f} % |")
        lines.append(f"| **overall** | {run['correct']}/{run['n']} | **{100 * run['accuracy']:.1f} %** |")
        lines.append("")
    return "\n".join(lines).rstrip()


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
    st_bytes = make_fixture.write_safetensors(os.path.join(args.out, "model.safetensors"), weights)
    make_fixture.write_json(os.path.join(args.out, "config.json"), config_json(cfg))
    make_fixture.write_json(
        os.path.join(args.out, "generation_config.json"),
        {"_from_model_config": True, "bos_token_id": ids.bos, "eos_token_id": ids.eos, "transformers_version": "4.38.2"},
    )
    train.save_tokenizer(tok, os.path.join(args.out, "tokenizer.json"))
    make_fixture.write_json(os.path.join(args.out, "tokenizer_config.json"), tokenizer_config(tok))
    make_fixture.write_json(os.path.join(args.out, "special_tokens_map.json"), make_fixture.special_tokens_map())

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
    phases, chain = [], [(state, args.run)]
    while chain[-1][0]["args"].get("init"):
        prev_path = chain[-1][0]["args"]["init"]
        prev = torch.load(prev_path, map_location="cpu", weights_only=False)["state"]
        chain.append((prev, os.path.dirname(prev_path)))
    chain.reverse()
    cmds, steps_total, seqs_total, wall_total = [], 0, 0, 0.0
    for k, (st, run_dir) in enumerate(chain):
        pa = st["args"]
        cmd = (f"    nice -n 5 tools/.venv/bin/python tools/train.py --out {os.path.relpath(run_dir, REPO_ROOT)} "
               f"--seed {pa['seed']} --steps {st['total_steps']} --stop-step {st['step']} --batch {pa['batch']} "
               f"--d-model {pa['d_model']} --n-heads {pa['n_heads']} --n-layers {pa['n_layers']} --mlp {pa['mlp']} "
               f"--lr {pa['lr']:g} --warmup {pa['warmup']} --minutes 90")
        if pa.get("init"):
            cmd += f" --init {os.path.relpath(pa['init'], REPO_ROOT) if os.path.isabs(pa['init']) else pa['init']}"
        if pa.get("first_pool"):
            cmd += f" --first-pool {pa['first_pool']}"
        if pa.get("pt_frac"):
            cmd += f" --pt-frac {pa['pt_frac']:g}"
        if k + 1 < len(chain):
            nxt = chain[k + 1][0]["args"]["init"]
            cmd += f"\n    cp {os.path.relpath(run_dir, REPO_ROOT)}/ckpt.pt {nxt}"
        cmds.append(cmd)
        steps_total += st["step"]
        seqs_total += st["step"] * pa["batch"]
        wall_total += st["elapsed_s"]
        obj = "the SFT objective only"
        if pa.get("pt_frac"):
            obj = (f"per row, with probability {pa['pt_frac']:g} the masked-diffusion pretraining objective over "
                   "the whole sequence (prompt and response masked alike, loss divided by p and the sequence "
                   "length), otherwise the SFT objective")
        phases.append(f"{k + 1}. {st['step']} steps (schedule of {st['total_steps']}, stopped by "
                      f"{st.get('stopped_by', 'a periodic checkpoint')}), peak lr {pa['lr']:g}, {pa['warmup']} warmup steps, "
                      f"{obj}" + (f", starting from the weights of phase {k}" if k else ", from a random initialisation")
                      + f"; {st['elapsed_s'] / 60:.1f} min.")
    phase_text = "Training ran in {} phase{}:\n\n".format(len(chain), "s" if len(chain) > 1 else "") + "\n".join(phases)
    if len(chain) > 1:
        phase_text += ("\n\nThe whole-sequence objective gives many more targets per sequence (the repeated "
                       "fact lines teach the model to match a name and a field and copy what follows) than the "
                       "32-token response alone; it was added when SFT alone was learning too slowly on this CPU.")
    info = {
        "step": state["step"],
        "total_steps": state["total_steps"],
        "stopped_by": state.get("stopped_by", "checkpoint (run still going)"),
        "loss_ema": state["loss_ema"],
        "heldout_sft_loss": heldout_loss,
        "elapsed_s": state["elapsed_s"],
        "seed": state["seed"],
        "n_params": int(n_params),
        "safetensors_bytes": int(st_bytes),
        "parity": par,
        "train_args": a,
    }
    make_fixture.write_json(os.path.join(args.out, "export.json"), info)
    card = CARD.format(
        n_params=n_params, n_params_m=n_params / 1e6, n_layers=cfg["n_layers"], d_model=cfg["d_model"],
        n_heads=cfg["n_heads"], head_dim=cfg["d_model"] // cfg["n_heads"], mlp=cfg["mlp_hidden_size"],
        vocab=cfg["vocab_size"], n_tok=tok.get_vocab_size(), first_empty=ids.mask + 1, last_row=cfg["vocab_size"] - 1,
        rope_theta=cfg["rope_theta"], max_seq=cfg["max_sequence_length"], st_bytes=st_bytes,
        n_ord=ids.bos, bos=ids.bos, eos=ids.eos, shi=ids.shi, ehi=ids.ehi, eot=ids.eot, mask=ids.mask,
        sys_tokens=np.mean(s_lens), prompt_tokens=np.mean(p_lens), share=100 * np.mean(s_lens) / np.mean(p_lens),
        share_gen=100 * np.mean(s_lens) / (np.mean(p_lens) + train.GEN_LEN),
        groups_seen=seqs_total // 16, n_heldout=n_heldout,
        batch=a["batch"], steps_total=steps_total, seqs_seen=seqs_total, wall_min=wall_total / 60,
        loss_ema=state["loss_ema"], heldout_loss=heldout_loss, seed=state["seed"], phases=phase_text, train_cmds="\n".join(cmds),
        parity_max=max(r["max_abs_numpy_vs_torch_bf16_weights"] for r in par),
        parity_bf16=max(r["max_abs_numpy_bf16_rounding_vs_torch_bf16_weights"] for r in par),
        logit_span=max(r["logit_range"][1] - r["logit_range"][0] for r in par),
        scores=scores_table(scores_path), status=status_text(scores_path),
    )
    make_fixture.write_text(os.path.join(args.out, "README.md"), card)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
    print(json.dumps({k: v for k, v in info.items() if k != "train_args"}, indent=1))
    print(f"wrote {args.out} ({size} bytes)")
    if size >= 20 * 1024 * 1024:
        raise SystemExit("model folder is larger than 20 MB")


if __name__ == "__main__":
    main()
