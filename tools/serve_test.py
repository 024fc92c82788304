"""Tests `unmask serve` on a loopback port: the official `openai` Python client (chat, a
streamed chat, a text completion, one infilled before a `suffix`, the models list, `n`
choices whole and streamed), every
error path over raw HTTP, the queue's 429, a client that disconnects mid-stream, and the
metrics after it all; then a DiffusionGemma folder (`--dgemma`, the test fixture by default)
served the same way.

    python3 tools/serve_test.py --unmask target/debug/unmask [--model models/tiny]

Needs `pip install openai` (scripts/test-server.sh makes a venv with it). Answers at
temperature 0 are compared with `unmask generate` for the same request.
"""

import argparse
import concurrent.futures
import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.parse

import openai

from serve_harness import SYSTEM, Server, generate

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTIONS = ["What is the city of Bella?", "What is the pet of Martin?", "Give the record of Peter."]
# Small requests: 32 tokens in one block of 32, 32 steps.
N, STEPS, BLOCK = 32, 32, 32

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def chat_body(user, system=SYSTEM, **extra):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return {"messages": messages, "max_tokens": N, "steps": STEPS, "block_length": BLOCK,
            "temperature": 0, **extra}


def openai_client_cases(server, unmask, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    models = client.models.list()
    ids = [m.id for m in models.data]
    check(len(ids) == 1, f"models.list lists one model: {ids}")
    name = ids[0]

    expected = generate(unmask, model, SYSTEM, QUESTIONS[0], N, STEPS, BLOCK, "bicache-dual")
    r = client.chat.completions.create(
        model=name,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
        max_tokens=N, temperature=0, extra_body={"steps": STEPS, "block_length": BLOCK},
    )
    text = r.choices[0].message.content
    check(text == expected, f"chat completion equals unmask generate: {text!r} vs {expected!r}")
    check(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason}")
    check(r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens,
          f"usage adds up: {r.usage}")
    ext = r.model_extra.get("unmask", {})
    check(ext.get("cache") == "bicache-dual", f"ran bicache-dual: {ext.get('cache')}")

    pieces, finish, usage = [], None, None
    stream = client.chat.completions.create(
        model=name,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
        max_tokens=N, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"steps": STEPS, "block_length": BLOCK},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    check("".join(pieces) == expected, f"streamed pieces join to the answer: {pieces}")
    check(finish == r.choices[0].finish_reason, f"stream ends with finish_reason {finish}")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens,
          f"stream usage chunk: {usage}")

    # Text completion of token ids and of text, without a shared prefix (fast-dllm-dual).
    expected_none = generate(unmask, model, None, QUESTIONS[1], N, STEPS, BLOCK, "fast-dllm-dual")
    r = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=N,
        temperature=0, extra_body={"steps": STEPS, "block_length": BLOCK, "cache": "fast-dllm-dual"},
    )
    check(r.choices[0].message.content == expected_none,
          f"a chat without a system prompt equals unmask generate: {r.choices[0].message.content!r}")
    # dLLM-Cache with the request's own settings equals `unmask generate` with the same flags.
    expected_dllm = generate(unmask, model, SYSTEM, QUESTIONS[1], N, STEPS, BLOCK, "dllm-cache",
                             "--response-interval", "3", "--refresh-ratio", "0.5")
    r = client.chat.completions.create(
        model=name,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}],
        max_tokens=N, temperature=0,
        extra_body={"steps": STEPS, "block_length": BLOCK, "cache": "dllm-cache",
                    "response_interval": 3, "refresh_ratio": 0.5},
    )
    d = r.model_extra.get("unmask", {}).get("dllm_cache") or {}
    check(r.choices[0].message.content == expected_dllm,
          f"dllm-cache equals unmask generate: {r.choices[0].message.content!r} vs {expected_dllm!r}")
    check(d.get("response_interval") == 3 and d.get("refresh_ratio") == 0.5 and d.get("verify_steps", 0) > 0,
          f"the dllm_cache report carries the request's settings: {d}")
    c = client.completions.create(model=name, prompt="Bella city", max_tokens=N, temperature=0,
                                  extra_body={"steps": STEPS, "block_length": BLOCK})
    check(isinstance(c.choices[0].text, str) and c.usage.prompt_tokens > 0,
          f"text completion: {c.choices[0].text!r}, usage {c.usage}")
    # Infilling through OpenAI's suffix: the answer's start before a given end, as `unmask
    # generate --suffix` gives it (prompt ids from the CLI), whole and streamed; the suffix
    # counts as prompt tokens.
    cli = subprocess.run([unmask, "generate", "--model", model, "--system", SYSTEM, "--prompt", QUESTIONS[0],
                          "--suffix", " city : Lima", "--gen-length", "2", "--steps", "2", "--block-length", "2",
                          "--json"], capture_output=True, text=True, check=True)
    cli = json.loads(cli.stdout)
    infill = dict(model=name, prompt=cli["prompt_ids"], suffix=" city : Lima", max_tokens=2, temperature=0,
                  extra_body={"steps": 2, "block_length": 2, "cache": "none"})
    whole = client.completions.create(**infill)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **infill)
                       if chunk.choices)
    check(whole.choices[0].text == cli["text"] == streamed and cli["text"].startswith("####"),
          f"a completion with a suffix answers as unmask generate --suffix, whole and streamed: "
          f"{whole.choices[0].text!r}, {cli['text']!r}, {streamed!r}")
    check(whole.usage.prompt_tokens == len(cli["prompt_ids"]) + cli["suffix_len"],
          f"the suffix counts as prompt tokens: {whole.usage}")

    choices_cases(client, name)
    logprobs_cases(client, name, unmask, model)
    tokenize_cases(server, client, name)

    try:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "q"}], max_tokens=3,
                                       extra_body={"block_length": 2})
        check(False, "the client raises on a bad request")
    except openai.BadRequestError as e:
        check(e.body.get("param") == "block_length", f"the client sees the error naming the field: {e.body}")


