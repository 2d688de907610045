"""What recurrent weights cost: a PTB-style LSTM language model, per-example gradients
against the batch gradient and the one-example loop.

    python -m benchmarks.recurrent [--batch 32] [--steps 20] [--vocab 1000]
        [--units 128] [--repeats 7] [--onednn on|off|both]
        [--layer LSTM|GRU|SimpleRNN|GRU-reset-before|LSTM-split|ConvLSTM2D] [--v1]

The model: Embedding(V, U) -> Keras LSTM(U, return_sequences=True, unroll=False: a TF2
`While` loop) -> Dense(V); ys = each example's sum over its T steps of the next-token
cross-entropy, [B]. `GRU-reset-before` is GRU(reset_after=False) (its recurrent kernel
sliced in the body), `LSTM-split` LSTM(implementation=1) (kernels split into gates),
`ConvLSTM2D` ConvLSTM2D(U, 3x3, same) on each step's embedding as an 8x8 map of 4
channels (V x 256 table; Conv2D per gate in the body), flattened to [B, T, 64*U].
Timed, round robin after a warm-up (median of --repeats runs):

    batch gradient    tf.gradients(sum(ys), xs): one forward and one backward pass
    per-example       pertower.per_example_gradients(ys, xs, batch=...), no batch_size:
                      the loop's weights on the rules of `pertower._loops` (a pertower
                      that sends some to the towers is given batch_size=B, and says so)
    norms             pertower.per_example_norms
    DP step           pertower.DPOptimizer(SGD).minimize (no noise), against a plain
                      SGD step
    loop              one `sess.run` of tf.gradients per example (pertower.oracle)

`--v1`: the same model in a TF1 graph (tf.compat.v1.disable_v2_behavior(), run in a
child process): an embedding lookup -> `tf.compat.v1.nn.dynamic_rnn` with LSTMCell,
GRUCell or BasicRNNCell (a TF1 while frame, `pertower._loops.frames`) -> a dense layer.
`--onednn both` (the default) runs the model once with oneDNN off and once on, each in
a child process (TF_ENABLE_ONEDNN_OPTS is read when TensorFlow starts).
"""

import argparse
import os
import subprocess
import sys

import benchmarks

__all__ = ["main", "run"]

_V1_CELLS = {"LSTM": "LSTMCell", "GRU": "GRUCell", "SimpleRNN": "BasicRNNCell"}
# --layer -> (the tf_keras layer, its options besides return_sequences)
_KERAS_LAYERS = {"LSTM": ("LSTM", {}), "GRU": ("GRU", {}), "SimpleRNN": ("SimpleRNN", {}),
                 "GRU-reset-before": ("GRU", {"reset_after": False}),
                 "LSTM-split": ("LSTM", {"implementation": 1}),
                 "ConvLSTM2D": ("ConvLSTM2D", {"kernel_size": 3, "padding": "same"})}
_MAP = (8, 8, 4)   # ConvLSTM2D: each step's embedding as an 8x8 map of 4 channels


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recurrent",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="B (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="T (default 20)")
    parser.add_argument("--vocab", type=int, default=1000, help="V (default 1000)")
    parser.add_argument("--units", type=int, default=128, help="U (default 128)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs (default 7)")
    parser.add_argument("--layer", default="LSTM", choices=tuple(_KERAS_LAYERS))
    parser.add_argument("--onednn", default="both", choices=("on", "off", "both"))
    parser.add_argument("--v1", action="store_true",
                        help="dynamic_rnn in a TF1 graph (disable_v2_behavior)")
    args = parser.parse_args(argv)
    if args.v1 and args.layer not in _V1_CELLS:
        parser.error(f"--layer {args.layer} has no TF1 cell: --v1 takes {', '.join(_V1_CELLS)}")
    return args


