"""Seeded generator of the shared-system-prompt question-answering tasks.

Each *prompt group* is one system prompt: a role line, the answering rules and a table of
facts, one line per (member, field): `- Nina city : Athens`.  Every question of a group is
answerable only from that system prompt, so many requests share a long prefix (about 83 %
of a request's tokens, counting the 32 generated ones), as in real serving.  Member names
and field values come from fixed pools and are re-assigned at random for every group, so a
model has to read the table to answer.

The answer format is designed so that a small model can learn it and a diffusion sampler
can decode it: every fact in an answer is written as in the table, `NAME FIELD : VALUE`,
after `####`.  The value is then three tokens after the name and two after the field both in
the table and in the answer (one attention pattern serves both), and with `####` in front
each value starts a new block of 4, so a block-wise sampler has committed the name and the
field before it decodes the value.

Task types:

* lookup   one cell: "What is the city of Nina?" -> `Nina city : Athens`
* pair     two facts, one field of two members: "What is the pet of Nina and of Tom?"
           -> `Nina pet : cat Tom pet : dog`
* record   a copied record, every field of one member in the fixed field order:
           "Give the record of Nina." -> `Nina city : Athens Nina colour : gold ...`

Names, fields and values are single tokens of the bundled tokenizer (tools/train.py checks).
The exact answer is the text after the last "####".

Usage:
  tools/.venv/bin/python tools/tasks.py heldout [--seed 0] [--out data/tasks]
  tools/.venv/bin/python tools/tasks.py sample --split train --n 20
"""

from __future__ import annotations

import argparse
import json
import os
import random

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Separate seed streams: training groups and held-out groups never coincide because they
# are drawn from different seed ranges.
TRAIN_SEED_BASE = 1_000_000
HELDOUT_SEED_BASE = 9_000_000
DEMO_SEED = 8_000_000  # the bundled demo prompt (scripts/run.sh, the web page): neither stream

NAMES = [
    "Alice", "Bruno", "Clara", "Daniel", "Emma", "Felix", "Grace", "Hugo", "Irene", "Jonas",
    "Karen", "Leo", "Maria", "Nina", "Oscar", "Paula", "Quentin", "Rosa", "Simon", "Tara",
    "Victor", "Wendy", "Xavier", "Yara", "Zoe", "Adam", "Bella", "Carl", "Diana", "Ethan",
    "Fiona", "George", "Helen", "Ivan", "Julia", "Kevin", "Laura", "Martin", "Olga", "Peter",
]

# The fields in the order a record lists them, with their values.
FIELDS = {
    "city": ["Paris", "Oslo", "Rome", "Madrid", "Berlin", "Lisbon", "Vienna", "Prague",
             "Dublin", "Athens", "Warsaw", "Cairo", "Lima", "Tokyo", "Seoul", "Delhi"],
    "colour": ["red", "blue", "green", "yellow", "black", "white", "orange", "purple",
               "pink", "brown", "grey", "gold", "silver", "violet", "cyan", "beige"],
    "pet": ["cat", "dog", "parrot", "rabbit", "hamster", "turtle", "horse", "goat",
            "snake", "lizard", "duck", "goose", "mouse", "frog", "pony", "ferret"],
    "sport": ["tennis", "chess", "golf", "rugby", "hockey", "boxing", "rowing", "skiing",
              "judo", "karate", "cricket", "cycling", "fencing", "polo", "sailing", "surfing"],
}
FIELD_NAMES = list(FIELDS)

ORGS = ["Harbor Office", "City Library", "Green Valley Club", "North Station", "Sunrise School",
        "Blue Lake Hotel", "River Clinic", "Maple Bank", "Hill Museum", "Stone Bridge Gym",
        "Pine Market", "Old Town Theatre"]
ROLES = [
    "You are the records assistant of {org}.",
    "You are a helpful desk clerk at {org}.",
    "You work at {org} and answer questions about its members.",
    "You are the member service bot of {org}.",
]
RULES = [
    "Answer only from the table below, and use the names and values exactly as it spells them.",
    "Write each fact as the table does: the name, the field, a colon, then the value.",
    "Put the answer after ####, with no greeting and no explanation.",
    "For a record, give every field of the member in the order city, colour, pet, sport.",
]

