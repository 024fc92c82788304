"""How many of the asked members' value tokens ACache's probe made anchors, per anchor ratio.

Reads an `unmask eval --out` file of the affix set (scripts/bench-acache.sh writes
docs/benchmarks/acache.json) and the set itself; a value token is the token after ` :` on a
table line `- NAME FIELD : VALUE` whose NAME the answer is about.  Those are the rows whose
deep K/V carry the question's mark on the bundled model (models/tiny/README.md).

    tools/.venv/bin/python tools/anchor_recall.py docs/benchmarks/acache.json data/tasks/heldout-affix-small.jsonl
"""

from __future__ import annotations

import json
import os
import sys

from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    results, set_path = sys.argv[1], sys.argv[2]
    d = json.load(open(results, encoding="utf-8"))
    tok = Tokenizer.from_file(os.path.join(d.get("model", "models/tiny"), "tokenizer.json"))
    items = {}
    for line in open(set_path, encoding="utf-8"):
        if line.strip():
            it = json.loads(line)
            items[it["id"]] = it
    for m in d["modes"]:
        if m["cache"] != "acache":
            continue
        hit = total = 0
        for it in m["items"]:
            a = it["acache"]
            if not a or a["fallback"]:
                continue
            src = items[it["id"]]
            ids = tok.encode(tasks.render_chat(src["system"], src["user"]), add_special_tokens=False).ids
            span = ids[a["span_start"]: a["span_start"] + a["span_tokens"]]
            pieces = [tok.decode([t]).strip() for t in span]
            words = src["answer"].split()
            names = {words[i] for i in range(0, len(words), 4)}
            anchors = set(a["anchors"])
            for j in range(4, len(pieces)):
                if pieces[j - 1] == ":" and pieces[j - 4] == "-" and pieces[j - 3] in names:
                    total += 1
                    hit += j in anchors
        ratio = m.get("anchor_ratio")
        label = "default ratio" if ratio is None else f"ratio {ratio:g}"
        print(f"acache {label}: asked value tokens among the anchors {hit}/{total}")


if __name__ == "__main__":
    main()
