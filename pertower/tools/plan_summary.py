"""How a plan computes a network's weights, counted: the summary `pertower explain`
and `python -m benchmarks --models` print per network.

A plan (`pertower.explain`) gives each weight a method: "rules" (per-op rules: one
batched pass), "towers" (weight-copy towers), "passes" (one backward pass per example,
past a TF1 while loop) or "unreached" (`ys` does not depend on it).
"""

import collections

__all__ = ["METHOD_ORDER", "method_counts", "counts_cell", "summarize"]

METHOD_ORDER = ("rules", "towers", "passes", "unreached")


def method_counts(plan):
    """{method: number of weights} over METHOD_ORDER (every key present, zeros included)."""
    counts = collections.Counter(w.method for w in plan.weights)
    return {method: counts.get(method, 0) for method in METHOD_ORDER}


def counts_cell(counts):
    """A table cell: "214/0/0" (rules/towers/passes), then "+N unreached" if any."""
    text = f"{counts['rules']}/{counts['towers']}/{counts['passes']}"
    return text + (f" +{counts['unreached']} unreached" if counts["unreached"] else "")


def summarize(plan, title="weights", max_names=3):
    """Text (no trailing newline) for a `pertower.Plan`: a line titled `title` (e.g.
    the network's name) counting the weights per method, then each reason of the
    weights on towers or row passes, the most frequent first, with its first
    `max_names` weights."""
    counts = method_counts(plan)
    total = sum(counts.values())
    lines = [f"{title}: {total} weights: " + ", ".join(
        f"{counts[m]} {m}" for m in METHOD_ORDER if counts[m] or m != "unreached")
        + ("; batch_size not needed" if not counts["towers"] + counts["passes"]
           else "; batch_size needed (towers or row passes are built for a fixed B)")]
    reasons = collections.defaultdict(list)
    for weight in plan.weights:
        if weight.method in ("towers", "passes"):
            reasons[weight.reason or "(no reason given)"].append(weight.name)
    for reason, names in sorted(reasons.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(names[:max_names]) + (f", ... ({len(names)} in all)"
                                                if len(names) > max_names else "")
        lines.append(f"  {len(names)} fall back: {reason} [{shown}]")
    return "\n".join(lines)
