"""lm-evaluation-harness through tools/lm_eval_unmask.py against `unmask serve` on the bundled
model: lm_eval.simple_evaluate runs a multiple-choice task made of
data/tasks/heldout-small-choices.jsonl (plain text, then again under --apply_chat_template), a
generation task and a perplexity task (the items' texts, and one document longer than the
model's positions, scored in rolling windows). Every log-likelihood, is_greedy and generation
lm-eval logged must be the server's own answer to the same request sent here directly, and
`acc` must be the argmax of the logged log-likelihoods.

    python3 tools/lm_eval_check.py --unmask target/debug/unmask [--model models/tiny] [--items 2]

Needs lm_eval (no PyTorch; scripts/test-server.sh makes a venv with it).
"""

import argparse
import json
import os
import sys
import tempfile

import lm_eval

import lm_eval_unmask
from serve_harness import ROOT, Server

failures = []
MC_NUM = 4


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def write_docs(path, items):
    """Docs of the multiple-choice task: the item's system prompt and question as one text,
    its choices as the reply "#### <choice>", the answer's index as the label."""
    with open(path, "w") as f:
        for item in items:
            f.write(json.dumps({
                "context": f"{item['system']}\n\n{item['user']}",
                "options": [f"#### {c}" for c in item["choices"]],
                "label": item["choices"].index(item["answer"]),
            }) + "\n")


def task(name, path, **fields):
    """A task over the docs file at `path` (its one split is the test split)."""
    return {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": path}},
            "test_split": "test", **fields}


def mc_task(name, path):
    return task(name, path, output_type="multiple_choice", doc_to_text="{{context}}",
                doc_to_choice="{{options}}", doc_to_target="{{label}}", target_delimiter="\n",
                metric_list=[{"metric": "acc"}])


