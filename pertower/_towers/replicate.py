"""Replicas: copy a set of ops R times with one `import_graph_def`, remapping its inputs.

Notation:
    S   the template: a set of ops of the graph
    R   replicas of S made here (e.g. the T towers, or towers 1 ... T-1)

The package's one NodeDef copier. Replica r is S with every input from outside S
replaced by `counterpart(tensor, r)` (or shared), renamed, optionally placed on a device
and edited by a hook; all R replicas go in one GraphDef imported once.
"""

from tensorflow.core.framework import graph_pb2
import tensorflow as tf

from pertower import _op_types as op_types
from pertower import _tf

__all__ = ["replicate", "drop_name_attrs"]


def drop_name_attrs(node):
    """Removes the `_class` colocation attribute (it would dangle in an import)."""
    if "_class" in node.attr:
        del node.attr["_class"]
    return node


def _own_python_token(node, graph):
    """Gives a copied Python-function node a token of its own, for the same function:
    an `EagerPyFunc`'s gradient pops its forward run's tape entry by token, for which
    copies sharing a token would race."""
    if node.op not in op_types.PYTHON_OP_TYPES or "token" not in node.attr:
        return
    token = _tf.reregister_python_function(node.attr["token"].s.decode(), graph)
    if token is not None:
        node.attr["token"].s = token.encode()


def replicate(template_ops, replicas, rename, counterpart, graph, return_tensors=(),
              device=None, edit_node=None, library=None):
    """Adds `len(replicas)` copies of `template_ops` to `graph` with one graph import.

    Args:
      template_ops: the ops of S.
      replicas: the replica indices r to build, e.g. range(T) or range(1, T).
      rename: rename(op_name, r) -> the full name of replica r's copy of that op.
      counterpart: counterpart(item, r) -> what replica r reads in place of `item` (a
        tensor or control-input op from outside S), or None for `item` itself.
      graph: the graph holding S; the replicas are added to it.
      return_tensors: tensors to return from every replica (S's from its copy).
      device: None, or device(r) -> the device for every op of replica r.
      edit_node: None, or edit_node(node, op, r, key_for): edits replica r's copied
        NodeDef `node` of `op` in place, naming outside tensors by `key_for(tensor)`.
      library: None, or a FunctionDefLibrary the copies need.

    Returns:
      A list over `replicas` of lists: replica r's versions of `return_tensors`.
    """
    order = sorted(template_ops, key=_tf.op_order_key())
    names = {op.name for op in order}
    graph_def = graph_pb2.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    input_map, keys = {}, {}   # input_map key -> outside tensor; id(tensor) -> key
    controls = []  # (replica node name, outside op)

    def key_for(tensor):
        """An input_map key naming `tensor` outside the imported GraphDef."""
        if id(tensor) not in keys:
            keys[id(tensor)] = f"pertower_input_{len(keys)}:0"
            input_map[keys[id(tensor)]] = tensor
        return keys[id(tensor)]

    def outside(item, r):
        replacement = counterpart(item, r)
        return item if replacement is None else replacement

    templates = [(op, op.node_def) for op in order]
    for r in replicas:
        for op, node_def in templates:
            node = graph_def.node.add()
            node.CopyFrom(node_def)
            node.name = rename(op.name, r)
            if device is not None:
                node.device = device(r)
            drop_name_attrs(node)
            _own_python_token(node, graph)
            del node.input[:]
            for tensor in op.inputs:
                if tensor.op.name in names:
                    node.input.append(f"{rename(tensor.op.name, r)}:{tensor.value_index}")
                else:
                    node.input.append(key_for(outside(tensor, r)))
            for control in op.control_inputs:
                if control.name in names:
                    node.input.append("^" + rename(control.name, r))
                else:
                    controls.append((node.name, outside(control, r)))
            if edit_node is not None:
                edit_node(node, op, r, key_for)
    if library is not None:
        graph_def.library.CopyFrom(library)
    # an input an edit replaced may have left its key unused; import refuses those
    used = {ref for node in graph_def.node for ref in node.input}
    used_map = {key: t for key, t in input_map.items() if key in used}
    return_names, outside_returns = [], {}
    for r in replicas:
        for t in return_tensors:
            if t.op.name in names:
                return_names.append(f"{rename(t.op.name, r)}:{t.value_index}")
            else:
                outside_returns[len(return_names)] = outside(t, r)
                return_names.append(None)
    # name="": the nodes carry their full names already.
    imported = iter(tf.graph_util.import_graph_def(
        graph_def, input_map=used_map,
        return_elements=[n for n in return_names if n is not None], name=""))
    returned = [outside_returns[i] if n is None else next(imported)
                for i, n in enumerate(return_names)]
    for node_name, control in controls:
        _tf.add_control_inputs(graph.get_operation_by_name(node_name), [control])
    n = len(return_tensors)
    return [returned[i * n:(i + 1) * n] for i in range(len(replicas))]
