"""The forward analysis: one pass over the ops S between the batch and `ys`.

Notation: as in `lattice`. Per-example gradients are defined when row i of `ys` depends
on example i alone. `analyze` walks S once in graph order and gives every tensor a
lattice value from its inputs' values by one table of transfer functions (`TRANSFERS`,
op type -> `f(scan, op, ins)`, from the `transfer_*` modules and `functions`). It finds
the couplings (ops that reduce, contract, sort, shift or pick along the batch axis), the
first op where the batch axis was lost, and the edges where a value computed from the
batch's *size* enters a value computation (`size_uses`). `verdict.Analysis` turns what
the scan found into the verdict.
"""

import tensorflow as tf

from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _tf
from pertower._batch_axis import functions
from pertower._batch_axis import lattice
from pertower._batch_axis import size_uses
from pertower._batch_axis import static
from pertower._batch_axis import transfer_blocks
from pertower._batch_axis import transfer_compute
from pertower._batch_axis import transfer_index
from pertower._batch_axis import transfer_layout
from pertower._batch_axis import transfer_lookups
from pertower._batch_axis import verdict
from pertower._batch_axis.verdict import Analysis
from pertower._batch_axis.lattice import INDEPENDENT, SIZE, UNKNOWN, Rows

__all__ = ["Analysis", "analyze", "find_couplings"]

TRANSFERS = {**transfer_layout.TRANSFERS, **transfer_index.TRANSFERS, **transfer_compute.TRANSFERS,
             **functions.TRANSFERS, **transfer_blocks.TRANSFERS, **transfer_lookups.TRANSFERS}
# Ops whose transfer functions read UNKNOWN inputs themselves.
_READS_UNKNOWN = (transfer_compute.READS_UNKNOWN | functions.CONTROL_FLOW_OP_TYPES
                  | transfer_lookups.READS_UNKNOWN | {"Reshape", "IdentityN"})
# Ops whose outputs may carry the batch's rows when their inputs carry only its size.
_READS_SIZE = (op_types.SHAPED_BY_SIZE_OP_TYPES | frozenset(functions.TRANSFERS)
               | {"BroadcastTo"})
# Passes over a region with TF1 loops before their values must have settled.
_MAX_LOOP_PASSES = 6
_MAX_DEPTH = 8


