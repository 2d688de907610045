"""One description of the options the public functions share, put into their docstrings.

A public function's Args name the shared options it takes in braces, on lines of their
own: `{options: batch, batch_size, method}`; `documented` replaces them with the
descriptions below, indented as the braces were.
"""

import re

__all__ = ["OPTIONS", "documented"]

OPTIONS = {
    "batch": """\
batch: the tensor(s) carrying the batch on axis 0 that `ys` depends on; when
  None they are found by walking back from `ys` to its placeholders and
  `tf.data` iterator outputs.""",
    "batch_size": """\
batch_size: B. With a None batch axis it may be left out when no weight falls
  back to towers: the gradients then work for any fed batch size
  ([None, *x.shape]). When some weights fall back (see `pertower.explain`), the
  towers are built for exactly B examples and feeding another size fails in
  `sess.run`; without it the call is refused, listing those weights.
  When `ys` joins several batches along axis 0 (`tf.concat([f(s1), f(s2)], 0)`:
  its rows are the examples of s1, then those of s2, B = B1 + B2) it may be a
  list with one size per batch tensor, parallel to `batch` (an int gives every
  batch tensor that size); those weights are computed by towers.""",
    "unconnected_gradients": """\
unconnected_gradients: "zero" (zeros for a weight `ys` does not reach) or
  "none" (None for it), as in `tf.gradients`. Left out, it is "zero" and a
  UserWarning names the weights `ys` does not reach (for example optimizer
  slots from `tf.compat.v1.global_variables()`); pass "zero" to keep the zeros
  without the warning.""",
    "name": """\
name: name scope for the new ops (default: the function's name).""",
    "method": """\
method: "auto" (default: per-op rules where they are proven sound, towers for
  the other weights), "rules" (strict: refused, listing every weight no rule
  covers and why) or "towers" (replay the model once per example on weight
  copies).""",
    "validate": """\
validate: None (default): where the static analysis cannot prove that row i of
  `ys` depends on example i alone, a run-time check is added (with a warning
  naming the op where the proof was lost): fetching the result first checks
  that `ys` recomputed slice by slice equals `ys` and fails naming the largest
  difference otherwise. True: always add the check. False: never.""",
    "memory_limit": """\
memory_limit: refuse when the estimated bytes (see `pertower.estimate_memory`)
  exceed this; None means half of the machine's physical memory,
  float("inf") switches the guard off.""",
    "sparse": """\
sparse: False (default) for dense results only; True to get, for each weight
  read only by gathers (an embedding), a `pertower.PerExampleIndexedSlices`
  holding just the looked-up rows (see `pertower.sparse`); other weights stay
  dense. Such weights are computed by towers.""",
    "devices": """\
devices: None, or device strings: tower t (one per example) runs on
  devices[t % len(devices)] (see `build_towers`); rules run as one batched
  computation where TensorFlow places it.""",
    "rules": """\
rules: a `pertower.rules.RuleRegistry` (default
  `pertower.rules.default_registry()`), to add rules for your own ops.""",
    "batch_axis": """\
batch_axis: None (default: the batch is axis 0 of every batch tensor), an int
  (the batch axis of every batch tensor, e.g. 1 for time-major [T, B, d] inputs
  of `tf.compat.v1.nn.static_rnn` or `time_major=True`), or a list with one axis
  per batch tensor, parallel to `batch`. `ys` always keeps the batch on axis 0:
  transpose a time-major `ys` first.""",
}

_PLACE = re.compile(r"^( *)\{options: ([a-z_,\s]+)\}$", re.MULTILINE)


def documented(function):
    """`function` with each `{options: ...}` of its docstring replaced by the
    descriptions of the options it names (an unknown name is a KeyError at import)."""
    def describe(found):
        indent, names = found.group(1), found.group(2).replace("\n", " ").split(",")
        return "\n".join(indent + OPTIONS[name.strip()].replace("\n", "\n" + indent)
                         for name in names)
    function.__doc__ = _PLACE.sub(describe, function.__doc__)
    return function
