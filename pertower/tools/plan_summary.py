"""How a plan computes a network's weights, counted: the summary `pertower explain`
(the command) and `python -m benchmarks --models` print per network.

A plan (`pertower.explain`) gives each weight a method: "rules" (per-op rules: one
batched pass), "towers" (weight-copy towers), "passes" (one backward pass per example,
past a TF1 while loop) or "unreached" (`ys` does not depend on it). This module counts
them and groups the weights that fall back by their reason.
"""

import collections

__all__ = ["METHOD_ORDER", "method_counts", "fallback_reasons", "counts_cell", "summarize"]

METHOD_ORDER = ("rules", "towers", "passes", "unreached")


def method_counts(plan):
    """{method: number of weights} over METHOD_ORDER (every key present, zeros included)."""
    counts = collections.Counter(w.method for w in plan.weights)
    return {method: counts.get(method, 0) for method in METHOD_ORDER}


def fallback_reasons(plan):
    """[(reason, [weight names])] for the weights on towers or row passes, the most
    frequent reason first."""
    groups = collections.defaultdict(list)
    for weight in plan.weights:
        if weight.method in ("towers", "passes"):
            groups[weight.reason or "(no reason given)"].append(weight.name)
    return sorted(groups.items(), key=lambda item: -len(item[1]))


def counts_cell(counts):
    """A short cell for a table: "214/0/0" (rules/towers/passes; unreached added as
    "+N unreached" when any)."""
    text = f"{counts['rules']}/{counts['towers']}/{counts['passes']}"
    return text + (f" +{counts['unreached']} unreached" if counts["unreached"] else "")


def summarize(plan, title="weights", max_names=3):
    """A few lines: the count of weights per method, then each fallback reason with the
    first `max_names` weights it concerns.

    Args:
      plan: a `pertower.Plan` (from `pertower.explain`).
      title: what the first line names (e.g. the network's name).
      max_names: weight names listed per reason.

    Returns:
      The text (no trailing newline).
    """
    counts = method_counts(plan)
    total = sum(counts.values())
    lines = [f"{title}: {total} weights: " + ", ".join(
        f"{counts[m]} {m}" for m in METHOD_ORDER if counts[m] or m != "unreached")
        + ("; batch_size not needed" if not counts["towers"] + counts["passes"]
           else "; batch_size needed (towers or row passes are built for a fixed B)")]
    for reason, names in fallback_reasons(plan):
        shown = ", ".join(names[:max_names]) + (f", ... ({len(names)} in all)"
                                                if len(names) > max_names else "")
        lines.append(f"  {len(names)} fall back: {reason} [{shown}]")
    return "\n".join(lines)
