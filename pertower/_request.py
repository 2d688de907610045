"""The request: a public call's arguments checked once, into one `Request` record.

Notation as in `pertower._graph_walk`; M microbatches (groups of B/M examples).

`make_request` takes `ys`, `xs`, `Examples` (where the examples are) and `Options` (how
to compute) and runs the checks every method shares; the graph facts every later stage
reads are found here once and kept on the record.
"""

import collections.abc
import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower import _batch_sizes
from pertower import _checks
from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _tf
from pertower import _weight_reads

__all__ = ["METHODS", "Examples", "Options", "Request", "make_request", "check_method"]

METHODS = ("auto", "towers", "rules")


def check_method(method):
    if not isinstance(method, str) or method not in METHODS:
        raise _context.error(ValueError, f"`method` must be one of {METHODS}, got {method!r}.")
    return method


@dataclasses.dataclass(frozen=True)
class Examples:
    """Where the examples are: `batch`, `batch_size`, `batch_axis` as given, M
    `num_groups` (None: per example) and its public name; `size_required`: a None batch
    axis needs `batch_size` (the towers' contract), else B may be left to run time."""

    batch: object = None
    batch_size: object = None
    num_groups: object = None
    batch_axis: object = None
    groups_argument: str = "num_microbatches"
    size_required: bool = False


@dataclasses.dataclass(frozen=True)
class Options:
    """How to build the result, checked when made (the public options: `pertower._docs`).

    Attributes:
      registry: the `pertower.rules.RuleRegistry`, or None for the towers alone.
      outputs_per_example: K for Jacobians, else 1.
      forms_gradients: False for the norms (the rules form no [B, P] tensor).
      refuse: False for `pertower.explain` (what cannot be built goes to the plan).
      batch_capacity: None, or N (DPOptimizer's `max_batch_size`): with a None batch
        axis and no batch_size the towers take any fed batch of at most N, padded.
    """

    method: str = "auto"
    registry: object = None
    sparse: bool = False
    validate: object = None
    memory_limit: object = None
    outputs_per_example: int = 1
    forms_gradients: bool = True
    refuse: bool = True
    batch_capacity: object = None

    def __post_init__(self):
        check_method(self.method)
        if not isinstance(self.validate, (bool, type(None))):
            raise _context.error(
                ValueError, "`validate` must be None (the default: check at run time only "
                "where the static analysis could not prove that the examples are "
                f"independent), True (always check) or False (never), but received "
                f"{self.validate!r}.")
        _checks.check_memory_limit(self.memory_limit)


@dataclasses.dataclass(frozen=True)
class Request:
    """One public call's checked arguments and the graph facts every stage reads.

    Attributes:
      ys, xs (list), graph: as given, checked (a Keras 3 variable: its tf.Variable).
      ys_upstream: the ops `ys` depends on.
      batch, batch_axes, static_sizes: the batch tensors, the axis of each that
        carries the batch (`ys` has it on axis 0), and its static size or None.
      ys_rows: the static size of axis 0 of `ys`, or None.
      batch_size: B, or None when unknown (allowed only where no towers are built).
      num_groups, groups_argument: M or None, and its public name.
      reads: one `_weight_reads.WeightReads` per entry of xs.
      analysis: the `pertower._batch_axis.Analysis` of the ops between batch and `ys`.
      segments: None, or when `ys` joins several batches along axis 0 one (batch
        indices, B_s) pair per batch in row order, e.g. (((0,), 2), ((1,), 3)).
      batch_downstream: S, the ops of ys_upstream that depend on a batch tensor.
      weight_regions: per entry of xs, the ops downstream of its reads (`WeightRegions`).
      loop_op: the first TF1 (v1) while loop op on the way to `ys`, or None.
      options: the call's `Options`.
    """

    ys: tf.Tensor
    xs: list
    graph: tf.Graph
    ys_upstream: frozenset
    batch: list
    batch_axes: tuple
    static_sizes: tuple
    ys_rows: object
    batch_size: object
    num_groups: object
    groups_argument: str
    reads: list
    analysis: object
    segments: object
    batch_downstream: frozenset
    weight_regions: object
    loop_op: object
    options: Options = Options()

    def restricted(self, indices):
        """The same request for xs[k], k in `indices`, only."""
        return dataclasses.replace(
            self, xs=[self.xs[k] for k in indices], reads=[self.reads[k] for k in indices],
            weight_regions=tuple(self.weight_regions[k] for k in indices))

    def per_example(self):
        """The same request with one group per example (M = B)."""
        return dataclasses.replace(self, num_groups=None)

    @property
    def replay_region(self):
        """The ops the towers replay: S and the ops downstream of the weights' reads."""
        return self.batch_downstream.union(*self.weight_regions)

    @property
    def any_static_size(self):
        """Whether some batch tensor's batch axis is static."""
        return any(size is not None for size in self.static_sizes)