def gen_task(name, path):
    return task(name, path, output_type="generate_until", doc_to_text="{{context}}\n",
                doc_to_target="{{options[label]}}",
                generation_kwargs={"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False},
                metric_list=[{"metric": "exact_match"}])


def ppl_task(name, path):
    return task(name, path, output_type="loglikelihood_rolling", doc_to_text="",
                doc_to_target="{{context}}",
                metric_list=[{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}])


def write_ppl_docs(path, items):
    """The items' texts as documents, and one of all of them over and over, longer than the
    bundled model's 1024 positions."""
    texts = [f"{item['system']}\n\n{item['user']}" for item in items]
    long = "\n\n".join(texts)
    while len(long) < 6000:
        long += "\n\n" + long
    with open(path, "w") as f:
        for text in texts + [long]:
            f.write(json.dumps({"context": text}) + "\n")


def args_of(sample):
    """The (context, continuation-or-gen_kwargs) pairs lm-eval sent for one doc."""
    args = sample["arguments"]
    # A list of [arg_0, arg_1] (lm_eval 0.4.13), or {"gen_args_0": {"arg_0", "arg_1"}, ...}.
    if isinstance(args, dict):
        args = list(args.values())
    return [(a["arg_0"], a["arg_1"]) if isinstance(a, dict) else tuple(a) for a in args]


def direct_scores(server, context, continuations):
    body = {**lm_eval_unmask.UnmaskLM.prompt_fields(context), "continuations": continuations,
            "mc_num": MC_NUM, "mc_batch": MC_NUM, "seed": 0, "greedy": True}
    status, answer, _ = server.request("POST", "/v1/loglikelihood", body)
    if status != 200:
        raise RuntimeError(f"/v1/loglikelihood answered {status}: {answer}")
    return [(d["log_likelihood"], d["is_greedy"]) for d in answer["data"]]


def check_mc(server, results, task, chat):
    samples = results["samples"][task]
    check(len(samples) > 0, f"{task}: lm-eval logged {len(samples)} docs")
    for s in samples:
        pairs = args_of(s)
        context = pairs[0][0]
        check(all(c == context for c, _ in pairs), f"{task} doc {s['doc_id']}: one context")
        check(context.startswith(lm_eval_unmask.CHAT_TAG) == chat,
              f"{task} doc {s['doc_id']}: sent as {'chat messages' if chat else 'a text prompt'}")
        logged = [(float(r[0][0]), bool(r[0][1])) for r in s["resps"]]
        direct = direct_scores(server, context, [c for _, c in pairs])
        check(all(abs(a[0] - b[0]) <= 1e-9 * max(1.0, abs(b[0])) and a[1] == b[1]
                  for a, b in zip(logged, direct)) and len(logged) == len(direct),
              f"{task} doc {s['doc_id']}: lm-eval's (log-likelihood, is_greedy) are the "
              f"server's: {logged} / {direct}")
        best = max(range(len(logged)), key=lambda i: logged[i][0])
        check(float(s["acc"]) == float(best == s["target"]),
              f"{task} doc {s['doc_id']}: acc {s['acc']} is the argmax's (pick {best}, "
              f"target {s['target']})")
    print(f"     {task}: acc {results['results'][task]['acc,none']:.3f}")


def check_ppl(server, results, task):
    windows = []
    for s in results["samples"][task]:
        args = s["arguments"]
        args = list(args.values()) if isinstance(args, dict) else args
        text = args[0]["arg_0"] if isinstance(args[0], dict) else args[0][0]
        logged = s["resps"][0]
        while isinstance(logged, (list, tuple)):
            logged = logged[0]
        body = {"prompt": "", "continuation": text, "rolling": True, "mc_num": MC_NUM,
                "mc_batch": MC_NUM, "seed": 0}
        status, answer, _ = server.request("POST", "/v1/loglikelihood", body)
        direct = answer["data"][0] if status == 200 else {}
        windows.append(direct.get("windows"))
        check(status == 200 and abs(float(logged) - direct["log_likelihood"])
              <= 1e-9 * max(1.0, abs(direct["log_likelihood"])),
              f"{task} doc {s['doc_id']}: lm-eval's rolling log-likelihood {logged} is the "
              f"server's ({direct.get('windows')} window(s)): {answer if status != 200 else ''}")
    check(max(w or 0 for w in windows) > 1, f"{task}: a document ran in rolling windows {windows}")
    r = results["results"][task]
    print(f"     {task}: word_perplexity {r['word_perplexity,none']:.1f}, "
          f"bits_per_byte {r['bits_per_byte,none']:.3f}")


def check_gen(server, results, task):
    for s in results["samples"][task]:
        (context, kwargs), = args_of(s)
        body = {"prompt": context, "max_tokens": kwargs["max_gen_toks"], "temperature": 0,
                "stop": kwargs["until"], "seed": 0}
        status, answer, _ = server.request("POST", "/v1/completions", body)
        text = answer["choices"][0]["text"] if status == 200 else f"<{status}: {answer}>"
        check(s["resps"][0][0] == text,
              f"{task} doc {s['doc_id']}: lm-eval's generation is /v1/completions': {text!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--unmask", default="target/debug/unmask")
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--items", type=int, default=2)
    a = ap.parse_args()
    with open(os.path.join(ROOT, "data/tasks/heldout-small-choices.jsonl")) as f:
        items = [json.loads(line) for line in f if line.strip()][: a.items]
    tmp = tempfile.mkdtemp(prefix="lm-eval-check.")
    docs = os.path.join(tmp, "choices.jsonl")
    write_docs(docs, items)
    ppl_docs = os.path.join(tmp, "texts.jsonl")
    write_ppl_docs(ppl_docs, items)
    server = Server(a.unmask, a.model)
    try:
        lm = lm_eval_unmask.UnmaskLM(base_url=server.url, mc_num=MC_NUM, mc_batch=MC_NUM)
        run = dict(model=lm, log_samples=True, bootstrap_iters=0)
        plain = lm_eval.simple_evaluate(
            tasks=[mc_task("unmask_choices", docs), gen_task("unmask_generate", docs),
                   ppl_task("unmask_perplexity", ppl_docs)], **run)
        check_mc(server, plain, "unmask_choices", chat=False)
        check_gen(server, plain, "unmask_generate")
        check_ppl(server, plain, "unmask_perplexity")
        chat = lm_eval.simple_evaluate(tasks=[mc_task("unmask_choices_chat", docs)],
                                       apply_chat_template=True, **run)
        check_mc(server, chat, "unmask_choices_chat", chat=True)
    finally:
        stderr = server.stop()
    check("panicked" not in stderr, "the server never panicked")
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