def logprobs_cases(client, name, unmask, model):
    """Each answer token's log-probability: the CLI's for the same request, whole and
    streamed, in both of OpenAI's shapes; nothing when not asked for."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    settings = {"steps": STEPS, "block_length": BLOCK, "cache": "none"}
    ask = dict(model=name, messages=messages, max_tokens=N, temperature=0, extra_body=settings)
    r = client.chat.completions.create(logprobs=True, **ask)
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    spelled = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
    check(content and spelled == text and all(t.logprob <= 0 for t in content),
          f"logprobs: one entry per answer token, spelling the text: {spelled!r} vs {text!r}")
    cli = subprocess.run([unmask, "generate", "--model", model, "--system", SYSTEM, "--prompt", QUESTIONS[0],
                          "--gen-length", str(N), "--steps", str(STEPS), "--block-length", str(BLOCK),
                          "--json", "--logprobs"], capture_output=True, text=True, check=True)
    cli_lps = [lp for lp in json.loads(cli.stdout)["logprobs"][:len(content)]]
    check(all(abs(a - t.logprob) <= 1e-6 for a, t in zip(cli_lps, content)),
          f"logprobs equal unmask generate --logprobs: {cli_lps} vs {[t.logprob for t in content]}")
    streamed = []
    for chunk in client.chat.completions.create(logprobs=True, stream=True, **ask):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed.extend((t.token, t.logprob) for t in c.logprobs.content)
    check(streamed == [(t.token, t.logprob) for t in content],
          f"streamed logprobs come with their text, each once: {streamed}")
    plain = client.chat.completions.create(**ask)
    check(plain.choices[0].logprobs is None and plain.choices[0].message.content == text,
          "without logprobs: none, and the same answer")
    # (A prompt and canvas on which the bundled model writes some text before its end.)
    c = client.completions.create(model=name, prompt="Hello, my name", max_tokens=16, temperature=0, logprobs=0,
                                  extra_body={"steps": 8, "block_length": 8, "cache": "none"})
    lp = c.choices[0].logprobs
    check(c.choices[0].text and lp.tokens and "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
          and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0,
          f"completions logprobs: tokens spell the text at their offsets: {lp}")
    # The most likely alternatives at each token's step: greedy decoding committed the first.
    top = client.chat.completions.create(logprobs=True, top_logprobs=3, **ask).choices[0].logprobs.content
    check([(t.token, t.logprob) for t in top] == [(t.token, t.logprob) for t in content]
          and all(len(t.top_logprobs) == 3 and (t.top_logprobs[0].token, t.top_logprobs[0].logprob)
                  == (t.token, t.logprob) for t in top)
          and all(a.logprob >= b.logprob for t in top for a, b in zip(t.top_logprobs, t.top_logprobs[1:])),
          f"top_logprobs 3: three alternatives per token, the committed one first: "
          f"{[(a.token, round(a.logprob, 3)) for a in top[-1].top_logprobs]}")
    c = client.completions.create(model=name, prompt="Hello, my name", max_tokens=16, temperature=0, logprobs=2,
                                  extra_body={"steps": 8, "block_length": 8, "cache": "none"})
    lp = c.choices[0].logprobs
    check(lp.top_logprobs and all(len(d) <= 2 and tok in d for d, tok in zip(lp.top_logprobs, lp.tokens)),
          f"completions logprobs 2: a map of two alternatives per token: {lp.top_logprobs}")
    logit_bias_cases(client, ask, content, unmask, model)


def logit_bias_cases(client, ask, content, unmask, model):
    """OpenAI's logit_bias bans the answer's last token (the server answers as `unmask
    generate --logit-bias` does) and penalties are taken; neutral values change nothing."""
    cli = lambda *flags: json.loads(subprocess.run(
        [unmask, "generate", "--model", model, "--system", SYSTEM, "--prompt", QUESTIONS[0], "--gen-length", str(N),
         "--steps", str(STEPS), "--block-length", str(BLOCK), "--json", *flags],
        capture_output=True, text=True, check=True).stdout)
    last = cli()["ids"][len(content) - 1]
    banned = client.chat.completions.create(logit_bias={str(last): -100}, **ask).choices[0].message.content
    want = cli("--logit-bias", f"{last}=-100")["text"]
    text = "".join(t.token for t in content)
    check(banned == want and banned != text and content[-1].token not in banned,
          f"logit_bias bans token {last} ({content[-1].token!r}): {banned!r} (unmask generate: {want!r}), not {text!r}")
    neutral = client.chat.completions.create(logit_bias={}, presence_penalty=0, frequency_penalty=0, **ask)
    check(neutral.choices[0].message.content == text, "neutral logit_bias and penalties change nothing")
    penalised = client.chat.completions.create(presence_penalty=1.5, frequency_penalty=0.5, **ask)
    want = cli("--presence-penalty", "1.5", "--frequency-penalty", "0.5")["text"]
    check(penalised.choices[0].message.content == want,
          f"penalties answer as unmask generate's: {penalised.choices[0].message.content!r}")
    # vLLM's extensions, as its clients send them (extra_body).
    extra = {**ask["extra_body"], "repetition_penalty": 1.3, "min_p": 0.2}
    vllm = client.chat.completions.create(**{**ask, "extra_body": extra})
    want = cli("--repetition-penalty", "1.3", "--min-p", "0.2")["text"]
    check(vllm.choices[0].message.content == want,
          f"repetition_penalty and min_p answer as unmask generate's: {vllm.choices[0].message.content!r}")


def tokenize_cases(server, client, name):
    """/tokenize gives the ids a chat runs (their count is the answer's prompt_tokens) and
    those logit_bias names; /detokenize turns them back into the text."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    status, t, _ = server.request("POST", "/tokenize", {"messages": messages}, AUTH)
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=N, temperature=0,
                                       extra_body={"steps": STEPS, "block_length": BLOCK, "cache": "none"})
    check(status == 200 and t["count"] == len(t["tokens"]) == r.usage.prompt_tokens and t["max_model_len"] > 0,
          f"/tokenize counts a chat's prompt as usage does: {t.get('count')} vs {r.usage.prompt_tokens}")
    status, t, _ = server.request("POST", "/tokenize", {"prompt": " Lima", "return_token_strs": True}, AUTH)
    check(status == 200 and len(t["tokens"]) == len(t["token_strs"]) >= 1,
          f"/tokenize a word with its token strings: {t}")
    banned = client.chat.completions.create(model=name, messages=messages, max_tokens=N, temperature=0,
                                            logit_bias={str(i): -100 for i in t["tokens"]},
                                            extra_body={"steps": STEPS, "block_length": BLOCK, "cache": "none"})
    check("Lima" in r.choices[0].message.content and "Lima" not in banned.choices[0].message.content,
          f"the ids /tokenize gives ban the word: {r.choices[0].message.content!r} -> "
          f"{banned.choices[0].message.content!r}")
    status, d, _ = server.request("POST", "/detokenize", {"tokens": t["tokens"]}, AUTH)
    check(status == 200 and d["prompt"] == " Lima", f"/detokenize gives the text back: {d}")
    status, e, _ = server.request("POST", "/tokenize", {"prompt": "a", "messages": messages}, AUTH)
    check(status == 400 and e["error"]["param"] == "prompt", f"/tokenize with both names the field: {e}")
    status, _, _ = server.request("POST", "/tokenize", {"prompt": "a"}, {})
    check(status == 401, "/tokenize needs the API key")


