"""Seeded generator of the shared-system-prompt question-answering tasks.

Each *prompt group* is one system prompt: a role line, formatting rules and a table of
facts (entity -> text attributes and numbers).  Every question of a group is answerable
only from that system prompt, so many requests share a long prefix, as in real serving.
Entity names and attribute values come from small fixed pools and are re-assigned at
random for every group, so a model has to read the table to answer.

Task types:

* lookup      one cell of the table ("Which city is Alice from?")
* combine     one fact found through another ("What colour does the person from Oslo
              like?", "Who is older, Alice or Bruno?")
* arithmetic  a sum or difference of two numbers stated in the table
* format      a copy of a record, written with the field separator the rules prescribe

Answers are written after "####" and the text after the last "####" is the exact answer.

Usage:
  tools/.venv/bin/python tools/tasks.py heldout [--seed 1234] [--out data/tasks]
  tools/.venv/bin/python tools/tasks.py sample --split train --n 20
"""

from __future__ import annotations

import argparse
import json
import os
import random

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Separate seed streams: training groups and held-out groups never coincide because they
# are drawn from different seeds (and the held-out generator also rejects any table that
# equals a training table by construction of the seed ranges below).
TRAIN_SEED_BASE = 1_000_000
HELDOUT_SEED_BASE = 9_000_000

NAMES = [
    "Alice", "Bruno", "Clara", "Daniel", "Emma", "Felix", "Grace", "Hugo", "Irene", "Jonas",
    "Karen", "Leo", "Maria", "Nina", "Oscar", "Paula", "Quentin", "Rosa", "Simon", "Tara",
    "Victor", "Wendy", "Xavier", "Yara", "Zoe", "Adam", "Bella", "Carl", "Diana", "Ethan",
    "Fiona", "George", "Helen", "Ivan", "Julia", "Kevin", "Laura", "Martin", "Olga", "Peter",
]

# text attributes: column name, question templates (who = entity), values
TEXT_ATTRS = {
    "city": {
        "values": ["Paris", "Oslo", "Rome", "Madrid", "Berlin", "Lisbon", "Vienna", "Prague",
                   "Dublin", "Athens", "Warsaw", "Cairo", "Lima", "Tokyo", "Seoul", "Delhi"],
        "ask": ["Which city is {who} from?", "What is the city of {who}?", "Where does {who} live?"],
        "via": "the person from {val}",
    },
    "colour": {
        "values": ["red", "blue", "green", "yellow", "black", "white", "orange", "purple",
                   "pink", "brown", "grey", "gold", "silver", "violet", "cyan", "beige"],
        "ask": ["What is the favourite colour of {who}?", "Which colour does {who} like?",
                "What colour is listed for {who}?"],
        "via": "the person whose colour is {val}",
    },
    "pet": {
        "values": ["cat", "dog", "parrot", "rabbit", "hamster", "turtle", "horse", "goat",
                   "snake", "lizard", "duck", "goose", "mouse", "frog", "pony", "ferret"],
        "ask": ["What pet does {who} have?", "Which animal is the pet of {who}?",
                "What is the pet of {who}?"],
        "via": "the person with the {val}",
    },
    "sport": {
        "values": ["tennis", "chess", "golf", "rugby", "hockey", "boxing", "rowing", "skiing",
                   "judo", "karate", "cricket", "cycling", "fencing", "polo", "sailing", "surfing"],
        "ask": ["Which sport does {who} play?", "What is the sport of {who}?",
                "What sport is listed for {who}?"],
        "via": "the person who plays {val}",
    },
    "fruit": {
        "values": ["apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "peach",
                   "pear", "plum", "kiwi", "lime", "fig", "date", "guava", "papaya"],
        "ask": ["Which fruit does {who} like?", "What is the favourite fruit of {who}?",
                "What fruit is listed for {who}?"],
        "via": "the person who likes {val}",
    },
}

# numeric attributes: column name, range, question templates
NUM_ATTRS = {
    "age": {
        "range": (18, 79),
        "ask": ["How old is {who}?", "What is the age of {who}?"],
        "more": "Who is older, {a} or {b}?",
        "less": "Who is younger, {a} or {b}?",
        "sum": "What is the sum of the ages of {a} and {b}?",
        "diff": "How many years older is {a} than {b}?",
    },
    "coins": {
        "range": (1, 9),
        "ask": ["How many coins does {who} have?", "What is the number of coins of {who}?"],
        "more": "Who has more coins, {a} or {b}?",
        "less": "Who has fewer coins, {a} or {b}?",
        "sum": "How many coins do {a} and {b} have together?",
        "diff": "How many more coins does {a} have than {b}?",
    },
    "score": {
        "range": (1, 9),
        "ask": ["What is the score of {who}?", "Which score did {who} get?"],
        "more": "Who has the higher score, {a} or {b}?",
        "less": "Who has the lower score, {a} or {b}?",
        "sum": "What is the total score of {a} and {b}?",
        "diff": "By how many points does the score of {a} exceed that of {b}?",
    },
}