# One wording per task keeps the positions of the asked name fixed relative to the answer.
ASK = {
    "lookup": "What is the {field} of {name}?",
    "pair": "What is the {field} of {a} and of {b}?",
    "record": "Give the record of {name}.",
}
TASK_MIX = [("lookup", 0.5), ("pair", 0.25), ("record", 0.25)]
MEMBERS = 8  # members per table (32 fact lines)


def fact(name, field, value):
    return f"{name} {field} : {value}"


class Group:
    """One system prompt (a table of `members` members x 4 fields) and its questions."""

    def __init__(self, rng: random.Random, group_id: str, members=MEMBERS, bare=False):
        self.id = group_id
        self.names = rng.sample(NAMES, members)
        self.rows = {n: {} for n in self.names}
        for field, values in FIELDS.items():
            # a value at most once per field up to the pool's size (16); a longer table
            # (a long system prompt) repeats values, and its names stay distinct
            drawn = rng.sample(values, min(members, len(values)))
            drawn += [rng.choice(values) for _ in range(members - len(drawn))]
            for n, v in zip(self.names, drawn):
                self.rows[n][field] = v
        org = rng.choice(ORGS)
        lines = [rng.choice(ROLES).format(org=org)]
        if not bare:  # bare: the role line and the table only (early training stages)
            lines += ["Rules:"] + [f"- {r}" for r in RULES]
        lines.append("Table of members (name, field, value):")
        for n in self.names:
            for field in rng.sample(FIELD_NAMES, len(FIELD_NAMES)):
                lines.append(f"- {fact(n, field, self.rows[n][field])}")
        self.system = "\n".join(lines)

    def lookup(self, rng):
        name, field = rng.choice(self.names), rng.choice(FIELD_NAMES)
        return ASK["lookup"].format(field=field, name=name), fact(name, field, self.rows[name][field])

    def pair(self, rng):
        if len(self.names) < 2:  # a one-member table (a training curriculum stage)
            return self.lookup(rng)
        a, b = rng.sample(self.names, 2)
        field = rng.choice(FIELD_NAMES)
        answer = " ".join(fact(n, field, self.rows[n][field]) for n in (a, b))
        return ASK["pair"].format(field=field, a=a, b=b), answer

    def record(self, rng):
        name = rng.choice(self.names)
        answer = " ".join(fact(name, f, self.rows[name][f]) for f in FIELD_NAMES)
        return ASK["record"].format(name=name), answer

    def item(self, rng, task, idx):
        user, answer = getattr(self, task)(rng)
        return {"id": f"{self.id}-{idx:03d}", "task": task, "system": self.system, "user": user,
                "answer": answer, "prompt_group": self.id}


def pick_task(rng):
    r, acc = rng.random(), 0.0
    for name, p in TASK_MIX:
        acc += p
        if r < acc:
            return name
    return TASK_MIX[-1][0]


def group_items(seed_base, g, n_items, prefix, members=MEMBERS, bare=False):
    """Items of prompt group number g: deterministic from (seed_base, g, members, bare)."""
    rng = random.Random(seed_base + g)
    grp = Group(rng, f"{prefix}{g:05d}", members, bare)
    seen, out = set(), []
    tries = 0
    while len(out) < n_items and tries < 50 * n_items:
        tries += 1
        it = grp.item(rng, pick_task(rng), len(out))
        if it["user"] in seen:
            continue
        seen.add(it["user"])
        out.append(it)
    return out


def train_items(seed, start_group, n_groups, per_group=16, members=MEMBERS):
    """Training items of groups [start_group, start_group + n_groups) (never held out)."""
    for g in range(start_group, start_group + n_groups):
        yield from group_items(TRAIN_SEED_BASE + seed * 100_000, g, per_group, "train-", members)


def heldout_items(seed, n_groups=8, per_group=25, members=MEMBERS, bare=False):
    items = []
    # other prompt shapes take other groups of the held-out stream (never the default sets')
    shape = (members, bare)
    first = 0 if shape == (MEMBERS, False) else 1000 * members + (500 if bare else 0)
    for g in range(first, first + n_groups):
        items.extend(group_items(HELDOUT_SEED_BASE + seed * 100_000, g, per_group, "heldout-", *shape))
    return items


AFFIX_SEED = 7_000_000  # the per-request preambles of the affix sets: neither stream