def choices_cases(client, name, extra=None, seed=5, what="", messages=None):
    """`n` = 2: choice i is the answer with the seed `seed + i`, whole and streamed; usage
    counts the prompt once and both choices' tokens. Returns the two answers."""
    extra = extra if extra is not None else {"steps": STEPS, "block_length": BLOCK, "temperature": 0.9}
    messages = messages or [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[2]}]
    alone = [client.chat.completions.create(model=name, messages=messages, max_tokens=N, seed=seed + i,
                                            extra_body=extra) for i in range(2)]
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=N, seed=seed, n=2,
                                       extra_body=extra)
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    want = [a.choices[0].message.content for a in alone]
    check([c.index for c in r.choices] == [0, 1] and texts == want,
          f"{what}n=2: choice i equals the answer with seed {seed}+i: {texts} vs {want}")
    check(r.usage.prompt_tokens == alone[0].usage.prompt_tokens
          and r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone),
          f"{what}n=2: usage counts the prompt once and both choices: {r.usage}")
    check(all(isinstance(c.model_extra.get("unmask"), dict) for c in r.choices),
          f"{what}n=2: each choice carries its own report")
    pieces, finishes, usage = {0: [], 1: []}, {}, None
    for chunk in client.chat.completions.create(model=name, messages=messages, max_tokens=N, seed=seed, n=2,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=extra):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces[c.index].append(c.delta.content)
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    streamed = ["".join(pieces[i]) for i in range(2)]
    check(streamed == want and sorted(finishes) == [0, 1],
          f"{what}n=2 streamed: each index's pieces join to its answer, each ends: {streamed}, {finishes}")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens,
          f"{what}n=2 streamed: one usage chunk for both: {usage}")
    return want


