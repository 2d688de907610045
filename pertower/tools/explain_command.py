"""The `explain` command: pertower's plan for a saved meta graph, without writing code
(DESCRIPTION says what it does). `ys` ([B, ...]), the batch placeholders and the weights
are found by name in the imported graph; the --run feeds are arrays keyed by the names of
the tensors they feed. Importing this module does not import TensorFlow.
"""

import os
import sys

from pertower.tools import arguments
from pertower.tools import environment

__all__ = ["HELP", "DESCRIPTION", "RELATIVE_TOLERANCE", "add_arguments", "run"]

# --run agrees with the loop when max |got - loop| <= RELATIVE_TOLERANCE * max |loop|
# over every weight (float32 sums of a deep network taken in another order).
RELATIVE_TOLERANCE = 1e-3

HELP = "print pertower's plan for a saved graph (model.meta); --run checks one batch"
DESCRIPTION = (
    "Imports a meta graph (the .meta file a tf.compat.v1.train.Saver writes next to a "
    "checkpoint) into a fresh graph in graph mode and prints how pertower would compute "
    "the per-example gradients of --ys with respect to the weights: the method of each "
    "weight (rules, towers, row passes) and why, then a count per method. With --run "
    "FEEDS.npz it also restores --checkpoint (or initializes the variables), computes "
    "one batch, checks it against the one-example loop and prints the largest relative "
    "difference; exits with 1 if it exceeds "
    f"{RELATIVE_TOLERANCE:g}.")