ORGS = ["Harbor Office", "City Library", "Green Valley Club", "North Station", "Sunrise School",
        "Blue Lake Hotel", "River Clinic", "Maple Bank", "Hill Museum", "Stone Bridge Gym",
        "Pine Market", "Old Town Theatre"]
ROLES = [
    "You are the records assistant of {org}.",
    "You are a helpful desk clerk at {org}.",
    "You work at {org} and answer questions about its members.",
    "You are the member service bot of {org}.",
]
# One of these opens every system prompt after the role line: text that the model reads
# but never needs, as real system prompts carry (it brings the shared prefix to about
# 85 % of a request).
ABOUT = [
    "{org} keeps a small table of its members. Staff and visitors ask short questions about "
    "them, and you look the answers up so that nobody has to search the records by hand.",
    "The members of {org} are listed below, one fact per line. People at the front desk ask "
    "you about them all day, and they expect short answers that they can copy.",
    "Every member of {org} has a line for each field in the table below. Questions come from "
    "the staff, who need quick answers while they help the people waiting in line.",
    "This assistant serves the office of {org}. The table below is the only source of truth; "
    "it was checked this morning and it is complete for today.",
]
SEPARATORS = [" / ", " - ", "; ", ", ", " + "]
SEP_NAMES = {" / ": "a slash", " - ": "a dash", "; ": "a semicolon", ", ": "a comma", " + ": "a plus sign"}

TASK_MIX = [("lookup", 0.4), ("combine", 0.2), ("arithmetic", 0.2), ("format", 0.2)]


class Group:
    """One system prompt and the table behind it."""

    def __init__(self, rng: random.Random, group_id: str, rows=(6, 8), bare=False):
        self.id = group_id
        n_rows = rng.randint(*rows)
        self.names = rng.sample(NAMES, n_rows)
        self.text_cols = rng.sample(sorted(TEXT_ATTRS), 2)
        self.num_cols = rng.sample(sorted(NUM_ATTRS), 2)
        cols = self.text_cols + self.num_cols
        rng.shuffle(cols)
        self.cols = cols
        self.rows = {}
        text_vals = {c: rng.sample(TEXT_ATTRS[c]["values"], n_rows) for c in self.text_cols}
        num_vals = {}
        for c in self.num_cols:
            lo, hi = NUM_ATTRS[c]["range"]
            num_vals[c] = rng.sample(range(lo, hi + 1), n_rows)  # distinct: comparisons are defined
        for i, name in enumerate(self.names):
            row = {c: text_vals[c][i] for c in self.text_cols}
            row.update({c: str(num_vals[c][i]) for c in self.num_cols})
            self.rows[name] = row
        self.sep = rng.choice(SEPARATORS)
        self.record_cols = rng.sample(cols, 2)
        org = rng.choice(ORGS)
        role = rng.choice(ROLES).format(org=org)
        about = rng.choice(ABOUT).format(org=org)
        rules = [
            "Answer only from the table below.",
            "Put the final answer after ####.",
            "Write numbers as digits.",
            f"When asked for a record, write the name, {self.record_cols[0]} and {self.record_cols[1]} "
            f"separated by {SEP_NAMES[self.sep]}.",
            "Keep the answer short: no greeting and no explanation.",
            "Use the names and values exactly as the table spells them.",
        ]
        rng.shuffle(rules)
        # A bare prompt (early training only) keeps the role line and the table: short
        # sequences with few distractors, where the lookup is learnt fastest.
        lines = [role] if bare else [role, about, "Rules:"] + [f"- {r}" for r in rules]
        lines.append("Table of members (name, field, value):")
        for name in self.names:
            for c in cols:
                lines.append(f"- {name} {c} {self.rows[name][c]}")
        self.system = "\n".join(lines)

    # -- questions -------------------------------------------------------------------

    def lookup(self, rng):
        who = rng.choice(self.names)
        col = rng.choice(self.cols)
        spec = TEXT_ATTRS.get(col) or NUM_ATTRS[col]
        return rng.choice(spec["ask"]).format(who=who), self.rows[who][col]

    def combine(self, rng):
        if rng.random() < 0.5:
            # find the row through one text attribute, answer another column
            key_col = rng.choice(self.text_cols)
            target = rng.choice([c for c in self.cols if c != key_col] + ["name"])
            who = rng.choice(self.names)
            via = TEXT_ATTRS[key_col]["via"].format(val=self.rows[who][key_col])
            if target == "name":
                return f"Who is {via}?", who
            spec = TEXT_ATTRS.get(target) or NUM_ATTRS[target]
            q = rng.choice(spec["ask"]).format(who=via)
            return q[0].upper() + q[1:], self.rows[who][target]
        col = rng.choice(self.num_cols)
        a, b = rng.sample(self.names, 2)
        va, vb = int(self.rows[a][col]), int(self.rows[b][col])
        if rng.random() < 0.5:
            return NUM_ATTRS[col]["more"].format(a=a, b=b), a if va > vb else b
        return NUM_ATTRS[col]["less"].format(a=a, b=b), a if va < vb else b

    def arithmetic(self, rng):
        # sums and differences of the small counts (coins, score); ages are for lookups and
        # comparisons only
        col = rng.choice([c for c in self.num_cols if c != "age"])
        a, b = rng.sample(self.names, 2)
        va, vb = int(self.rows[a][col]), int(self.rows[b][col])
        if rng.random() < 0.5:
            return NUM_ATTRS[col]["sum"].format(a=a, b=b), str(va + vb)
        if va < vb:
            a, b, va, vb = b, a, vb, va
        return NUM_ATTRS[col]["diff"].format(a=a, b=b), str(va - vb)

    def format(self, rng):
        who = rng.choice(self.names)
        vals = [who] + [self.rows[who][c] for c in self.record_cols]
        q = rng.choice(["Give the record of {who}.", "Write the record of {who}.",
                        "Copy the record of {who} as the rules say."]).format(who=who)
        return q, self.sep.join(vals)

    def recall(self, rng):
        """A training-only drill: "<name> <field>?" answered by the table cell.  Many of
        these in one conversation give dense practice at the lookup every task needs."""
        who = rng.choice(self.names)
        col = rng.choice(self.cols)
        return f"{who} {col}?", self.rows[who][col]

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