def make_request(ys, xs, examples=Examples(), options=Options(), *, ys_argument="ys",
                 scalar_advice=None, weights_required=True):
    """Checks the arguments of a public function; returns a `Request`. `ys_argument`:
    the public name of `ys`; `scalar_advice`: what to say when `ys` is a scalar;
    weights_required=False for a forward-only replay."""
    batch, batch_size, num_groups = examples.batch, examples.batch_size, examples.num_groups
    groups_argument = examples.groups_argument
    _checks.require_graph_mode()
    ys = _checks.require_graph_tensor(ys, ys_argument)
    graph = ys.graph
    if graph.finalized:
        raise _context.error(
            RuntimeError, f"the graph of `{ys_argument}` is finalized (a MonitoredSession "
            "or graph.finalize() froze it). Build the towers before the graph is finalized.")
    if ys.shape.rank == 0:
        raise _context.error(ValueError, f"`{ys_argument}` ({ys.name}) is a scalar, but " + (
            scalar_advice or "it needs a batch axis on axis 0 with one value per example. "
            "Pass the unreduced per-example values (for example a loss built with "
            "reduction=NONE, before tf.reduce_mean)."))
    if not ys.dtype.is_floating:
        raise _context.error(
            TypeError, f"`{ys_argument}` ({ys.name}) must be a floating-point tensor, but "
            f"has dtype {ys.dtype.name}.")
    xs = _checks.weight_list(xs, "xs")  # Keras 3 variables: their tf.Variable
    if not xs and weights_required:
        raise _context.error(ValueError, "`xs` is empty; pass at least one weight.")
    with graph.as_default():
        ys_upstream = graph_walk.OpRegion(graph_walk.upstream_ops([ys]))
        found = batch is None
        batch = _batch_tensors(ys, batch, ys_upstream, graph)
        axes = _batch_sizes.batch_axes(examples.batch_axis, batch)
        # each batch tensor's static size, read once here for every later stage
        static_sizes = tuple(graph_walk.static_batch_size(b, a) for b, a in zip(batch, axes))
        ys_rows = graph_walk.static_batch_size(ys)
        M = None if num_groups is None else _checks.positive_int(
            num_groups, groups_argument)
        batch_downstream = frozenset(graph_walk.downstream_ops(batch, ys_upstream))
        if ys.op not in batch_downstream and all(ys is not b for b in batch):
            raise _context.error(
                ValueError, f"`{ys_argument}` ({ys.name}) does not depend on the batch "
                f"({', '.join(t.name for t in batch)}); pass the per-example values "
                "computed from the batch.")
        analysis = _batch_axis.analyze(ys, batch, ys_upstream,
                                       _batch_sizes.size_hint(static_sizes, batch_size), M,
                                       options.registry, batch_axes=axes)
        segments, joined = None, analysis.segments
        if joined is None and analysis.verdict == "unproven":
            # the proof was lost before a join the graph still shows (checked at run time)
            joined = _batch_sizes.concat_segments(ys, batch)
        if joined is not None:
            # `ys` joins several batches along axis 0: B = B_1 + B_2 + ...
            B, segments = _batch_sizes.segment_sizes(
                ys, batch, axes, static_sizes, ys_rows, joined, batch_size, M,
                groups_argument)
        else:
            if options.refuse and analysis.couplings and isinstance(batch_size, (list, tuple)):
                raise ValueError(analysis.couplings[0].message())   # (the real reason)
            batch_size = _batch_sizes.one_batch_size(batch_size, batch, analysis.lost_at)
            if (examples.size_required or any(s is not None for s in static_sizes)
                    or batch_size is not None):
                B = _batch_sizes.batch_size_of(ys, batch, axes, static_sizes, ys_rows,
                                               batch_size)
            else:
                B = None
            if M is not None and B is not None and B % M:
                raise _context.error(
                    ValueError, f"`{groups_argument}` ({M}) must divide the batch size "
                    f"({B}); choose a divisor of {B}, or feed a batch whose size is a "
                    f"multiple of {M}.")
        # refuse ops that couple examples (with one group holding the whole batch,
        # coupling changes nothing); pertower.explain records them instead
        if options.refuse and analysis.couplings and (B if M is None else M) != 1:
            coupling = analysis.couplings[0]
            raise ValueError(coupling.message(_side_input_hint(coupling.op, batch) if found
                                              else ""))
        reads = [_weight_reads.weight_reads(x, k, ys_upstream, batch)
                 for k, x in enumerate(xs)]
        # the ops downstream of any weight's reads and of the TF1 loops taking a handle
        read_region = set(_weights_region(reads, ys_upstream))
        for op in {op for r in reads for op in r.loop_inputs}:
            read_region |= {op} | graph_walk.downstream_ops(op.outputs, ys_upstream)
    loops = [op for op in batch_downstream.union(read_region)
             if op.type in op_types.V1_LOOP_OP_TYPES]
    loop_op = min(loops, key=_tf.op_order_key()) if loops else None
    return Request(ys=ys, xs=xs, graph=graph, ys_upstream=ys_upstream, batch=batch,
                   batch_axes=tuple(axes), static_sizes=static_sizes, ys_rows=ys_rows,
                   batch_size=B, num_groups=M, groups_argument=groups_argument, reads=reads,
                   analysis=analysis, segments=segments, batch_downstream=batch_downstream,
                   weight_regions=WeightRegions(reads, ys_upstream), loop_op=loop_op,
                   options=options)


