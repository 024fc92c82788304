"""A subscriber of `unmask serve --kv-events`: the prefix store's entries arrive as vLLM's
KV-cache events (ZMQ PUB, multipart [topic, sequence, msgpack KVEventBatch]).

    python3 tools/kv_events_test.py --unmask target/debug/unmask [--model models/tiny]

Starts a server publishing on a loopback port with a store budget of one system prompt,
subscribes, asks a question about the bundled system prompt (its entry is stored:
BlockStored), then one about another system prompt (the first entry is evicted:
BlockRemoved, and the second stored). Checks the sequence numbers, that every block hash
is the chained hash of its tokens (SHA-256 of the parent hash and the block's token ids)
and that the stored tokens are the first tokens of the request's prompt.
Needs pyzmq and msgpack (scripts/test-server.sh installs them).
"""

import argparse
import hashlib
import json
import os
import socket
import sys
import time

import msgpack
import zmq

from serve_harness import ROOT, SYSTEM, Server

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def block_hash(parent, tokens):
    h = hashlib.sha256((parent or 0).to_bytes(8, "big"))
    for t in tokens:
        h.update(int(t).to_bytes(4, "little"))
    return int.from_bytes(h.digest()[:8], "big")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(server, system, user):
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 16, "steps": 8, "block_length": 8, "temperature": 0, "cache": "bicache-dual"}
    status, reply, _ = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, (status, reply)
    return reply


def events(sub, want):
    """Event batches until `want` events arrived (or 60 s passed)."""
    out, seqs = [], []
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while sum(len(b[1]) for b in out) < want:
        if not poller.poll(60_000):
            break
        topic, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        out.append(msgpack.unpackb(payload, raw=False))
    return out, seqs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--unmask", default="target/debug/unmask")
    ap.add_argument("--model", default="models/tiny")
    a = ap.parse_args()
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    with open(os.path.join(ROOT, "data/tasks/heldout-small.jsonl")) as f:
        other = next(json.loads(l) for l in f if json.loads(l)["system"] != SYSTEM)
    # Room for one system prompt's entry: the second evicts the first.
    server = Server(a.unmask, a.model, "--kv-events", endpoint, "--kv-block-size", "16",
                    "--cache-budget", "400")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        reply = ask(server, SYSTEM, "What is the city of Bella?")
        batches, seqs = events(sub, 1)
        check(len(batches) >= 1 and seqs[0] == 0, f"the first batch is number 0: {seqs}")
        stored = [e for b in batches for e in b[1] if e[0] == "BlockStored"]
        check(len(stored) == 1, f"one BlockStored for the first system prompt: {[e[0] for b in batches for e in b[1]]}")
        if stored:
            _, hashes, parent, tokens, size, lora, medium = stored[0]
            check(size == 16 and parent is None and len(tokens) == 16 * len(hashes) and len(hashes) >= 10,
                  f"{len(hashes)} full blocks of 16 tokens, no parent before the first")
            chain, prev = [], None
            for i in range(len(hashes)):
                prev = block_hash(prev, tokens[16 * i:16 * (i + 1)])
                chain.append(prev)
            check(chain == hashes, "every block hash is the chained SHA-256 of its tokens")
            prompt_tokens = reply["usage"]["prompt_tokens"]
            check(len(tokens) <= prompt_tokens, f"the stored tokens lie inside the {prompt_tokens}-token prompt")
        ask(server, other["system"], other["user"])
        more, more_seqs = events(sub, 2)
        kinds = [e[0] for b in more for e in b[1]]
        check("BlockRemoved" in kinds and "BlockStored" in kinds, f"the second prompt evicts the first: {kinds}")
        check(more_seqs and more_seqs[0] == seqs[-1] + 1, f"sequence numbers follow on: {seqs} {more_seqs}")
        removed = [h for b in more for e in b[1] if e[0] == "BlockRemoved" for h in e[1]]
        check(stored and set(removed) == set(stored[0][1]), "the blocks removed are the first entry's")
    finally:
        sub.close(0)
        ctx.term()
        stderr = server.stop()
    check("panicked" not in stderr, "the server never panicked")
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