class _Scan:
    """Lattice values of the tensors of one graph (or function body), filled by `run`."""

    def __init__(self, seeds, region, targets=(), registry=None, static_batch_size=None,
                 depth=0, function_cache=None, seed_parts=False):
        self.values, self.seeds = lattice.TensorMap(), lattice.TensorMap()
        for tensor, value in seeds:
            self.values[tensor] = value
            self.seeds[tensor] = True
        # whose examples each tensor's rows hold, when `ys` joins several batches
        self.batches = verdict.JoinedBatches([t for t, _ in seeds] if seed_parts else ())
        self.region = set(region)
        self.targets = list(targets)
        self.registry = registry
        self.static_batch_size = static_batch_size
        self.depth = depth
        self.function_cache = {} if function_cache is None else function_cache
        self.couplings = []
        self.losses = []          # (op, reason), in graph order
        self.doubts = []          # ops whose result the analysis could not prove harmless
        self.size_data_edges = []
        self.flows = lattice.TensorMap()   # TensorArray flows carrying Rows
        self.shape_value = static.ShapeEvaluator(self.value_of, seeds)

    def value_of(self, tensor):
        return self.values.get(tensor, INDEPENDENT)

    def run(self):
        """Fills the values in graph order. A TF1 loop's back edges (NextIteration ->
        Merge) are read on the next pass: passes repeat until the values they carry
        settle; what the last pass found is kept."""
        order = _topological(self.region)
        merges = [op for op in order if op.type in op_types.V1_MERGE_OP_TYPES and any(
            t.op.type in op_types.V1_NEXT_ITERATION_OP_TYPES for t in op.inputs)]
        # the values the back edges hand to the Merges (a Merge comes before its body
        # in `order`, so it reads them on the next pass)
        back = [t for op in merges for t in op.inputs if _back_edge(t, op)]
        for _ in range(_MAX_LOOP_PASSES):
            before = [self.value_of(t) for t in back]
            self.couplings, self.losses, self.doubts, self.size_data_edges = [], [], [], []
            self.shape_value.memo = lattice.TensorMap()   # (values may change per pass)
            self._pass(order)
            if [self.value_of(t) for t in back] == before:
                return self
        self.lose(merges[0], "the values of its TF1 while loop's variables did not settle")
        return self

    def _pass(self, order):
        for op in order:
            ins = [self.value_of(t) for t in op.inputs]
            if all(v is INDEPENDENT for v in ins):
                continue
            outs = None
            if functions.reads_example(op, ins):
                outs = self._apply(functions.example_transfer, op, ins)
            outs = outs if outs is not None else self._user_layouts(op, ins)
            if outs is None:   # (a SIZE that is a constant, tf.shape(x)[-1]: INDEPENDENT)
                outs = static.constant_sizes(self.shape_value, op, self._transfer(op, ins))
            self._record_size_edges(op, ins, outs)
            self._store(op, ins, outs)

    def _user_layouts(self, op, ins):
        rule = self.registry.lookup(op.type) if self.registry is not None else None
        if rule is None:
            return None
        outs = rule.output_layouts(op, [transfer_blocks.known(v) for v in ins])
        return None if outs is None else [UNKNOWN if v is None else v for v in outs]

    def _transfer(self, op, ins):
        n = len(op.outputs)
        if op.type in op_types.SHAPE_OP_TYPES:
            if op.type == "ShapeN":
                return [UNKNOWN if v is UNKNOWN else SIZE for v in ins]
            return [UNKNOWN if ins[0] is UNKNOWN else SIZE] * n
        slots = static.shape_slots(op)
        lost_upstream = op.type not in _READS_UNKNOWN and any(
            v is UNKNOWN for j, v in enumerate(ins) if j not in slots)
        if lost_upstream or transfer_blocks.misread(self, op, ins):
            return [UNKNOWN] * n   # lost upstream (no new loss), or a SpaceToBatchND's blocks
        if op.type not in _READS_SIZE and not any(lattice.depends_on_values(v) for v in ins):
            return [SIZE] * n
        if op.type not in TRANSFERS:
            self.lose(op, "the analysis does not know this op type")
            return [UNKNOWN] * n
        return self._apply(TRANSFERS[op.type], op, ins)

    def _apply(self, transfer, op, ins):
        """The outputs' values by `transfer`; UNKNOWN where it raises (recorded)."""
        try:
            return list(transfer(self, op, ins))
        except lattice.Coupled as coupled:
            self.couplings.append(lattice.Coupling(op, coupled.reason, coupled.advice))
        except lattice.Lost as lost:
            self.lose(op, lost.reason)
        except (ValueError, TypeError, IndexError, KeyError, AttributeError) as error:
            # an op whose attributes or shapes cannot be read: the analysis loses the
            # batch axis here rather than failing the user's call
            self.lose(op, f"its attributes or shapes could not be read ({error})")
        return [UNKNOWN] * len(op.outputs)

    def _store(self, op, ins, outs):
        ks = {v.k for v in ins if isinstance(v, Rows)}
        common_k = ks.pop() if len(ks) == 1 else None
        parts = self.batches.output_parts(op, ins)
        if parts is None:
            self.lose(op, "it combines the rows of several batches joined along the batch "
                          "axis with rows in another order")
            outs = [UNKNOWN] * len(outs)
        for tensor, value in zip(op.outputs, outs):
            if tensor in self.seeds:
                continue
            self.batches.record(tensor, parts, value)
            if isinstance(value, int) and not isinstance(value, bool):
                value = Rows(value, common_k, None)
            if isinstance(value, Rows) and self._is_flow(op, tensor):
                self.flows[tensor] = True   # (flows and TensorLists hold their elements')
            elif isinstance(value, Rows) and tensor.dtype != tf.variant:
                value = lattice.complete(value, tensor.shape)
                if value is None:
                    self.lose(op, f"its output {tensor.name} would split an example's "
                                  "entries across rows")
                    value = UNKNOWN
            if value is UNKNOWN and not any(v is UNKNOWN for v in ins) and self._live(tensor):
                self.lose(op, "its outputs' batch axes could not be followed")
            if value is not INDEPENDENT:
                self.values[tensor] = value

    def _is_flow(self, op, tensor):
        """Whether `tensor` is a v1 TensorArray's flow (holding its elements' value)."""
        return tensor.shape.rank == 0 and (op.type in op_types.TENSOR_ARRAY_FLOW_OP_TYPES or (
            op.type in op_types.FLOW_PASSING_OP_TYPES and any(t in self.flows for t in op.inputs)))

    def _live(self, tensor):
        """Whether `tensor` is on a path to the targets (ys, or a body's outputs)."""
        return any(tensor is t for t in self.targets) or any(
            c in self.region for c in tensor.consumers())

    def forgive(self, ops):
        """Takes back the losses recorded at `ops` (inside a pattern matched whole)."""
        self.losses = [(o, reason) for o, reason in self.losses if o not in ops]

    def lose(self, op, reason, doubt=False):
        """Records that the proof was lost at `op` (the first record is `lost_at`);
        with `doubt`, the verdict cannot be "independent" even if `ys` keeps its rows."""
        if not any(o is op for o, _ in self.losses):
            self.losses.append((op, reason))
        if doubt:
            self.doubts.append(op)

    def _record_size_edges(self, op, ins, outs):
        """Records the integer SIZE inputs of `op` used as data (`size_uses`)."""
        if op.type in op_types.SHAPE_OP_TYPES or op.type in functions.TRANSFERS:
            return
        slots = static.shape_slots(op)
        for j, value in enumerate(ins):
            if value is not SIZE or j in slots:
                continue
            dtype = op.inputs[j].dtype
            if dtype.is_floating or dtype.is_complex or dtype == tf.variant:
                continue   # already a value: it crossed at an edge recorded upstream
            if size_uses.is_data_use(op, j, ins, outs):
                self.size_data_edges.append((op, j))

    def function_graph(self, op, attr):
        """The graph of the function `attr` of `op` (read once per scan tree), or None:
        the one it was built from, whose shapes are as static as outside (a weight read
        in a body keeps its shape, so `tf.shape` arithmetic keeps reading as sizes), else
        the one read back from the graph's library."""
        try:
            name = op.get_attr(attr).name
        except (ValueError, AttributeError):
            return None
        key = (id(op.graph), name)
        if key not in self.function_cache:
            built = _tf.built_function_graph(op, attr)
            arguments = len(op.inputs) - (op.type in op_types.IF_OP_TYPES)
            if built is None or len(built.inputs) != arguments or (
                    attr != "cond" and len(built.outputs) != len(op.outputs)):
                built = _tf.called_function_graph(op, attr)
            self.function_cache[key] = built
        return self.function_cache[key]

    def body_values(self, op, attr, ins):
        """The values of the outputs of the function `attr` of `op` on inputs of values
        `ins`; a coupling or loss inside is raised or recorded on `op`."""
        if self.depth >= _MAX_DEPTH:
            raise lattice.Lost("its functions are nested too deeply")
        body = self.function_graph(op, attr)
        if body is None:
            raise lattice.Lost(f"its function {attr!r} could not be read")
        if len(body.inputs) != len(ins):
            raise lattice.Lost(f"its function {attr!r} takes other inputs")
        name = op.get_attr(attr).name
        seeds = [(t, v) for t, v in zip(body.inputs, ins) if v is not INDEPENDENT]
        inner = _Scan(seeds, body.get_operations(), body.outputs, self.registry,
                      self.static_batch_size, self.depth + 1, self.function_cache).run()
        if inner.couplings:
            first = inner.couplings[0]
            raise lattice.Coupled(
                f"runs the function {name!r}, whose op {first.op.name!r} ({first.op.type}) "
                f"{first.reason}", first.advice)
        if inner.size_data_edges:   # the SIZE inputs that reach a data use inside
            used = graph_walk.upstream_ops([c.inputs[j] for c, j in inner.size_data_edges])
            self.size_data_edges.extend(
                (op, j + (len(op.inputs) - len(ins))) for j, v in enumerate(ins)
                if v is SIZE and body.inputs[j].op in used)
        outs = [inner.value_of(t) for t in body.outputs]
        if inner.losses and (inner.doubts or any(v is UNKNOWN for v in outs)):
            inner_op, reason = inner.losses[0]
            self.lose(op, f"in its function {name!r}, {inner_op.name!r} ({inner_op.type}): "
                          f"{reason}", doubt=bool(inner.doubts))
        return outs


