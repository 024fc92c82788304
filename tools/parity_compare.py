"""The comparison figures of tools/parity.py and the report it prints.

Per position of a logits case: max and mean absolute error, cosine similarity and argmax
agreement, judged against the bound atol + rtol * scale (tolerances: see parity.py's
docstring); per generation: token agreement, the first differing position and whether the
steps committed the same positions.  print_report() writes the text report and
strict_json() makes the figures fit for --json.  Standard library only, like parity.py's
goldens mode; parity.py re-exports these names.
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_runtime import SetupError, join_ids  # noqa: E402


# ---------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------


def argmax_and_gap(row):
    """(first index of the maximum, top-1 minus top-2 value)."""
    best, best_i, second = -math.inf, 0, -math.inf
    for i, v in enumerate(row):
        if v > best:
            best, best_i, second = v, i, best
        elif v > second:
            second = v
    return best_i, best - second


def compare_row(got, ref):
    """Error figures of one position."""
    max_abs = sum_abs = dot = n_got = n_ref = 0.0
    for g, r in zip(got, ref):
        d = abs(g - r)
        if d > max_abs or d != d:  # NaN propagates as a failure
            max_abs = d
        sum_abs += d
        dot += g * r
        n_got += g * g
        n_ref += r * r
    if n_got == 0.0 and n_ref == 0.0:
        cosine = 1.0
    elif n_got == 0.0 or n_ref == 0.0:
        cosine = 0.0
    else:
        cosine = dot / math.sqrt(n_got * n_ref)
    a_got, _ = argmax_and_gap(got)
    a_ref, gap = argmax_and_gap(ref)
    return {
        "max_abs": max_abs,
        "mean_abs": sum_abs / max(1, len(ref)),
        "cosine": cosine,
        "argmax_runtime": a_got,
        "argmax_reference": a_ref,
        "argmax_agree": a_got == a_ref,
        "top2_gap": gap,
    }


def compare_logits(name, ids, got, ref, tol):
    """Per-position figures, the case summary and its verdict."""
    if len(got) != len(ref) or any(len(g) != len(r) for g, r in zip(got, ref)):
        raise SetupError(f"{name}: runtime logits and reference have different shapes")
    scale = max((abs(v) for row in ref for v in row), default=0.0)
    bound = tol["atol"] + tol["rtol"] * scale
    positions = []
    for p, (g, r) in enumerate(zip(got, ref)):
        fig = compare_row(g, r)
        fig["position"] = p
        # a flip is an error only where the reference's own margin exceeds the tolerance
        fig["argmax_decidable"] = fig["top2_gap"] > 2 * bound
        positions.append(fig)
    decidable = [f for f in positions if f["argmax_decidable"]]
    summary = {
        "name": name,
        "ids": list(ids),
        "tokens": len(ref),
        "vocab": len(ref[0]) if ref else 0,
        "scale": scale,
        "bound": bound,
        "max_abs": max(f["max_abs"] for f in positions),
        "mean_abs": sum(f["mean_abs"] for f in positions) / len(positions),
        "min_cosine": min(f["cosine"] for f in positions),
        "argmax_agree": sum(f["argmax_agree"] for f in positions),
        "argmax_decidable": len(decidable),
        "argmax_decidable_agree": sum(f["argmax_agree"] for f in decidable),
    }
    failures = []
    if not summary["max_abs"] <= bound:
        failures.append(f"max abs error {summary['max_abs']:.3g} > bound {bound:.3g}")
    if not summary["min_cosine"] >= tol["min_cosine"]:
        failures.append(f"cosine {summary['min_cosine']:.7f} < {tol['min_cosine']}")
    if summary["argmax_decidable_agree"] != summary["argmax_decidable"]:
        bad = [f["position"] for f in decidable if not f["argmax_agree"]]
        failures.append(f"argmax differs at positions {bad} (reference top-2 gap > 2 x bound)")
    summary["failures"] = failures
    summary["pass"] = not failures
    summary["positions"] = positions
    return summary


def compare_generation(name, prompt, got_ids, got_steps, want_ids, want_steps, min_agreement):
    """Token agreement of two generated canvases (after the prompt) and of their commits."""
    n = len(want_ids)
    agree = sum(1 for a, b in zip(got_ids, want_ids) if a == b)
    if len(got_ids) != n:
        agree = min(agree, n - 1)  # a length mismatch never counts as full agreement
    first = next((i for i, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b), None)
    if first is None and len(got_ids) != n:
        first = min(len(got_ids), n)
    # a step with a zero quota commits nothing; the runtime skips it, numpy records it
    steps_equal = [s for s in got_steps if s[0]] == [s for s in want_steps if s[0]]
    result = {
        "name": name,
        "prompt_len": len(prompt),
        "gen_length": n,
        "tokens_agree": agree,
        "agreement": agree / n if n else 1.0,
        "first_diff": first,  # index into the generated canvas; None when equal
        "first_diff_position": None if first is None else len(prompt) + first,
        "steps_agree": steps_equal,
        "runtime_ids": list(got_ids),
        "reference_ids": list(want_ids),
    }
    failures = []
    if min_agreement is not None:
        if result["agreement"] < min_agreement:
            failures.append(f"token agreement {result['agreement']:.3f} < {min_agreement}")
        if min_agreement >= 1.0 and not steps_equal:
            failures.append("per-step commits differ")
    result["judged"] = min_agreement is not None
    result["failures"] = failures
    result["pass"] = not failures
    return result


def runtime_steps(gen_json):
    """[(positions, tokens)] per step of `unmask generate --json`."""
    return [(list(s["positions"]), list(s["tokens"])) for s in gen_json["steps"]]


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


def print_report(logit_results, gen_results, quiet):
    for r in logit_results:
        if "skipped" in r:
            print(f"\n-- logits: {r['name']}: not comparable ({r['skipped']})")
            continue
        print(
            f"\n-- logits: {r['name']} ({r['tokens']} tokens x {r['vocab']}; "
            f"scale {r['scale']:.4g}, bound {r['bound']:.3g})"
        )
        if not quiet:
            head = ("pos", "max_abs", "mean_abs", "1 - cosine", "argmax rt/ref", "top2 gap")
            print("  {:>4} {:>10} {:>10} {:>11} {:>15} {:>9}".format(*head))
            for f in r["positions"]:
                if f["argmax_agree"]:
                    mark = ""
                else:
                    mark = "  DIFF" if f["argmax_decidable"] else "  diff (near tie)"
                argmaxes = f"{f['argmax_runtime']}/{f['argmax_reference']}"
                print(
                    f"  {f['position']:>4} {f['max_abs']:>10.3e} {f['mean_abs']:>10.3e} {1 - f['cosine']:>11.3e}"
                    f" {argmaxes:>15} {f['top2_gap']:>9.4f}{mark}"
                )
        verdict = "ok" if r["pass"] else "FAIL: " + "; ".join(r["failures"])
        print(
            f"  summary: max_abs {r['max_abs']:.3e}, mean_abs {r['mean_abs']:.3e}, "
            f"min cosine 1 - {1 - r['min_cosine']:.3e}, argmax {r['argmax_agree']}/{r['tokens']} "
            f"({r['argmax_decidable_agree']}/{r['argmax_decidable']} decidable) -> {verdict}"
        )
    if gen_results:
        print("\n-- temperature-0 generations")
    for g in gen_results:
        if "skipped" in g:
            print(f"  {g['name']}: not comparable ({g['skipped']})")
            continue
        if g["first_diff"] is None:
            diff = "none"
        else:
            diff = f"canvas index {g['first_diff']} (position {g['first_diff_position']})"
        if not g["judged"]:
            verdict = "reported only"
        else:
            verdict = "ok" if g["pass"] else "FAIL: " + "; ".join(g["failures"])
        print(
            f"  {g['name']}: tokens {g['tokens_agree']}/{g['gen_length']} ({100 * g['agreement']:.1f}%), "
            f"first difference {diff}, step commits {'equal' if g['steps_agree'] else 'differ'} -> {verdict}"
        )
        if g["first_diff"] is not None:
            print(f"    runtime:   {join_ids(g['runtime_ids'])}")
            print(f"    reference: {join_ids(g['reference_ids'])}")


def strict_json(obj):
    """The structure with non-finite floats written as strings ("inf", "nan"), which
    plain JSON cannot hold (a top-2 gap is infinite when a row has one finite logit)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj
