"""The bench's reference rows, written by hand in plain TensorFlow: the batch gradient
(the floor), the MLP's outer products and norms (the practical limit), TensorFlow
Privacy's vectorized_map, the memory-write limit and the norms floor.

Notation:
    B   examples in the batch       P   weights (parameters) of the model
    A   a dense layer's input [B, i]    dZ the gradient at its pre-activation [B, j]

Each function takes a `benchmarks.models.BuiltModel` in the default graph and
returns the list of tensors its row fetches.
"""

import tensorflow as tf

import pertower

__all__ = ["dense", "batch_gradient", "outer_products", "norms_by_hand", "vectorized_map",
           "write_limit", "norms_floor"]


def dense(grads, xs):
    """tf.gradients output with None as zeros and IndexedSlices made dense."""
    return [tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
            for g, x in zip(grads, xs)]


def batch_gradient(model):
    """[*x.shape] per weight: tf.gradients of sum(ys), one backward pass."""
    return dense(tf.gradients(tf.reduce_sum(model.ys), model.weights), model.weights)


def outer_products(model):
    """[B, *x.shape] per weight from one batched backward pass to the pre-activations:
    kernel: einsum('bi,bj->bij', A, dZ), bias: dZ (Goodfellow 2015)."""
    taps = model.dense_taps
    dZs = tf.gradients(tf.reduce_sum(model.ys), [Z for _, Z, _, _ in taps])  # [B, j] each
    grads = {}
    for (A, _, kernel, bias), dZ in zip(taps, dZs):
        grads[kernel.ref()] = tf.einsum("bi,bj->bij", A, dZ)  # [B, i, j]
        grads[bias.ref()] = dZ                                 # [B, j]
    return [grads[w.ref()] for w in model.weights]


def norms_by_hand(model):
    """[B]: sqrt(sum over dense layers of ||a_i||^2 ||dz_i||^2 + ||dz_i||^2)."""
    taps = model.dense_taps
    dZs = tf.gradients(tf.reduce_sum(model.ys), [Z for _, Z, _, _ in taps])  # [B, j] each
    squares = []
    for (A, _, _, _), dZ in zip(taps, dZs):
        dz2 = tf.reduce_sum(tf.square(dZ), axis=1)                 # [B]
        squares += [tf.reduce_sum(tf.square(A), axis=1) * dz2, dz2]  # kernel, bias
    return [tf.sqrt(tf.add_n(squares))]


def vectorized_map(model):
    """TensorFlow Privacy's vectorized way: map over the per-example losses [B] a
    function that takes tf.gradients of its one loss with respect to the weights."""
    ys = model.ys
    per_example = tf.reduce_sum(ys, axis=list(range(1, ys.shape.rank)))  # [B]

    def one_example(loss):
        return dense(tf.gradients(loss, model.weights), model.weights)

    return list(tf.vectorized_map(one_example, per_example))  # [B, *x.shape] each


def write_limit(model):
    """[B, P] float32 written by one tf.tile of a [1, P] row: the bytes of the B
    per-example gradients, written once (the row depends on the fed batch, so
    Grappler cannot fold it into a constant)."""
    B_fed = tf.shape(model.ys)[0]
    row = tf.fill([1, model.num_weights], tf.cast(B_fed, tf.float32))  # [1, P]
    return [tf.tile(row, tf.stack([B_fed, 1]))]                         # [B, P]


def norms_floor(model, B):
    """The work every rules-based per-example norm needs before any per-layer work: the
    forward pass and ONE backward pass of sum(ys) to the output Z of every op the rules
    use ([B, ...] each), without any weight gradient. No norm from the rules can be
    cheaper than this; a batch gradient adds the weight gradients to it."""
    plan = pertower.explain(model.ys, model.weights, batch_size=B)
    outputs = {}
    for uses in plan.uses:
        for use in uses or ():
            outputs[use.output.ref()] = use.output
    if not outputs:
        raise NotImplementedError("no weight is computed by the rules")
    return dense(tf.gradients(tf.reduce_sum(model.ys), list(outputs.values())),
                  list(outputs.values()))
