"""Peak memory of one `sess.run`, from TensorFlow's own step trace (CPU or GPU).

The run is traced (`RunOptions(trace_level=FULL_TRACE)`) and its step_stats replayed:

    peak = max over time of  sum(bytes of live buffers) + temporaries of running nodes

A buffer (a node output's allocation) is live from the start of the node that makes it
to the end of its last consumer (the end of the run when fetched); an output at the
address of one of its node's inputs extends that buffer. Constants, variables and fed
tensors are not counted. docs/benchmark.md ("How memory is measured") says why neither
resident memory nor the allocator's counter would do.
"""

import dataclasses
import re

import tensorflow as tf

__all__ = ["RunMemory", "traced_peak_bytes", "peak_bytes_from_step_stats"]

# Ops whose outputs exist before the run (constants, variables) or are the
# caller's feeds; their buffers are not counted.
PERSISTENT_OPS = frozenset({
    "Const", "HostConst", "_HostConst", "ReadVariableOp", "VarHandleOp", "VariableV2",
    "Variable", "_Arg", "_DeviceArg", "Placeholder", "PlaceholderWithDefault",
    "_Recv", "_HostRecv"})

# Ops that hand a tensor to the caller: what they read stays live to the end of the run.
FETCH_OPS = frozenset({"_Retval", "_DeviceRetval", "_Send", "_HostSend"})

_LABEL = re.compile(r"^(?P<name>.*?) = (?P<op>[^(]*)\((?P<inputs>.*)\)$", re.S)


@dataclasses.dataclass(frozen=True)
class RunMemory:
    """The memory one traced run needed: `peak_bytes` (the maximum over time of live
    buffers plus running temporaries), the `buffers` the replay counted and the
    executed `nodes` the trace holds."""

    peak_bytes: int
    buffers: int
    nodes: int


def traced_peak_bytes(sess, fetches, feed_dict=None):
    """Runs `fetches` once with a full trace and returns its `RunMemory`, e.g.
    `traced_peak_bytes(sess, grads, feed).peak_bytes / 2**20` MiB."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    sess.run(fetches, feed_dict, options=options, run_metadata=metadata)
    return peak_bytes_from_step_stats(metadata.step_stats)


def _parse_label(node):
    """(op type, [(input node, slot)]) from a node's timeline_label, or (None, [])."""
    match = _LABEL.match(node.timeline_label or "")
    if not match:
        return None, []
    inputs = []
    for text in match.group("inputs").split(","):
        text = text.strip().lstrip("^")
        if not text:
            continue
        name, _, slot = text.rpartition(":")
        if name and slot.isdigit():
            inputs.append((name, int(slot)))
        else:
            inputs.append((text, 0))
    return match.group("op").strip(), inputs


def peak_bytes_from_step_stats(step_stats):
    """Replays a traced run's step_stats; returns its `RunMemory` (see module doc)."""
    nodes = []
    for device in step_stats.dev_stats:
        for node in device.node_stats:
            op, inputs = _parse_label(node)
            start = node.all_start_micros
            end = start + max(node.all_end_rel_micros, node.op_end_rel_micros)
            nodes.append((start, end, node, op, inputs))
    nodes.sort(key=lambda n: (n[0], n[1]))
    run_end = max((end for _, end, _, _, _ in nodes), default=0)

    tensor_buffer = {}   # (node name, slot) -> buffer index, or None when not counted
    buffer_ptr = {}      # address -> index of the buffer currently living there
    buffers = []         # [bytes, created, last use]
    temporaries = []     # (start, end, bytes)
    for start, end, node, op, inputs in nodes:
        read = {tensor_buffer.get(key) for key in inputs} - {None}
        for index in read:
            buffers[index][2] = max(buffers[index][2], run_end if op in FETCH_OPS else end)
        new_bytes = 0
        for output in node.output:
            described = output.tensor_description.allocation_description
            size, ptr = int(described.requested_bytes), int(described.ptr)
            key = (node.node_name, output.slot)
            if op in PERSISTENT_OPS or size == 0:
                tensor_buffer[key] = None
                continue
            index = buffer_ptr.get(ptr) if ptr else None
            if index is not None and index in read:      # in place / alias of an input
                buffers[index][0] = max(buffers[index][0], size)
            else:                                         # a new allocation
                index = len(buffers)
                buffers.append([size, start, end])
                new_bytes += size
                if ptr:
                    buffer_ptr[ptr] = index
            tensor_buffer[key] = index
        own_peak = sum(int(m.peak_bytes) for m in node.memory)
        if own_peak > new_bytes:
            temporaries.append((start, end, own_peak - new_bytes))

    events = []  # (time, +bytes at allocation / -bytes at release)
    for size, created, last in buffers:
        events += [(created, size), (last, -size)]
    for start, end, size in temporaries:
        events += [(start, size), (end, -size)]
    # At equal times releases come first: a node's inputs are freed when it ends,
    # before a node starting in the same microsecond allocates.
    events.sort(key=lambda e: (e[0], e[1] > 0))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return RunMemory(peak_bytes=peak, buffers=len(buffers), nodes=len(nodes))