def with_affix(items, seed):
    """The items with the table as a shared span after a per-request preamble: each item's
    system prompt starts with its own role line (another organisation and wording, so the
    span sits at another offset), then the group's rules and table, which are the affix."""
    out = []
    for i, it in enumerate(items):
        rng = random.Random(AFFIX_SEED + seed * 100_000 + i)
        lines = it["system"].split("\n")
        affix = "\n".join(lines[1:])
        role = rng.choice(ROLES).format(org=rng.choice(ORGS))
        out.append({**it, "system": role + "\n" + affix, "affix": affix})
    return out


def answer_text(answer):
    """The response the model is trained to produce (before <|eot_id|> and EOS padding)."""
    return f"#### {answer}"


def render_chat(system, user, bos_token="<|startoftext|>"):
    """LLaDA-Instruct chat template (llada.md 3.2) for a system + user conversation."""
    out = bos_token
    for role, content in (("system", system), ("user", user)):
        out += "<|start_header_id|>" + role + "<|end_header_id|>\n\n" + content.strip() + "<|eot_id|>"
    return out + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def write_jsonl(path, items):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for it in items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")


def small_subset(items, n):
    """n items spread over prompt groups and task types (round robin per group)."""
    by_group = {}
    for it in items:
        by_group.setdefault(it["prompt_group"], []).append(it)
    per = max(1, n // len(by_group))
    out = []
    for group in by_group.values():
        picked, tasks_seen = [], set()
        for it in group:  # one of each task type first, then fill in order
            if it["task"] not in tasks_seen:
                picked.append(it)
                tasks_seen.add(it["task"])
        picked += [it for it in group if it not in picked]
        out.extend(picked[:per])
    return out[:n]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("heldout", help="write data/tasks/heldout.jsonl and heldout-small.jsonl")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--out", default=os.path.join(REPO_ROOT, "data", "tasks"))
    h.add_argument("--suffix", default="", help="file name suffix, e.g. -seed1 for a fresh set")
    h.add_argument("--members", type=int, default=MEMBERS, help="members per table (system prompt length)")
    h.add_argument("--bare", action="store_true", help="system prompts without the rules paragraph")
    h.add_argument("--tasks", default="", help="keep only these task types, e.g. lookup,pair "
                   "(answers short enough for a 16-token canvas)")
    a = sub.add_parser("affix", help="write heldout-affix.jsonl and heldout-affix-small.jsonl: the table as a shared span after a per-request preamble")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out", default=os.path.join(REPO_ROOT, "data", "tasks"))
    sub.add_parser("demo", help="write data/tasks/demo-system.txt, the system prompt of scripts/run.sh and the web page")
    s = sub.add_parser("sample", help="print some items")
    s.add_argument("--split", choices=["train", "heldout"], default="train")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--n", type=int, default=5)
    args = ap.parse_args()
    if args.cmd == "heldout":
        items = heldout_items(args.seed, members=args.members, bare=args.bare)
        if args.tasks:
            keep = set(args.tasks.split(","))
            items = [it for it in items if it["task"] in keep]
        os.makedirs(args.out, exist_ok=True)
        write_jsonl(os.path.join(args.out, f"heldout{args.suffix}.jsonl"), items)
        write_jsonl(os.path.join(args.out, f"heldout-small{args.suffix}.jsonl"), small_subset(items, 40))
        counts = {}
        for it in items:
            counts[it["task"]] = counts.get(it["task"], 0) + 1
        print(f"{len(items)} items: {counts}")
    elif args.cmd == "affix":
        items = with_affix(heldout_items(args.seed), args.seed)
        os.makedirs(args.out, exist_ok=True)
        write_jsonl(os.path.join(args.out, "heldout-affix.jsonl"), items)
        write_jsonl(os.path.join(args.out, "heldout-affix-small.jsonl"), small_subset(items, 40))
        print(f"{len(items)} items with a per-request preamble before the shared table")
    elif args.cmd == "demo":
        grp = Group(random.Random(DEMO_SEED), "demo")
        with open(os.path.join(REPO_ROOT, "data", "tasks", "demo-system.txt"), "w", encoding="utf-8", newline="\n") as f:
            f.write(grp.system + "\n")
        for name in grp.names[:3]:
            print(ASK["lookup"].format(field="city", name=name), "->", fact(name, "city", grp.rows[name]["city"]))
    else:
        items = list(train_items(args.seed, 0, args.n)) if args.split == "train" else heldout_items(args.seed)
        for it in items[: args.n]:
            print(json.dumps(it, ensure_ascii=False))


if __name__ == "__main__":
    main()