def _names(text):
    """'a,b' -> ['a', 'b'] (empty entries dropped)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def add_arguments(parser):
    """Adds the `explain` options to `parser`."""
    parser.add_argument("meta_graph", metavar="MODEL.meta",
                        help="the meta graph file (tf.compat.v1.train.Saver's .meta)")
    parser.add_argument("--ys", required=True, metavar="NAME",
                        help="the per-example cost [B, ...]: a tensor name ('loss:0') or "
                             "an op name (its first output)")
    # extend: `--batch x:0 --batch y:0` names both (a second --batch used to replace
    # the first, leaving the labels the only batch input)
    parser.add_argument("--batch", required=True, type=_names, action="extend",
                        metavar="NAME[,NAME...]",
                        help="the batch inputs (placeholders), comma-separated or one "
                             "--batch each: inputs and per-example labels")
    parser.add_argument("--xs", default="trainable", metavar="trainable|NAME,...",
                        help="the weights: 'trainable' (the graph's trainable variables, "
                             "default) or comma-separated variable names")
    parser.add_argument("--batch-size", type=arguments.positive_int, default=None,
                        metavar="N", help="B, when the batch dimension is not in the "
                                          "graph and a weight falls back to towers")
    parser.add_argument("--run", dest="feeds", default=None, metavar="FEEDS.npz",
                        help="compute one batch from these feeds (keys: tensor names) and "
                             "check it against the one-example loop")
    parser.add_argument("--checkpoint", default=None, metavar="PREFIX",
                        help="with --run: restore the variables from this checkpoint "
                             "(default: run their initializers)")
    parser.set_defaults(run=run)


def _tensor(graph, name, option):
    """The tensor `name` ('x:0', or an op name for its first output) of `graph`."""
    try:
        return graph.as_graph_element(name if ":" in name else name + ":0",
                                      allow_tensor=True, allow_operation=False)
    except (KeyError, ValueError) as error:
        raise _Refusal(f"{option} {name!r}: no such tensor in the imported graph ({error}); "
                       "give a name printed by the graph, e.g. 'scope/loss:0'.") from None


def _weights(tf, graph, text):
    """The variables `--xs` names."""
    variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    if text == "trainable":
        weights = graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
        if not weights:
            raise _Refusal("--xs trainable: the meta graph has no trainable variables in "
                           "its collections; name the weights with --xs NAME,...")
        return list(weights)
    by_name = {v.name: v for v in variables}
    by_name.update({v.name.rsplit(":", 1)[0]: v for v in variables})
    weights = []
    for name in _names(text):
        if name not in by_name:
            raise _Refusal(f"--xs {name!r}: no such variable in the meta graph; choose from "
                           f"{', '.join(sorted(v.op.name for v in variables)[:20])}"
                           + (", ..." if len(variables) > 20 else "") + ".")
        weights.append(by_name[name])
    return weights


class _Refusal(Exception):
    """A user error of the command: its message is printed and the exit code is 2."""


def run(args):
    """`pertower explain` with parsed `args`: prints the plan (and the --run check);
    returns the exit code (0, 1 on disagreement with the loop, 2 on a usage error)."""
    try:
        return _explain(args)
    except _Refusal as error:
        print(f"pertower explain: {error}", file=sys.stderr)
        return 2


def _explain(args):
    if not os.path.isfile(args.meta_graph):
        raise _Refusal(f"MODEL.meta {args.meta_graph!r}: no such file.")
    if args.checkpoint and not args.feeds:
        raise _Refusal("--checkpoint is read only with --run FEEDS.npz.")
    tf = environment.graph_mode_tensorflow()
    import pertower  # pylint: disable=import-outside-toplevel
    from pertower import oracle  # pylint: disable=import-outside-toplevel
    from pertower.tools import plan_summary  # pylint: disable=import-outside-toplevel

    graph = tf.Graph()
    with graph.as_default(), environment.quiet_native_logs():
        saver = tf.compat.v1.train.import_meta_graph(args.meta_graph, clear_devices=True)
        ys = _tensor(graph, args.ys, "--ys")
        batch = [_tensor(graph, name, "--batch") for name in args.batch]
        xs = _weights(tf, graph, args.xs)
        # the loop's tf.gradients first: pertower edits While ops' functions and
        # outputs as it builds, after which TensorFlow cannot differentiate them
        loop = oracle.SliceLoop(ys, xs) if args.feeds else None
        plan = pertower.explain(ys, xs, batch=batch, batch_size=args.batch_size)
    print(plan)
    print(plan_summary.summarize(plan, os.path.basename(args.meta_graph)))
    if not args.feeds:
        return 0
    return _run_one_batch(tf, graph, saver, plan, loop, ys, batch, xs, args)


def _run_one_batch(tf, graph, saver, plan, loop, ys, batch, xs, args):
    """--run: one batch of per-example gradients against the one-example `loop`
    (an `oracle.SliceLoop` of ys and xs)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import pertower  # pylint: disable=import-outside-toplevel

    try:
        arrays = np.load(args.feeds)
    except (OSError, ValueError) as error:
        raise _Refusal(f"--run {args.feeds!r}: cannot read it as a .npz of arrays ({error}); "
                       "write it with numpy.savez(path, **{'images:0': x, ...}).") from None
    feed = {_tensor(graph, key, f"--run {args.feeds}: key"): arrays[key]
            for key in arrays.files}
    missing = [b.name for b in batch if b not in feed]
    if missing:
        raise _Refusal(f"--run {args.feeds!r}: no array for the batch input(s) "
                       f"{', '.join(missing)}; add them under those names.")
    B = len(feed[batch[0]])
    # the loop slices every fed array whose first axis has B entries (inputs, labels)
    sliced = [key for key, value in feed.items() if np.ndim(value) >= 1 and len(value) == B]
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        if args.checkpoint:
            saver.restore(sess, args.checkpoint)
        else:
            sess.run(tf.compat.v1.global_variables_initializer())
        needs_size = any(w.method in ("towers", "passes") for w in plan.weights)
        try:
            grads = pertower.per_example_gradients(
                ys, xs, batch=batch, batch_size=args.batch_size or (B if needs_size else None))
            got = sess.run(grads, feed)
        except Exception as error:  # pylint: disable=broad-except  # reported, exit 1
            print(f"pertower explain: --run: computing the per-example gradients failed: "
                  f"{type(error).__name__}: {str(error).strip()[:1500]}", file=sys.stderr)
            return 1
        want = loop.run(sess, feed, B, batch=sliced)
    worst, worst_name = 0.0, None
    for x, g, w in zip(xs, got, want):
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        relative = float(np.max(np.abs(g - w))) / scale if scale > 0 else float(
            np.max(np.abs(g))) if g.size else 0.0
        if relative >= worst:
            worst, worst_name = relative, x.op.name
    agrees = worst <= RELATIVE_TOLERANCE
    print(f"--run: B={B}, {len(xs)} weights, per-example gradients against the one-example "
          f"loop: max relative difference {worst:.2e} (at {worst_name}) "
          + ("agrees" if agrees else f"DISAGREES (tolerance {RELATIVE_TOLERANCE:g})"))
    return 0 if agrees else 1