def raw_error_cases(server):
    ok = chat_body(QUESTIONS[0])
    cases = [
        # (what, method, path, body or raw bytes, headers, status, param)
        ("no API key", "POST", "/v1/chat/completions", ok, {}, 401, None),
        ("a wrong API key", "POST", "/v1/chat/completions", ok, {"Authorization": "Bearer nope"}, 401, None),
        ("models without a key", "GET", "/v1/models", None, {}, 401, None),
        ("not JSON", "POST", "/v1/chat/completions", b"{oops", AUTH, 400, None),
        ("a JSON array", "POST", "/v1/chat/completions", b"[1]", AUTH, 400, None),
        ("no messages", "POST", "/v1/chat/completions", {"model": "x"}, AUTH, 400, "messages"),
        ("messages not a list", "POST", "/v1/chat/completions", {"messages": "hi"}, AUTH, 400, "messages"),
        ("an unknown role", "POST", "/v1/chat/completions",
         {"messages": [{"role": "tool", "content": "x"}]}, AUTH, 400, "messages[0].role"),
        ("an image part", "POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, AUTH, 400, "messages[0].content[0]"),
        ("max_tokens 0", "POST", "/v1/chat/completions", {**ok, "max_tokens": 0}, AUTH, 400, "max_tokens"),
        ("max_tokens over the limit", "POST", "/v1/chat/completions", {**ok, "max_tokens": 10**6}, AUTH, 400, "max_tokens"),
        ("max_tokens a string", "POST", "/v1/chat/completions", {**ok, "max_tokens": "many"}, AUTH, 400, "max_tokens"),
        ("temperature -1", "POST", "/v1/chat/completions", {**ok, "temperature": -1}, AUTH, 400, "temperature"),
        ("top_p 1.5", "POST", "/v1/chat/completions", {**ok, "top_p": 1.5}, AUTH, 400, "top_p"),
        ("top_k -2", "POST", "/v1/chat/completions", {**ok, "top_k": -2}, AUTH, 400, "top_k"),
        ("n 0", "POST", "/v1/chat/completions", {**ok, "n": 0}, AUTH, 400, "n"),
        ("n over the queue's bound", "POST", "/v1/chat/completions", {**ok, "n": 3}, AUTH, 400, "n"),
        ("steps not a multiple of blocks", "POST", "/v1/chat/completions",
         {**ok, "max_tokens": 64, "block_length": 32, "steps": 3}, AUTH, 400, "steps"),
        ("threshold 2", "POST", "/v1/chat/completions", {**ok, "threshold": 2}, AUTH, 400, "threshold"),
        ("an unknown cache mode", "POST", "/v1/chat/completions", {**ok, "cache": "lru"}, AUTH, 400, "cache"),
        ("anchor_ratio 3", "POST", "/v1/chat/completions", {**ok, "cache": "acache", "anchor_ratio": 3}, AUTH, 400, "anchor_ratio"),
        ("refresh_ratio 2", "POST", "/v1/chat/completions", {**ok, "cache": "dllm-cache", "refresh_ratio": 2}, AUTH, 400, "refresh_ratio"),
        ("response_interval 0", "POST", "/v1/chat/completions", {**ok, "cache": "dllm-cache", "response_interval": 0}, AUTH, 400, "response_interval"),
        ("an unknown verify_pick", "POST", "/v1/chat/completions", {**ok, "cache": "dllm-cache", "verify_pick": "random"}, AUTH, 400, "verify_pick"),
        ("an empty affix", "POST", "/v1/chat/completions", {**ok, "cache": "acache", "affix": " "}, AUTH, 400, "affix"),
        ("an affix not in the prompt", "POST", "/v1/chat/completions",
         {**ok, "cache": "acache", "affix": "a line that is nowhere"}, AUTH, 400, "affix"),
        ("logprobs", "POST", "/v1/chat/completions", {**ok, "logprobs": 2}, AUTH, 400, "logprobs"),
        ("logit_bias with a key not an id", "POST", "/v1/chat/completions", {**ok, "logit_bias": {"x": 1}}, AUTH, 400,
         "logit_bias"),
        ("logit_bias past the vocabulary", "POST", "/v1/chat/completions", {**ok, "logit_bias": {"99999": 1}}, AUTH,
         400, "logit_bias"),
        ("presence_penalty 2.5", "POST", "/v1/chat/completions", {**ok, "presence_penalty": 2.5}, AUTH, 400,
         "presence_penalty"),
        ("repetition_penalty 0", "POST", "/v1/chat/completions", {**ok, "repetition_penalty": 0}, AUTH, 400,
         "repetition_penalty"),
        ("min_p 2", "POST", "/v1/chat/completions", {**ok, "min_p": 2}, AUTH, 400, "min_p"),
        ("an unknown model", "POST", "/v1/chat/completions", {**ok, "model": "gpt-4"}, AUTH, 404, "model"),
        ("a prompt longer than the context", "POST", "/v1/chat/completions",
         chat_body("word " * 5000, system=None), AUTH, 400, "messages"),
        ("a completion without a prompt", "POST", "/v1/completions", {"max_tokens": 8}, AUTH, 400, "prompt"),
        ("a completion of two prompts", "POST", "/v1/completions", {"prompt": ["a", "b"]}, AUTH, 400, "prompt"),
        ("token ids past the vocabulary", "POST", "/v1/completions",
         {"prompt": [1, 2, 99999], "max_tokens": N, "steps": STEPS, "block_length": BLOCK}, AUTH, 400, "prompt"),
        ("a body over the limit", "POST", "/v1/chat/completions", b" " * (2 << 20), AUTH, 413, None),
        ("an unknown route", "GET", "/v1/engines", None, AUTH, 404, None),
        ("GET on a POST route", "GET", "/v1/chat/completions", None, AUTH, 405, None),
        ("top_p 1e-300 (0 as f32)", "POST", "/v1/chat/completions", {**ok, "top_p": 1e-300}, AUTH, 400, "top_p"),
        ("a foreign Host", "POST", "/v1/chat/completions", ok, {**AUTH, "Host": "attacker.example"}, 403, "Host"),
        ("a foreign Origin", "POST", "/v1/chat/completions", ok, {**AUTH, "Origin": "http://attacker.example"},
         403, "Origin"),
        ("a text/plain body", "POST", "/v1/chat/completions", ok, {**AUTH, "Content-Type": "text/plain"},
         415, "Content-Type"),
    ]
    for what, method, path, body, headers, status, param in cases:
        raw = body if isinstance(body, bytes) else None
        got, reply, _ = server.request(method, path, None if raw is not None else body, headers, raw=raw)
        err = reply.get("error") if isinstance(reply, dict) else None
        good = (got == status and isinstance(err, dict) and isinstance(err.get("message"), str)
                and err.get("type") and err.get("param") == param)
        check(good, f"{what}: {got} {json.dumps(reply)[:150]}")
    status, reply, _ = server.request("GET", "/health")
    check(status == 200 and reply.get("status") == "ok", f"/health needs no key: {status} {reply}")
    # top_p and top_k are taken (the cut runs on the GPU); the answer is still an answer
    status, reply, _ = server.request("POST", "/v1/chat/completions", {**ok, "top_p": 0.9, "top_k": 5}, AUTH)
    text = reply.get("choices", [{}])[0].get("message", {}).get("content") if isinstance(reply, dict) else None
    check(status == 200 and isinstance(text, str) and text, f"top_p 0.9 with top_k 5: {status} {json.dumps(reply)[:150]}")


def canvas_case(server):
    body = chat_body(QUESTIONS[2], stream=True, stream_options={"include_canvas": True})
    chunks = sse(server, body)
    canvases = [c["canvas"] for c in chunks if isinstance(c, dict) and "canvas" in c]
    check(len(canvases) == STEPS, f"a canvas per step: {len(canvases)}")
    masked = [c["masked"] for c in canvases]
    check(masked == sorted(masked, reverse=True) and masked[-1] == 0 and len(canvases[0]["tokens"]) == N,
          f"the canvas fills up: masked {masked[:4]}...{masked[-2:]}")
    check(chunks[-1] == "[DONE]", "the stream ends with [DONE]")


def sse(server, body):
    """The data of every SSE event of one streamed request."""
    u = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {**AUTH, "Content-Type": "application/json"})
    r = conn.getresponse()
    out = []
    for line in r.read().decode().splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return out