def _topological(ops):
    """`ops` with every op after the ops it reads, creation order breaking ties; TF1
    loops' back edges are not followed (a loop's Merge comes before its body)."""
    ops = set(ops)
    ordered, done, active = [], set(), set()
    for root in sorted(ops, key=_tf.op_order_key()):
        stack = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if expanded:
                active.discard(op)
                if op not in done:
                    done.add(op)
                    ordered.append(op)
                continue
            if op in done or op in active:
                continue
            active.add(op)
            stack.append((op, True))
            for t in reversed(list(op.inputs)):
                if _back_edge(t, op):
                    continue
                if t.op in ops and t.op not in done and t.op not in active:
                    stack.append((t.op, False))
    return ordered


def _back_edge(tensor, op):
    """Whether `tensor` -> `op` is a TF1 loop's back edge (NextIteration -> Merge)."""
    return (op.type in op_types.V1_MERGE_OP_TYPES
            and tensor.op.type in op_types.V1_NEXT_ITERATION_OP_TYPES)


def analyze(ys, batch, ys_upstream, batch_size=None, num_groups=None, registry=None,
            batch_axes=None):
    """The `Analysis` of the ops between `batch` and `ys` (see the module docstring).

    Args:
      ys: the per-example values, [B, ...].
      batch: the batch tensors, [B, ...] each (or with the batch on `batch_axes`: a
        time-major [T, B, d] input is seeded Rows(lead=1, ...)).
      ys_upstream: the ops `ys` depends on (`graph_walk.upstream_ops([ys])`).
      batch_size: B when known statically (a leading static 1 axis is then never taken
        for the batch axis), else None.
      num_groups: M for microbatches, or None (kept on the result).
      registry: a `pertower.rules.RuleRegistry`; rules may define
        `output_layouts(op, inputs)` for op types the analysis does not know.
    """
    seeds = _seeds(batch, batch_axes)
    region = graph_walk.downstream_ops(batch, ys_upstream)
    scan = _Scan(seeds, region, [ys], registry, batch_size, seed_parts=True).run()
    return Analysis(scan, ys, num_groups, registry, num_batch=len(batch))


def _seeds(batch, batch_axes=None):
    """(tensor, Rows(lead=its batch axis, k=1, .)) per batch tensor."""
    axes = [0] * len(batch) if batch_axes is None else list(batch_axes)
    seeds = []
    for b, axis in zip(batch, axes):
        rows = lattice.complete(Rows(axis, 1, None), b.shape)
        seeds.append((b, rows if rows is not None else UNKNOWN))
    return seeds


def find_couplings(replayed_ops, batch):
    """The `Coupling` records, in graph order, of the ops among `replayed_ops` (the ops
    between the batch and `ys`) that couple the examples of `batch` ([B, ...] each)."""
    return _Scan(_seeds(batch), replayed_ops).run().couplings
