"""How many weights the per-op rules cover, from the plan alone (no run): every network
of the zoo, the recurrent layers of every tf_keras kind and Transformer encoders with a
learned position table.

    python -m benchmarks.rules_coverage [--only NAME ...] [--list]

Per network, `pertower.explain(loss, weights)` (no batch_size; nothing is run) counts
its weights on the rules, on the towers and on row passes (`pertower.tools.plan_summary`),
with each fallback reason; the last lines total them (the zoo, the others, all): the
share on the rules is the figure of issue 32's "Done when".

The extra networks (B free, a per-example loss [B]):

    LSTM GRU SimpleRNN      tf_keras layer(8) on [B, T=5, 4] -> Dense(3)
    GRU-reset-before        GRU(reset_after=False) (the recurrent kernel sliced per gate)
    LSTM-split GRU-split    implementation=1 (kernels split into gates)
    LSTM-mixed GRU-mixed    under the mixed_float16 policy (Casts of every weight)
    Bidirectional-LSTM      Bidirectional(LSTM(8))
    ConvLSTM2D              ConvLSTM2D(3, 3) on [B, T=3, 5, 5, 2] -> Flatten -> Dense(3)
    encoder-broadcast_to    Embedding(50, 8) + TF-models' PositionEmbedding
                            (tf.broadcast_to of table[:T]), MultiHeadAttention,
                            LayerNormalization, Dense feed-forward on [B, T=6] ids
    encoder-gather          the same with tf.gather(table, tf.range(T)) (tf_keras' idiom)
"""

import argparse
import os
import sys

from benchmarks import zoo

__all__ = ["NETWORKS", "main", "build"]

_T, _D, _UNITS = 5, 4, 8
# name -> (tf_keras layer class, its options, wrapped in Bidirectional, mixed_float16)
_RECURRENT = {
    "LSTM": ("LSTM", {}, False, False), "GRU": ("GRU", {}, False, False),
    "SimpleRNN": ("SimpleRNN", {}, False, False),
    "GRU-reset-before": ("GRU", {"reset_after": False}, False, False),
    "LSTM-split": ("LSTM", {"implementation": 1}, False, False),
    "GRU-split": ("GRU", {"implementation": 1}, False, False),
    "LSTM-mixed": ("LSTM", {}, False, True), "GRU-mixed": ("GRU", {}, False, True),
    "Bidirectional-LSTM": ("LSTM", {}, True, False),
}
NETWORKS = zoo.ZOO + tuple(_RECURRENT) + ("ConvLSTM2D", "encoder-broadcast_to",
                                          "encoder-gather")


def _recurrent(name):
    import tensorflow as tf                        # pylint: disable=import-outside-toplevel
    import tf_keras as keras                       # pylint: disable=import-outside-toplevel
    layer_name, options, bidirectional, mixed = _RECURRENT[name]
    policy = keras.mixed_precision.global_policy()
    if mixed:
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x = tf.compat.v1.placeholder(tf.float32, [None, _T, _D], name="x")
        layer = getattr(keras.layers, layer_name)(_UNITS, **options)
        if bidirectional:
            layer = keras.layers.Bidirectional(layer)
        dense = keras.layers.Dense(3, dtype="float32")
        loss = tf.reduce_sum(tf.square(dense(layer(x))), axis=1)          # [B]
    finally:
        keras.mixed_precision.set_global_policy(policy)
    return loss, layer.trainable_weights + dense.trainable_weights


def _conv_lstm(_):
    import tensorflow as tf                        # pylint: disable=import-outside-toplevel
    import tf_keras as keras                       # pylint: disable=import-outside-toplevel
    x = tf.compat.v1.placeholder(tf.float32, [None, 3, 5, 5, 2], name="x")
    layers = [keras.layers.ConvLSTM2D(3, 3), keras.layers.Flatten(), keras.layers.Dense(3)]
    h = x
    for layer in layers:
        h = layer(h)
    return tf.reduce_sum(tf.square(h), axis=1), [w for l in layers for w in l.trainable_weights]


def _encoder(name):
    """Token embedding + learned positions, one self-attention layer and a feed-forward
    block with LayerNormalization, mean-pooled to a loss [B]."""
    import tensorflow as tf                        # pylint: disable=import-outside-toplevel
    import tf_keras as keras                       # pylint: disable=import-outside-toplevel
    tokens = tf.compat.v1.placeholder(tf.int32, [None, 6], name="tokens")
    embedding = keras.layers.Embedding(50, 8)
    table = tf.compat.v1.get_variable("position_embeddings", [16, 8])
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    norms = [keras.layers.LayerNormalization(), keras.layers.LayerNormalization()]
    dense = keras.layers.Dense(8, activation="relu")
    h = embedding(tokens)                                                  # [B, T, 8]
    length = tf.shape(h)[1]
    if name == "encoder-broadcast_to":
        rows = tf.reshape(table[:length], [1, length, 8])                  # [1, T, 8]
        h = h + tf.broadcast_to(rows, tf.shape(h))                         # [B, T, 8]
    else:
        h = h + tf.gather(table, tf.range(length))                         # [B, T, 8]
    h = norms[0](h + attention(h, h))
    h = norms[1](h + dense(h))
    loss = tf.reduce_sum(tf.square(tf.reduce_mean(h, axis=1)), axis=1)    # [B]
    layers = [embedding, attention, *norms, dense]
    return loss, [w for layer in layers for w in layer.trainable_weights] + [table]


def build(name):
    """(loss [B], weights) of the network `name` (one of NETWORKS) in the default graph."""
    if name in zoo.ZOO:
        network = zoo.build(name, seed=0)
        return network.loss, network.weights
    if name in _RECURRENT:
        return _recurrent(name)
    return (_conv_lstm if name == "ConvLSTM2D" else _encoder)(name)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rules_coverage",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=NETWORKS, metavar="NAME",
                        help=f"these networks only (of: {', '.join(NETWORKS)})")
    parser.add_argument("--list", action="store_true", help="list the networks and stop")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(NETWORKS))
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")   # tf.compat.v1.layers (layers_cnn)
    import tensorflow as tf                        # pylint: disable=import-outside-toplevel
    import pertower                                # pylint: disable=import-outside-toplevel
    from pertower.tools import plan_summary        # pylint: disable=import-outside-toplevel
    totals = {group: dict.fromkeys(plan_summary.METHOD_ORDER, 0)
              for group in ("the zoo", "the others", "all")}
    for name in args.only or NETWORKS:
        with tf.Graph().as_default():
            loss, weights = build(name)
            plan = pertower.explain(loss, weights)
        for method, n in plan_summary.method_counts(plan).items():
            for group in ("the zoo" if name in zoo.ZOO else "the others", "all"):
                totals[group][method] += n
        print(plan_summary.summarize(plan, name), flush=True)
    for group, counts in totals.items():
        reached = sum(counts[m] for m in ("rules", "towers", "passes"))
        print(f"total, {group}: {sum(counts.values())} weights: {counts['rules']} rules "
              f"({100 * counts['rules'] / max(reached, 1):.1f}% of those reached), "
              f"{counts['towers']} towers, {counts['passes']} passes, "
              f"{counts['unreached']} unreached")
    return 0


if __name__ == "__main__":
    sys.exit(main())
