"""Adds multiple-choice `choices` to a task set (for `unmask score --set`): the item's
answer and distractors, each the answer with one fact's value swapped for the same field's
value of another member of the item's table, in a seeded random order.

Usage: tools/.venv/bin/python tools/add_choices.py data/tasks/heldout-small.jsonl \
           data/tasks/heldout-small-choices.jsonl [--choices 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import re

FACT = re.compile(r"(\S+) (\S+) : (\S+)")


def table(system):
    """field -> every value of the table's lines `- <name> <field> : <value>`."""
    values = {}
    for line in system.splitlines():
        m = FACT.fullmatch(line[2:]) if line.startswith("- ") else None
        if m:
            values.setdefault(m.group(2), []).append(m.group(3))
    return values


def distractors(answer, values, n, rng):
    facts = FACT.findall(answer)
    if not facts:
        raise ValueError(f"the answer {answer!r} holds no fact '<name> <field> : <value>'")
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 1000:
            raise ValueError(f"fewer than {n} distractors for {answer!r}")
        i = rng.randrange(len(facts))
        name, field, value = facts[i]
        others = [v for v in values.get(field, []) if v != value]
        if not others:
            continue
        swapped = list(facts)
        swapped[i] = (name, field, rng.choice(others))
        text = " ".join(f"{a} {b} : {c}" for a, b, c in swapped)
        if text != answer and text not in out:
            out.append(text)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    lines = []
    with open(args.src) as f:
        for line in f:
            if not line.strip():
                continue
            item = json.loads(line)
            choices = [item["answer"]] + distractors(
                item["answer"], table(item.get("system") or ""), args.choices - 1, rng
            )
            rng.shuffle(choices)
            item["choices"] = choices
            lines.append(json.dumps(item, ensure_ascii=False))
    with open(args.dst, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} items with {args.choices} choices each to {args.dst}")


if __name__ == "__main__":
    main()
