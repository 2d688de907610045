"""Argument checks and graph facts shared by every method (towers, rules, auto).

`prepare` runs the checks of `pertower.towers.build` in the same order with the same
messages (it calls the towers' own `_batch_tensors` and `_batch_size`), so that bad
input is refused the same way whichever method computes the gradients.
"""

import collections

from pertower import _checks
from pertower import graph_walk
from pertower import towers as towers_lib


class Prepared(collections.namedtuple(
        "Prepared", ["ys", "xs", "graph", "ys_upstream", "batch", "batch_size",
                     "num_groups", "reads"])):
    """Checked inputs.

    Fields:
      ys, xs (list), graph: as given, checked.
      ys_upstream: the ops `ys` depends on.
      batch: the batch tensors (found or checked).
      batch_size: B, or None when the batch axis is not static and no batch_size was
        given (allowed only for method="rules").
      num_groups: M for microbatches, or None for one group per example.
      reads: one `graph_walk.WeightReads` per entry of xs.
    """


def prepare(ys, xs, batch, num_groups, batch_size, function_name, groups_argument,
            batch_size_required):
    """Checks the arguments of a public gradient function; returns a `Prepared`.

    Args:
      ys, xs, batch, batch_size: as given to the public function.
      num_groups: M (microbatches or towers), or None.
      function_name: the public function's name, for messages.
      groups_argument: the name of the argument that gave `num_groups`.
      batch_size_required: whether a None batch axis needs `batch_size` (the towers'
        contract); when False and neither is known, B is left to run time.
    """
    _checks.require_graph_mode(function_name)
    ys = _checks.require_graph_tensor(ys, "ys", function_name)
    graph = ys.graph
    if graph.finalized:
        raise RuntimeError(
            f"pertower.{function_name}: the graph of `ys` is finalized (a "
            "MonitoredSession or graph.finalize() froze it). Build the towers before "
            "the graph is finalized.")
    if ys.shape.rank == 0:
        raise ValueError(
            f"pertower.{function_name}: `ys` ({ys.name}) is a scalar, but it needs a batch "
            "axis on axis 0 with one value per example. Pass the unreduced per-example "
            "values (for example a loss built with reduction=NONE, before tf.reduce_mean).")
    if not ys.dtype.is_floating:
        raise TypeError(
            f"pertower.{function_name}: `ys` ({ys.name}) must be a floating-point tensor, "
            f"but has dtype {ys.dtype.name}.")
    xs = _checks.as_list(xs)
    if not xs:
        raise ValueError(f"pertower.{function_name}: `xs` is empty; pass at least one weight.")
    with graph.as_default():
        ys_upstream = graph_walk.upstream_ops([ys])
        batch = towers_lib._batch_tensors(  # pylint: disable=protected-access
            ys, batch, ys_upstream, graph, function_name)
        static_known = any(_checks.static_batch_size(b) is not None for b in batch)
        if batch_size_required or static_known or batch_size is not None:
            B = towers_lib._batch_size(  # pylint: disable=protected-access
                ys, batch, batch_size, function_name)
        else:
            B = None
        M = None if num_groups is None else _checks.positive_int(
            num_groups, groups_argument, function_name)
        if M is not None and B is not None and B % M:
            raise ValueError(
                f"pertower.{function_name}: `{groups_argument}` ({M}) must divide the batch "
                f"size ({B}); choose a divisor of {B}, or feed a batch whose size is a "
                f"multiple of {M}.")
        batch_downstream = graph_walk.downstream_ops(batch, ys_upstream)
        if ys.op not in batch_downstream and all(ys is not b for b in batch):
            raise ValueError(
                f"pertower.{function_name}: `ys` ({ys.name}) does not depend on the batch "
                f"({', '.join(t.name for t in batch)}); pass the per-example values "
                "computed from the batch.")
        reads = [graph_walk.weight_reads(x, k, ys_upstream, batch, function_name)
                 for k, x in enumerate(xs)]
    return Prepared(ys, xs, graph, ys_upstream, batch, B, M, reads)