def group_items(seed_base, g, n_items, prefix, rows=(6, 8), bare=False):
    """Items of prompt group number g: deterministic from (seed_base, g, rows, bare)."""
    rng = random.Random(seed_base + g)
    grp = Group(rng, f"{prefix}{g:05d}", rows, bare)
    seen, out = set(), []
    tries = 0
    while len(out) < n_items and tries < 50 * n_items:
        tries += 1
        task = pick_task(rng)
        it = grp.item(rng, task, len(out))
        if (it["user"], it["answer"]) in seen:
            continue
        seen.add((it["user"], it["answer"]))
        out.append(it)
    return out


def recall_items(seed, g, n_items, rows=(6, 8), bare=False):
    """n recall drills over training group g's table (the same table as `train_items`)."""
    seed_base = TRAIN_SEED_BASE + seed * 100_000
    grp = Group(random.Random(seed_base + g), f"train-{g:05d}", rows, bare)
    rng = random.Random((seed_base + g) * 31 + 7)
    return [grp.item(rng, "recall", i) for i in range(n_items)]


def train_items(seed, start_group, n_groups, per_group=16, rows=(6, 8), bare=False):
    """Training items of groups [start_group, start_group + n_groups) (never held out)."""
    for g in range(start_group, start_group + n_groups):
        yield from group_items(TRAIN_SEED_BASE + seed * 100_000, g, per_group, "train-", rows, bare)


def heldout_items(seed, n_groups=8, per_group=25):
    items = []
    for g in range(n_groups):
        items.extend(group_items(HELDOUT_SEED_BASE + seed * 100_000, g, per_group, "heldout-"))
    return items


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
    """n items spread evenly over the prompt groups and task types (deterministic)."""
    groups = sorted({it["prompt_group"] for it in items})
    per = max(1, n // len(groups))
    out = []
    for gname in groups:
        its = [it for it in items if it["prompt_group"] == gname]
        by_task = {}
        for it in its:
            by_task.setdefault(it["task"], []).append(it)
        picked = []
        order = [t for t, _ in TASK_MIX]
        k = 0
        while len(picked) < per and any(by_task.get(t) for t in order):
            t = order[k % len(order)]
            if by_task.get(t):
                picked.append(by_task[t].pop(0))
            k += 1
        out.extend(sorted(picked, key=lambda it: it["id"]))
    return out[:n]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("heldout", help="write data/tasks/heldout.jsonl and heldout-small.jsonl")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--groups", type=int, default=8)
    h.add_argument("--per-group", type=int, default=25)
    h.add_argument("--small", type=int, default=40)
    h.add_argument("--out", default=os.path.join(REPO_ROOT, "data", "tasks"))
    s = sub.add_parser("sample", help="print items as JSON lines")
    s.add_argument("--split", choices=["train", "heldout"], default="train")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--n", type=int, default=10)
    s.add_argument("--start-group", type=int, default=0)
    args = ap.parse_args()
    if args.cmd == "heldout":
        items = heldout_items(args.seed, args.groups, args.per_group)
        os.makedirs(args.out, exist_ok=True)
        write_jsonl(os.path.join(args.out, "heldout.jsonl"), items)
        write_jsonl(os.path.join(args.out, "heldout-small.jsonl"), small_subset(items, args.small))
        counts = {}
        for it in items:
            counts[it["task"]] = counts.get(it["task"], 0) + 1
        print(f"{len(items)} held-out items over {args.groups} prompt groups: {counts}")
    else:
        if args.split == "train":
            gen = train_items(args.seed, args.start_group, args.n)
        else:
            gen = iter(heldout_items(args.seed))
        for _, it in zip(range(args.n), gen):
            print(json.dumps(it, ensure_ascii=False))


if __name__ == "__main__":
    main()
