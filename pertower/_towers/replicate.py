"""Replicas: copy a set of ops R times with one `import_graph_def`, remapping its inputs.

Notation:
    T   towers                  S   the template: ops built once, for tower 0
    R   replicas of S made here (towers 1 ... T-1)

Why: building tower 0's backward pass with `tf.gradients` and copying it for the other
towers gives the same ops that `tf.gradients` over all towers would build, but pays the
Python-side gradient construction (most of the time it takes to build many towers)
once instead of T times. Replica r is S with every input that comes from outside S
replaced by `counterpart(tensor, r)`: tower r's slice, copy or forward activation in
place of tower 0's, and the same tensor for anything the towers share.
"""

from tensorflow.core.framework import graph_pb2
import tensorflow as tf

__all__ = ["replicate", "calls_functions", "InputMap", "drop_name_attrs"]

# NodeDef attributes that tie a node to others by name; they would dangle in a copy.
_DROPPED_ATTRS = ("_class",)


def drop_name_attrs(node):
    """Removes from a copied NodeDef the attributes that name other nodes (`_class`
    colocation), which would dangle in an import."""
    for attr in _DROPPED_ATTRS:
        if attr in node.attr:
            del node.attr[attr]
    return node


class InputMap:
    """The `input_map` of one `import_graph_def`: a key per outside tensor."""

    def __init__(self):
        self.input_map = {}  # key -> tensor
        self._keys = {}      # id(tensor) -> key

    def key_for(self, tensor):
        """An input_map key naming `tensor` outside the imported GraphDef."""
        if id(tensor) not in self._keys:
            self._keys[id(tensor)] = f"pertower_input_{len(self._keys)}:0"
            self.input_map[self._keys[id(tensor)]] = tensor
        return self._keys[id(tensor)]


def calls_functions(ops):
    """True when an op in `ops` runs a graph function (While, If, PartitionedCall...).

    Such ops carry function graphs that gradient construction rewrites in place (a
    while_v2 gradient adds outputs to its forward op), so a copy of tower 0's backward
    pass would not fit the other towers' forward ops.
    """
    for op in ops:
        for value in op.node_def.attr.values():
            if value.HasField("func") or (value.HasField("list") and value.list.func):
                return True
    return False


def replicate(template_ops, template_prefix, counterpart, replicas, return_tensors, graph,
              device=None):
    """Adds `len(replicas)` copies of `template_ops` with one graph import.

    Args:
      template_ops: the ops of S, all named under `template_prefix`.
      template_prefix: the name prefix of S, e.g. "grads/t0/"; replica r is named
        with "t{r}/" in place of the last "t0/".
      counterpart: counterpart(tensor_or_op, r) -> what replica r uses in place of an
        input that comes from outside S (the same object when the towers share it).
      replicas: the replica indices r to build, e.g. range(1, T).
      return_tensors: tensors of S to return from every replica.
      graph: the graph holding S.
      device: None (replica ops keep S's device strings), or device(r) -> the device
        for every op of replica r.

    Returns:
      A list over `replicas` of lists: replica r's copies of `return_tensors`.
    """
    order = sorted(template_ops, key=lambda op: op._id)  # pylint: disable=protected-access
    names = {op.name for op in order}
    stem = template_prefix[:-len("t0/")]

    def rename(op_name, r):
        return f"{stem}t{r}/{op_name[len(template_prefix):]}"

    graph_def = graph_pb2.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    inputs = InputMap()
    key_for = inputs.key_for
    controls = []  # (replica node name, external op)

    templates = [(op, op.node_def) for op in order]
    for r in replicas:
        for op, node_def in templates:
            node = graph_def.node.add()
            node.CopyFrom(node_def)
            node.name = rename(op.name, r)
            if device is not None:
                node.device = device(r)
            drop_name_attrs(node)
            del node.input[:]
            for tensor in op.inputs:
                if tensor.op.name in names:
                    node.input.append(f"{rename(tensor.op.name, r)}:{tensor.value_index}")
                else:
                    node.input.append(key_for(counterpart(tensor, r)))
            for control in op.control_inputs:
                if control.name in names:
                    node.input.append("^" + rename(control.name, r))
                else:
                    controls.append((node.name, counterpart(control, r)))
    return_names = [f"{rename(t.op.name, r)}:{t.value_index}"
                    for r in replicas for t in return_tensors]
    # name="": the nodes carry their full names already.
    imported = tf.graph_util.import_graph_def(
        graph_def, input_map=inputs.input_map, return_elements=return_names, name="")
    for node_name, control in controls:
        graph.get_operation_by_name(node_name)._add_control_inputs([control])  # pylint: disable=protected-access
    n = len(return_tensors)
    return [imported[i * n:(i + 1) * n] for i in range(len(imported) // n)] if n else [
        [] for _ in replicas]