def queue_full_case(server):
    """With --max-queue 2, a burst of requests while one runs: some get 429, the rest answer."""
    def post(i):
        return server.request("POST", "/v1/chat/completions",
                              chat_body(QUESTIONS[i % 3], system=None, cache="none"), AUTH)[:2]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        pending = [pool.submit(post, i) for i in range(12)]
        # vLLM's names under load, as a router reads them: requests running or waiting.
        seen = []
        while not all(f.done() for f in pending):
            m = server.metrics(AUTH)
            seen.append((m.get("vllm:num_requests_running", 0), m.get("vllm:num_requests_waiting", 0),
                         m.get("vllm:kv_cache_usage_perc", -1)))
            time.sleep(0.05)
        results = [f.result() for f in pending]
    check(any(r + w > 0 for r, w, _ in seen) and all(0 <= u <= 1 for _, _, u in seen),
          f"vllm:num_requests_running/waiting move under load, kv_cache_usage_perc in [0, 1]: {seen[:6]}")
    codes = sorted(s for s, _ in results)
    check(429 in codes and 200 in codes and set(codes) <= {200, 429}, f"a burst gets 200s and 429s: {codes}")
    r429 = next(r for s, r in results if s == 429)
    check(r429["error"]["code"] == "queue_full", f"429 says why: {r429}")