def run(args):
    """Builds the model and prints one table (this process's oneDNN setting)."""
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    import pertower
    from pertower import oracle
    from pertower.tools import timing

    B, T, V, U = args.batch, args.steps, args.vocab, args.units
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        ids = tf.compat.v1.placeholder(tf.int32, [None, T], name="ids")
        labels = tf.compat.v1.placeholder(tf.int32, [None, T], name="labels")
        if args.v1:
            cell = getattr(tf.compat.v1.nn.rnn_cell, _V1_CELLS[args.layer])(U)
            table = tf.compat.v1.get_variable("embedding", [V, U])
            hidden, _ = tf.compat.v1.nn.dynamic_rnn(
                cell, tf.nn.embedding_lookup(table, ids), dtype=tf.float32)     # [B, T, U]
            logits = tf.compat.v1.layers.dense(hidden, V)                        # [B, T, V]
        else:
            name, options = _KERAS_LAYERS[args.layer]
            layer = getattr(keras.layers, name)(U, return_sequences=True, **options)
            if name == "ConvLSTM2D":
                size = _MAP[0] * _MAP[1] * _MAP[2]
                maps = keras.layers.Reshape((T,) + _MAP)(
                    keras.layers.Embedding(V, size)(ids))                       # [B, T, 8, 8, 4]
                hidden = keras.layers.Reshape((T, -1))(layer(maps))             # [B, T, 64*U]
            else:
                hidden = layer(keras.layers.Embedding(V, U)(ids))               # [B, T, U]
            logits = keras.layers.Dense(V)(hidden)                               # [B, T, V]
        ys = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), axis=1)                               # [B]
        xs = tf.compat.v1.trainable_variables()
        batch = [ids, labels]
        plan = pertower.explain(ys, xs, batch=batch)
        sizes = {"batch_size": B} if plan.fallback else {}   # towers are built for B
        per_example = pertower.per_example_gradients(ys, xs, batch=batch, **sizes)
        norms = pertower.per_example_norms(ys, xs, batch=batch, **sizes)
        batch_gradient = tf.gradients(tf.reduce_sum(ys), xs)
        dp_step = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.0),
                                       1.0, 0.0).minimize(ys, var_list=xs, **sizes)
        plain_step = tf.compat.v1.train.GradientDescentOptimizer(0.0).minimize(
            tf.reduce_mean(ys), var_list=xs)
        loop = oracle.SliceLoop(ys, xs)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    rng = np.random.RandomState(0)
    feed = {t: rng.randint(0, V, size=(B, T)).astype(np.int32) for t in batch}
    rows = [("batch gradient", lambda: sess.run(batch_gradient, feed)),
            ("per-example gradients", lambda: sess.run(per_example, feed)),
            ("per-example norms", lambda: sess.run(norms, feed)),
            ("plain SGD step", lambda: sess.run(plain_step, feed)),
            ("DP step", lambda: sess.run(dp_step, feed)),
            ("loop (one example per run)", lambda: loop.run(sess, feed, B, batch=batch))]
    for _, fetch in rows:   # warm-up
        fetch()
    times = timing.round_robin([(fetch, args.repeats) for _, fetch in rows])
    medians = [sorted(t)[len(t) // 2] for t in times]
    base = medians[0]
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "(unset)")
    kind = f"dynamic_rnn({_V1_CELLS[args.layer]}, TF1 graph)" if args.v1 else args.layer
    print(f"{kind}({U}) language model, B={B}, T={T}, V={V}, "
          f"TF_ENABLE_ONEDNN_OPTS={onednn}, median of {args.repeats} runs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    methods = sorted({row.method for row in plan.weights})
    print(f"weights: {len(plan.weights)}, methods: {', '.join(methods)}"
          + (f" (batch_size={B} given)" if sizes else ""))
    print(timing.format_table(["", "seconds", "x batch gradient"],
                              [[name, f"{m:.4f}", f"{m / base:.2f}"]
                               for (name, _), m in zip(rows, medians)]))
    sess.close()


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.onednn == "both":
        for setting in ("off", "on"):
            env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1" if setting == "on" else "0",
                       PYTHONPATH=benchmarks.python_path())
            given = list(argv if argv is not None else sys.argv[1:])
            if "--onednn" in given:   # "--onednn VALUE"
                del given[given.index("--onednn"):given.index("--onednn") + 2]
            command = [sys.executable, "-m", "benchmarks.recurrent",
                       *[a for a in given if not a.startswith("--onednn=")],
                       "--onednn", setting]
            subprocess.run(command, env=env, check=True)
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if args.onednn == "on" else "0"
    if args.v1:   # this process is the child of `--onednn both`, or the user's own
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        tf.compat.v1.disable_v2_behavior()
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
