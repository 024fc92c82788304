"""Compare `unmask eval --out` runs of one task set that differ in one setting.

The setting is a top-level field of the reports (`--by`): `weight_format` (f16 against q8
and q4) or `batch` (one request per forward against batched BiCache). For each run, against
the first (the reference): exact-match accuracy next to the reference's, canvas throughput,
the share of generated tokens equal to the reference's at the same position, and the share
of items whose whole generation is identical.  Writes one JSON object and a markdown table.
Standard library only.

Usage:
  python3 tools/eval_agreement.py f16.json q8.json q4.json \\
      --json docs/benchmarks/quant-heldout.json --markdown docs/benchmarks/quant-heldout.md
  python3 tools/eval_agreement.py --by batch b1.json b5.json --markdown batch.md
"""

from __future__ import annotations

import argparse
import json
import sys


def load_run(path):
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    modes = report.get("modes") or []
    if len(modes) != 1 or "items" not in modes[0]:
        raise SystemExit(f"{path}: expected one cache mode with per-item results (unmask eval --out)")
    return report, modes[0]


def compare(ref_items, items, path):
    if [i["id"] for i in ref_items] != [i["id"] for i in items]:
        raise SystemExit(f"{path}: not the same items, in the same order, as the reference")
    same_tokens = total_tokens = identical = 0
    for a, b in zip(ref_items, items):
        if len(a["ids"]) != len(b["ids"]):
            raise SystemExit(f"{path}: item {b['id']} has {len(b['ids'])} tokens, the reference {len(a['ids'])}")
        same = sum(x == y for x, y in zip(a["ids"], b["ids"]))
        same_tokens += same
        total_tokens += len(a["ids"])
        identical += same == len(a["ids"])
    return same_tokens / max(1, total_tokens), identical / max(1, len(items))


def accuracy(items):
    return sum(bool(i["correct"]) for i in items) / max(1, len(items))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="unmask eval --out files; the first is the reference")
    ap.add_argument("--json", dest="json_out", help="write the figures here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--by", default="weight_format",
                    help="the report field the runs differ in (weight_format, batch)")
    args = ap.parse_args(argv)
    key = args.by
    ref_report, ref_mode = load_run(args.runs[0])
    rows = []
    for path in args.runs:
        report, mode = load_run(path)
        token_agreement, identical = compare(ref_mode["items"], mode["items"], path)
        if key not in report:
            raise SystemExit(f"{path}: the report has no field {key!r} (unmask eval --out)")
        rows.append({
            "file": path,
            key: report[key],
            "throughput_canvas": mode["throughput_canvas"],
            "items": len(mode["items"]),
            "accuracy": accuracy(mode["items"]),
            "accuracy_delta_points": 100 * (accuracy(mode["items"]) - accuracy(ref_mode["items"])),
            "token_agreement": token_agreement,
            "identical_generations": identical,
        })
    out = {
        "by": key,
        "reference": ref_report[key],
        "set": ref_report["set"],
        "model": ref_report["model"],
        "adapter": ref_report["adapter"],
        "params": ref_report["params"],
        "rows": rows,
    }
    lines = [
        f"Runs by {key} against {out['reference']} on `{out['set']}` ({rows[0]['items']} items), "
        f"model `{out['model']}`, adapter {out['adapter']}.",
        "",
        f"| {key} | accuracy | Δ accuracy (points) | canvas tok/s | token agreement | identical generations |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r[key]} | {100 * r['accuracy']:.1f} % | {r['accuracy_delta_points']:+.1f} | "
            f"{r['throughput_canvas']:.1f} | "
            f"{100 * r['token_agreement']:.1f} % | {100 * r['identical_generations']:.1f} % |"
        )
    table = "\n".join(lines) + "\n"
    sys.stdout.write(table)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(table)


if __name__ == "__main__":
    main()
