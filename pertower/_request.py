"""Argument checks and graph facts shared by every method (towers, rules, auto).

`prepare` runs the argument checks of every public function (towers, rules, auto), so
that bad input is refused the same way whichever method computes the gradients: `ys`,
`xs`, the batch tensors and B, the number of groups, that `ys` depends on the batch,
that no op couples examples (`pertower._batch_axis`), and where each weight is read.
The batch-axis analysis runs once here and is kept on the result (`Prepared.analysis`)
for the rules.
"""

import collections

from pertower import _checks
from pertower import _graph_walk as graph_walk
from pertower import _batch_axis


class Prepared(collections.namedtuple(
        "Prepared", ["ys", "xs", "graph", "ys_upstream", "batch", "batch_size",
                     "num_groups", "reads", "analysis", "groups_argument"])):
    """Checked inputs.

    Fields:
      ys, xs (list), graph: as given, checked; a Keras 3 variable in xs is replaced by
        the tf.Variable holding its value.
      ys_upstream: the ops `ys` depends on.
      batch: the batch tensors (found or checked).
      batch_size: B, or None when the batch axis is not static and no batch_size was
        given (allowed only for method="rules").
      num_groups: M for microbatches, or None for one group per example.
      reads: one `graph_walk.WeightReads` per entry of xs.
      analysis: the `pertower._batch_axis.Analysis` of the ops between the batch and
        `ys` (its `registry` attribute: the rule registry it was run with).
      groups_argument: the public name of the number of groups, for messages.
    """

    def restricted(self, indices):
        """The same checked inputs for xs[k], k in `indices`, only (the weights one
        method leaves to another)."""
        return self._replace(xs=[self.xs[k] for k in indices],
                             reads=[self.reads[k] for k in indices])


def prepare(ys, xs, batch, num_groups, batch_size, function_name, groups_argument,
            batch_size_required, registry=None, refuse_couplings=True):
    """Checks the arguments of a public gradient function; returns a `Prepared`.

    Args:
      ys, xs, batch, batch_size: as given to the public function.
      num_groups: M (microbatches or towers), or None.
      function_name: the public function's name, for messages.
      groups_argument: the name of the argument that gave `num_groups`.
      batch_size_required: whether a None batch axis needs `batch_size` (the towers'
        contract); when False and neither is known, B is left to run time.
      registry: the `pertower.rules.RuleRegistry` whose rules may declare the row
        layout of their ops (`Rule.output_layouts`) to the analysis, or None.
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
    xs = _checks.weight_list(xs, "xs", function_name)  # Keras 3 variables: their tf.Variable
    if not xs:
        raise ValueError(f"pertower.{function_name}: `xs` is empty; pass at least one weight.")
    with graph.as_default():
        ys_upstream = graph_walk.upstream_ops([ys])
        batch = _batch_tensors(ys, batch, ys_upstream, graph, function_name)
        static_known = any(_checks.static_batch_size(b) is not None for b in batch)
        if batch_size_required or static_known or batch_size is not None:
            B = _batch_size(ys, batch, batch_size, function_name)
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
        # refuse ops that couple examples (with one group holding the whole batch,
        # coupling changes nothing); pertower.explain records them instead
        analysis = _batch_axis.analyze(ys, batch, ys_upstream, B, M, registry)
        if refuse_couplings and analysis.couplings and (B if M is None else M) != 1:
            raise ValueError(analysis.couplings[0].message(function_name))
        reads = [graph_walk.weight_reads(x, k, ys_upstream, batch, function_name)
                 for k, x in enumerate(xs)]
    return Prepared(ys, xs, graph, ys_upstream, batch, B, M, reads, analysis,
                    groups_argument)


def _batch_tensors(ys, batch, ys_upstream, graph, function_name):
    if batch is None:
        return graph_walk.find_batch_tensors(ys, ys_upstream)
    batch = _checks.as_list(batch)
    if not batch:
        raise ValueError(f"pertower.{function_name}: `batch` is empty; pass the batch "
                         "tensor(s), or None to find them.")
    for j, b in enumerate(batch):
        _checks.require_graph_tensor(b, f"batch[{j}]", function_name)
        if b.graph is not graph:
            raise ValueError(f"pertower.{function_name}: `batch[{j}]` ({b.name}) is in "
                             "another graph than `ys`.")
        if b.shape.rank == 0:
            raise ValueError(f"pertower.{function_name}: `batch[{j}]` ({b.name}) is a "
                             "scalar; batch tensors need the batch on axis 0.")
    return batch


def _batch_size(ys, batch, batch_size, function_name):
    """B: the static batch size of the batch tensors, or `batch_size`."""
    static = {}
    for b in batch:
        size = _checks.static_batch_size(b)
        if size is not None:
            static.setdefault(size, b)
    if len(static) > 1:
        listing = ", ".join(f"{b.name} has {n}" for n, b in static.items())
        raise ValueError(f"pertower.{function_name}: the batch tensors have different "
                         f"static batch sizes ({listing}); they must share axis 0.")
    if batch_size is not None:
        batch_size = _checks.positive_int(batch_size, "batch_size", function_name)
    if static:
        (B, b), = static.items()
        if batch_size is not None and batch_size != B:
            raise ValueError(f"pertower.{function_name}: `batch_size` is {batch_size}, but "
                             f"the batch tensor {b.name} has a static batch size of {B}.")
    elif batch_size is None:
        names = ", ".join(f"{b.name} {b.shape}" for b in batch)
        raise ValueError(
            f"pertower.{function_name}: the batch axis is not static ({names}), so "
            "`batch_size` is needed: pass batch_size=B, the number of examples you will "
            "feed. Towers are built for a fixed number of examples.")
    else:
        B = batch_size
    ys_rows = _checks.static_batch_size(ys)
    if ys_rows is not None and ys_rows != B:
        raise ValueError(f"pertower.{function_name}: `ys` ({ys.name}) has {ys_rows} "
                         f"rows on axis 0, but the batch has {B} examples.")
    return B