class WeightRegions(collections.abc.Sequence):
    """Per entry of xs, the ops of ys_upstream downstream of its reads (read tensors,
    gathers and function calls), each walked the first time it is asked for."""

    def __init__(self, reads, ys_upstream):
        self._reads, self._within, self._found = tuple(reads), ys_upstream, {}

    def __len__(self):
        return len(self._reads)

    def __getitem__(self, k):
        k = range(len(self))[k]   # (an IndexError ends the iteration)
        if k not in self._found:
            self._found[k] = _weights_region([self._reads[k]], self._within)
        return self._found[k]

    def walked(self):
        return len(self._found)


def _weights_region(reads, ys_upstream):
    """The ops of ys_upstream downstream of the reads of the weights of `reads` (one
    walk for all of them), with their gather and call ops."""
    starts = {op for r in reads for op in r.gather_ops} | {
        op for r in reads for op, _ in r.call_inputs}
    tensors = [t for r in reads for t in r.read_tensors]
    tensors += [t for op in sorted(starts, key=_tf.op_order_key())
                for t in op.outputs]
    return frozenset(graph_walk.downstream_ops(tensors, ys_upstream) | starts)


def _batch_tensors(ys, batch, ys_upstream, graph):
    if batch is None:
        return graph_walk.find_batch_tensors(ys, ys_upstream)
    batch = _checks.as_list(batch)
    if not batch:
        raise _context.error(ValueError, "`batch` is empty; pass the batch "
                         "tensor(s), or None to find them.")
    # a tf.Variable holding the data stands for its reads on the way to `ys`
    batch = [t for j, b in enumerate(batch) for t in (
        _variable_reads(b, j, ys_upstream) if isinstance(b, tf.Variable) else [b])]
    for j, b in enumerate(batch):
        _checks.require_graph_tensor(b, f"batch[{j}]")
        if b.graph is not graph:
            raise _context.error(ValueError,f"`batch[{j}]` ({b.name}) is in "
                             "another graph than `ys`.")
        if b.shape.rank == 0:
            raise _context.error(ValueError,f"`batch[{j}]` ({b.name}) is a "
                             "scalar; batch tensors need the batch on axis 0.")
    return batch


def _variable_reads(variable, j, ys_upstream):
    """The reads of `variable` that `ys` depends on; raises when there is none."""
    source = (_tf.handle_in_graph(variable.handle, tf.compat.v1.get_default_graph())
              if hasattr(variable, "handle") else variable.op.outputs[0])
    consumers = source.consumers() if source is not None else ()   # (None: not captured)
    reads = [op.outputs[0] for op in consumers if op in ys_upstream and (
        op.type in op_types.VARIABLE_READ_OP_TYPES or op.type == "Identity")]
    if not reads:
        raise _context.error(ValueError, f"`batch[{j}]` is the variable {variable.name!r}, "
                             "but the per-example values do not read it; pass the variable "
                             "(or tensor) holding the batch they are computed from.")
    order = _tf.op_order_key()
    return sorted(reads, key=lambda t: order(t.op))


def _side_input_hint(op, batch):
    """The lead of the refusal saying how to leave out found batch tensors that the
    coupling op reads, which may be side inputs (class weights gathered by label), or ""."""
    read = op.inputs[0] if op.inputs else None
    suspects = [b for b in batch if b is read]
    others = [b for b in batch if b is not read]
    if not suspects or not others:
        return ""
    return ("`batch=` decides which placeholders hold examples; without it every one "
            "`ys` reads was taken for a batch input "
            f"({', '.join(b.name for b in batch)}). If "
            f"{', '.join(b.name for b in suspects)} is not per-example data but a side "
            "input (class weights indexed by label, a lookup table fed with the batch), "
            f"pass batch=[{', '.join(b.name for b in others)}] (the tensors that carry the "
            "examples), and it is read whole by every example. Otherwise, ")