def disconnect_case(server):
    """A client that goes away mid-stream leaves its batch; its pin goes with it."""
    u = urllib.parse.urlparse(server.url)
    body = json.dumps(chat_body(QUESTIONS[1], stream=True, max_tokens=128, steps=128)).encode()
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n".encode()
              + b"Content-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    s.recv(4096)  # the headers and the first chunk: the request runs
    before = server.metrics(AUTH).get('unmask_requests_total{outcome="cancelled"}', 0)
    s.close()
    deadline = time.time() + 60
    m = {}
    while time.time() < deadline:
        m = server.metrics(AUTH)
        if m.get('unmask_requests_total{outcome="cancelled"}', 0) > before and m["unmask_running_requests"] == 0:
            break
        time.sleep(0.2)
    check(m.get('unmask_requests_total{outcome="cancelled"}', 0) > before, "the disconnect is counted as cancelled")
    check(m.get("unmask_running_requests") == 0 and m.get("unmask_prefix_store_pins") == 0,
          f"nothing runs or stays pinned after it: running {m.get('unmask_running_requests')}, "
          f"pins {m.get('unmask_prefix_store_pins')}")


def dgemma_cases(unmask, model):
    """A DiffusionGemma folder: the OpenAI client's chat and stream equal `unmask generate`,
    requests sent at once run one after another with the same answers, a client gone stops
    its request, and LLaDA's settings are refused by name."""
    server = Server(unmask, model, "--max-queue", "8")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        system, question = "You answer in one word.", "Name a colour."
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        out = subprocess.run([unmask, "generate", "--model", model, "--system", system, "--prompt",
                              question, "--gen-length", "32", "--steps", "8", "--seed", "3", "--json"],
                             capture_output=True, text=True, check=True)
        expected = json.loads(out.stdout)["text"]
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=32, seed=3,
                                           extra_body={"steps": 8})
        ext = r.model_extra.get("unmask", {})
        check(r.choices[0].message.content == expected,
              f"DiffusionGemma: chat equals unmask generate ({len(expected)} characters)")
        check(ext.get("family") == "diffusion_gemma" and ext.get("prefix", {}).get("use") in ("stored", "hit"),
              f"DiffusionGemma: the report names the family and the prefix store's use: {ext.get('prefix')}")
        status, t, _ = server.request("POST", "/tokenize", {"messages": messages}, AUTH)
        check(status == 200 and t["count"] == r.usage.prompt_tokens,
              f"DiffusionGemma: /tokenize counts a chat as usage does: {t.get('count')} vs {r.usage.prompt_tokens}")
        status, d, _ = server.request("POST", "/detokenize", {"tokens": t["tokens"]}, AUTH)
        check(status == 200 and question in d["prompt"], f"DiffusionGemma: /detokenize spells the chat: {d}")
        pieces = []
        for chunk in client.chat.completions.create(model=name, messages=messages, max_tokens=32, seed=3,
                                                    stream=True, extra_body={"steps": 8}):
            pieces += [c.delta.content for c in chunk.choices if c.delta.content]
        check("".join(pieces) == expected, f"DiffusionGemma: {len(pieces)} streamed pieces join to the answer")
        # logit_bias: a word's first id banned, as unmask generate --logit-bias bans it.
        status, word, _ = server.request("POST", "/tokenize", {"prompt": expected}, AUTH)
        ban = str(word["tokens"][0])
        banned = client.chat.completions.create(model=name, messages=messages, max_tokens=32, seed=3,
                                                logit_bias={ban: -100}, extra_body={"steps": 8})
        out = subprocess.run([unmask, "generate", "--model", model, "--system", system, "--prompt", question,
                              "--gen-length", "32", "--steps", "8", "--seed", "3", "--json", "--logit-bias",
                              f"{ban}=-100"], capture_output=True, text=True, check=True)
        check(banned.choices[0].message.content == json.loads(out.stdout)["text"] != expected,
              f"DiffusionGemma: logit_bias bans id {ban} as unmask generate does: {banned.choices[0].message.content!r}")
        cli = json.loads(subprocess.run([unmask, "generate", "--model", model, "--system", system, "--prompt",
                                         question, "--gen-length", "32", "--steps", "8", "--seed", "3", "--json",
                                         "--logprobs"], capture_output=True, text=True, check=True).stdout)
        ask = dict(model=name, messages=messages, max_tokens=32, seed=3, logprobs=True, extra_body={"steps": 8})
        content = client.chat.completions.create(**ask).choices[0].logprobs.content
        spelled = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
        streamed = [(t.token, t.logprob) for chunk in client.chat.completions.create(stream=True, **ask)
                    for c in chunk.choices if c.logprobs for t in c.logprobs.content]
        # The CLI gives every canvas position's value; the answer's tokens are those that add
        # text, in order.
        cli_values = iter(cli["logprobs"])
        in_order = all(any(abs(a - t.logprob) <= 1e-6 for a in cli_values) for t in content)
        check(spelled == expected and in_order
              and streamed == [(t.token, t.logprob) for t in content] and len(content) > 0,
              f"DiffusionGemma: logprobs spell the answer, equal the CLI's and stream with it: {len(content)} tokens")
        # Four requests at once: they queue and run one at a time, each answering as alone.
        seeds = [11, 12, 13, 14]
        alone = {}
        for seed in seeds:
            alone[seed] = client.chat.completions.create(
                model=name, messages=messages, max_tokens=32, seed=seed, extra_body={"steps": 8}
            ).choices[0].message.content
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = dict(zip(seeds, pool.map(lambda seed: client.chat.completions.create(
                model=name, messages=messages, max_tokens=32, seed=seed, extra_body={"steps": 8}
            ).choices[0].message.content, seeds)))
        check(together == alone, "DiffusionGemma: requests sent at once answer as when sent alone")
        check(len(set(alone.values())) > 1, "DiffusionGemma: the seed changes the answer")
        both = choices_cases(client, name, extra={"steps": 8}, seed=11, what="DiffusionGemma: ",
                             messages=messages)
        check(both == [alone[11], alone[12]] and both[0] != both[1],
              "DiffusionGemma: n=2's choices are the answers of seeds 11 and 12, which differ")
        # A prompt no request has sent: one choice encodes all of it and stores it, the other
        # copies it (the system turn, stored before, is copied by both first).
        fresh = [{"role": "system", "content": system}, {"role": "user", "content": "Name a city."}]
        r = client.chat.completions.create(model=name, messages=fresh, max_tokens=32, seed=5, n=2,
                                           extra_body={"steps": 8})
        uses = sorted((c.model_extra["unmask"]["prefix"] for c in r.choices), key=lambda p: p["use"])
        whole = r.usage.prompt_tokens
        check(uses == [{"use": "hit", "reused_tokens": whole}, {"use": "stored", "tokens": whole}],
              f"DiffusionGemma: n=2 encodes its {whole}-token prompt once, for both choices: {uses}")
        try:
            client.chat.completions.create(model=name, messages=messages, temperature=0.7)
            check(False, "DiffusionGemma: temperature is refused")
        except openai.BadRequestError as e:
            check(e.body.get("param") == "temperature", f"DiffusionGemma: the error names the field: {e.body}")
        # A client gone mid-stream: its request stops and is counted as cancelled.
        u = urllib.parse.urlparse(server.url)
        body = json.dumps({"messages": messages, "max_tokens": 256, "steps": 64, "stream": True}).encode()
        s = socket.create_connection((u.hostname, u.port))
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n".encode()
                  + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                  + body)
        s.recv(4096)
        s.close()
        deadline, m = time.time() + 60, {}
        while time.time() < deadline:
            m = server.metrics()
            if m.get('unmask_requests_total{outcome="cancelled"}', 0) >= 1 and m.get("unmask_running_requests") == 0:
                break
            time.sleep(0.2)
        check(m.get('unmask_requests_total{outcome="cancelled"}', 0) >= 1 and m.get("unmask_running_requests") == 0,
              "DiffusionGemma: a disconnect stops its request (cancelled, nothing running)")
    finally:
        stderr = server.stop()
    check("panicked" not in stderr, "DiffusionGemma: the server never panicked")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--unmask", default="target/debug/unmask")
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--dgemma", default="../tests/fixtures/tiny-dgemma",
                    help="a DiffusionGemma folder to serve too ('' to skip)")
    a = ap.parse_args()
    server = Server(a.unmask, a.model, "--api-key", KEY, "--max-queue", "2", "--max-body", "1M")
    try:
        openai_client_cases(server, a.unmask, a.model)
        raw_error_cases(server)
        canvas_case(server)
        queue_full_case(server)
        disconnect_case(server)
        m = server.metrics(AUTH)
        check(m.get("unmask_bicache_hits_total", 0) >= 2 and m.get("unmask_bicache_misses_total", 0) >= 1,
              f"BiCache hits after the first request: hits {m.get('unmask_bicache_hits_total')}, "
              f"misses {m.get('unmask_bicache_misses_total')}")
        check(m.get("vllm:prefix_cache_queries_total", 0) > m.get("vllm:prefix_cache_hits_total", 0) > 0
              and m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0,
              f"vLLM's prefix-cache counters in tokens and idle gauges: "
              f"{ {k: v for k, v in m.items() if k.startswith('vllm:')} }")
        check(any(k.startswith("vllm:cache_config_info{") and "enable_prefix_caching" in k for k in m),
              "vllm:cache_config_info carries the cache configuration")
        check(m.get("unmask_dllm_cache_verify_steps_total", 0) > 0
              and m.get("unmask_dllm_cache_verified_row_layers_total", 0) > 0,
              f"dLLM-Cache counters: {m.get('unmask_dllm_cache_verify_steps_total')} V-verify steps")
        check(m.get("unmask_queue_depth") == 0 and m.get("unmask_prefix_store_pins") == 0,
              f"queue and pins back to zero: {m.get('unmask_queue_depth')}, {m.get('unmask_prefix_store_pins')}")
    finally:
        stderr = server.stop()
    check("panicked" not in stderr, "the server never panicked")
    if a.dgemma:
        dgemma_cases(a.unmask, a.dgemma)
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
