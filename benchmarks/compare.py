"""Comparing a row's result with the loop's, row by row (numpy only: the peers' child
processes use it too).

Notation:
    B   examples        x   one weight      [B, *x.shape] one gradient of x per example
"""

import numpy as np

__all__ = ["compare", "reference_for"]


def compare(values, reference):
    """(max |value - reference|, max |reference|, where) over lists of arrays, row by
    row (the temporaries stay one example's size); `where` is [k, i], the weight and
    the example (row) of the largest difference (i None for an array without a batch
    axis); (inf, 0, None) when the shapes differ."""
    diff = scale = 0.0
    where = None
    if len(values) != len(reference):
        return float("inf"), 0.0, None
    for k, (got, want) in enumerate(zip(values, reference)):
        got = np.asarray(got)
        if got.shape != want.shape:
            return float("inf"), 0.0, None
        rows = enumerate(zip(got, want)) if got.ndim else [(None, (got, np.asarray(want)))]
        for i, (got_row, want_row) in rows:
            if want_row.size:
                row_diff = float(np.max(np.abs(got_row - want_row)))
                if row_diff > diff or where is None:
                    diff, where = max(diff, row_diff), [k, i]
                scale = max(scale, float(np.max(np.abs(want_row))))
    return diff, scale, where


def reference_for(computes, loop_gradients):
    """What an entry's result is compared with, from the loop's [B, *x.shape] list."""
    if computes == "gradients":
        return loop_gradients
    if computes == "sum":
        return [g.sum(axis=0) for g in loop_gradients]
    squares = sum(np.square(g.astype(np.float64)).reshape(len(g), -1).sum(axis=1)
                  for g in loop_gradients)
    return [np.sqrt(squares)]                                    # [B]
