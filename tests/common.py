"""The tests' one set of tolerances and their comparison helpers.

`TOLERANCES` holds every tolerance the tests compare floats with, by kind of graph and
dtype; `tolerance` reads it and `assert_all_close` uses it when no tolerance is passed.
`run_oracle` runs the one-example loop and skips the test when TensorFlow itself cannot
compute that reference on this machine (`OracleCache` runs it once per model for the
tests that share the model's graph); `loop_rows_of_batch` is the definition of a
per-example gradient on the whole batch; `seed_weights` makes a graph's weights the
same whatever ran before; `run_python` runs what needs a fresh interpreter. The shared
models are in tests/cases.py.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

__all__ = ["TOLERANCES", "assert_all_close", "tolerance", "run_oracle", "OracleCache",
           "seed_weights", "loop_rows_of_batch", "numpy_hessian", "reference_ggn",
           "run_python", "ROOT"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Comparing two computations of the same values in different orders (batched vs one
# example at a time, other kernels): kind of graph -> {dtype: (rtol, atol)}, rtol for
# the relative error of each entry, atol for entries near zero.
TOLERANCES = {
    # a few layers of dense ops
    "default": {np.dtype(np.float32): (1e-4, 1e-6), np.dtype(np.float64): (1e-10, 1e-12)},
    # convolutions, normalizations, recurrences, the rule models: long sums per entry,
    # so entries near zero carry larger absolute errors
    "deep": {np.dtype(np.float32): (1e-4, 1e-5), np.dtype(np.float64): (1e-10, 1e-12)},
    # published networks (tf_keras.applications): dozens of layers, sums over thousands
    # of entries per weight
    "network": {np.dtype(np.float32): (1e-3, 1e-5), np.dtype(np.float64): (1e-9, 1e-11)},
    # models drawn at random (tests/test_robustness.py): widths, depths and activations
    # vary, so the float64 sums of the loop and the batch differ more than a fixed model's
    "random": {np.dtype(np.float32): (1e-4, 1e-5), np.dtype(np.float64): (1e-9, 1e-11)},
    # short computations (analytics of a small model, a hand-checkable case, the
    # processes' checks): few sums, a tighter relative error
    "tight": {np.dtype(np.float32): (1e-5, 1e-6), np.dtype(np.float64): (1e-10, 1e-12)},
}

# TensorFlow errors that say its own kernels cannot compute a graph on this machine (the
# reference cannot be computed either, so there is nothing to compare with): (pattern
# matched on the error's message, why).
_REFERENCE_UNAVAILABLE = (
    (re.compile(r"Current CPU implementations do not yet support dilation rates larger "
                r"than 1"),
     "without oneDNN (TF_ENABLE_ONEDNN_OPTS=0, the default on CPUs without AVX-512) the "
     "CPU convolution gradient kernels refuse dilations > 1"),
    (re.compile(r"(does not support grouped convolutions|filter_size does not have enough "
                r"elements)"),
     "without oneDNN the CPU convolution kernels refuse grouped convolutions"),
)


def tolerance(dtype, kind="default"):
    """The tolerances for comparing values of a floating dtype.

    Args:
      dtype: a `tf.DType`, a NumPy dtype or type, or an array (its dtype is used).
      kind: a key of `TOLERANCES`: the kind of graph that computed the values.

    Returns:
      dict(rtol=..., atol=...) for `np.allclose` / `assert_all_close`: float64 gets the
      float64 tolerances, every other dtype the float32 ones.
    """
    if kind not in TOLERANCES:
        raise ValueError(f"`kind` must be one of {sorted(TOLERANCES)}, but received {kind!r}")
    if isinstance(dtype, tf.DType):
        dtype = dtype.base_dtype.as_numpy_dtype
    dtype = dtype.dtype if isinstance(dtype, np.ndarray) else np.dtype(dtype)
    key = np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
    rtol, atol = TOLERANCES[kind][key]
    return dict(rtol=rtol, atol=atol)


def assert_all_close(got, want, rtol=None, atol=None, what="values", kind="default"):
    """Compares two lists of arrays; collects every mismatch before failing.

    Args:
      got, want: lists of arrays of the same shapes.
      rtol, atol: the tolerances; None takes them from `tolerance(want[k].dtype, kind)`
        for each array.
      what: the words that start the failure message.
      kind: the key of `TOLERANCES` when rtol or atol is None.
    """
    assert len(got) == len(want), f"{what}: {len(got)} results, expected {len(want)}"
    problems = []
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            problems.append(f"[{k}] shape {g.shape} != {w.shape}")
            continue
        tol = tolerance(w.dtype, kind) if np.issubdtype(w.dtype, np.floating) else dict(
            rtol=0.0, atol=0.0)
        tol = dict(rtol=tol["rtol"] if rtol is None else rtol,
                   atol=tol["atol"] if atol is None else atol)
        if not np.allclose(g, w, **tol):
            err = np.max(np.abs(g - w))
            problems.append(f"[{k}] max abs error {err:.3g} (scale {np.max(np.abs(w)):.3g})")
    assert not problems, f"{what}: " + "; ".join(problems)


def run_oracle(loop, *args, **kwargs):
    """Runs a one-example loop and returns its values; skips the test if TensorFlow
    cannot compute the reference on this machine.

    Args:
      loop: a function of `pertower.oracle` (e.g. `loop_per_example_gradients`), a
        `SliceLoop`'s `run`, or any function that runs the reference.
      *args, **kwargs: passed to `loop`.

    Returns:
      What `loop` returns.

    Raises:
      pytest.skip.Exception: TensorFlow raised one of the errors of
        `_REFERENCE_UNAVAILABLE` (its kernels on this machine cannot run the graph);
        the reason quotes TensorFlow's message and the op. Any other error propagates.
    """
    try:
        return loop(*args, **kwargs)
    except tf.errors.OpError as error:
        for pattern, why in _REFERENCE_UNAVAILABLE:
            found = pattern.search(error.message)
            if found:
                op = f" at op '{error.op.name}' ({error.op.type})" if error.op is not None else ""
                pytest.skip(f"TensorFlow cannot compute the one-example reference on this "
                            f"machine{op}: {found.group(0)} ({why})")
        raise


def _key(value):
    """A hashable key for an argument of a loop: tensors and ops by identity, arrays by
    their dtype, shape and bytes, containers element by element."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return ("dict", tuple((_key(k), _key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, (int, float, str, bool, type(None), np.generic)):
        return ("value", type(value).__name__, value)
    return ("object", id(value))


class OracleCache:
    """The one-example loop's values for one model, each computed once (`run_oracle`)
    and shared by every test that asks for the same loop on the same arguments: a
    module's tests on one model's graph and session then build and run each reference
    once. Keep one per model (e.g. `cases.Case.oracles`), next to its graph, so that the
    tensors it keys on stay alive as long as it does.

    The values are returned as copies: a test may change what it receives."""

    def __init__(self):
        self._values = {}

    def run(self, loop, *args, **kwargs):
        """`run_oracle(loop, *args, **kwargs)`, computed once per distinct arguments."""
        key = (_key(loop), _key(args), _key(kwargs))
        if key not in self._values:
            # (the arguments are kept with the values: the ids in the key stay theirs)
            self._values[key] = (run_oracle(loop, *args, **kwargs), (loop, args, kwargs))
        return _copied(self._values[key][0])


def _copied(values):
    if isinstance(values, np.ndarray):
        return values.copy()
    if isinstance(values, (list, tuple)):
        return type(values)(_copied(v) for v in values)
    return values


def seed_weights(seed):
    """Makes the weights built next in the default graph the same whatever ran before.

    Call inside `with graph.as_default()` of a fresh graph, before building layers.
    `keras.utils.set_random_seed` sets the graph-level seed (tf.compat.v1 initializers
    derive op-level seeds from it and this graph's op count) and Keras's seed generator
    (tf_keras initializers draw stateless seeds from it; unseeded, they would draw from
    Python's global `random`, which other tests and examples advance). It also seeds
    Python's `random` and NumPy's global generator; test inputs use their own
    `np.random.RandomState`.

    Args:
      seed: an int.
    """
    keras.utils.set_random_seed(seed)


def loop_rows_of_batch(sess, ys, xs, feed):
    """The per-example gradients by their definition on the whole batch, [B, *x.shape]
    per x: row i is tf.gradients(tf.reduce_sum(ys[i]), xs), run with `feed` (the whole
    batch), so values computed from the batch (its size, e.g. a mean's 1/B) are the
    whole batch's. B is the length of ys as run on `feed`."""
    B = len(sess.run(ys, feed))
    grads = []
    for i in range(B):
        row = tf.gradients(tf.reduce_sum(ys[i]), xs)
        grads.append([tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
                      for g, x in zip(row, xs)])
    rows = sess.run(grads, feed)
    return [np.stack([row[k] for row in rows]) for k in range(len(xs))]


def numpy_hessian(loss, f):
    """H of l(f) with respect to f, [K, K], for one example's logits f [K]."""
    if loss == "softmax_cross_entropy":
        p = np.exp(f - f.max())
        p /= p.sum()
        return np.diag(p) - np.outer(p, p)
    if loss == "sigmoid_cross_entropy":
        p = 1 / (1 + np.exp(-f))
        return np.diag(p * (1 - p))
    return 2 * np.eye(len(f))


def reference_ggn(sess, logits, xs, feed, loss="softmax_cross_entropy"):
    """[B, *x.shape] per x: diag(J_n^T H_n J_n), the GGN diagonal of each example, from
    the one-example Jacobians of `logits` [B, K] (`pertower.oracle`)."""
    from pertower import oracle  # pylint: disable=import-outside-toplevel
    jacobians = oracle.loop_per_example_jacobians(sess, logits, xs, feed)  # [B, K, *x]
    H = np.stack([numpy_hessian(loss, f) for f in sess.run(logits, feed)])  # [B, K, K]
    return [np.einsum("nk...,nkl,nl...->n...", J, H, J) for J in jacobians]


def formed_norm_convs(rng):
    """In the default graph: convolutions whose norms are formed (few channels for their
    positions): 3x3 SAME on 3 channels, 3x3 stride 2 VALID, 2x3 SAME, 1x1 (which takes the
    engine's path), and 3x3 SAME on two images per example, then a dense layer.

    Args:
      rng: the `np.random.RandomState` the weights are drawn from.

    Returns:
      (x, pairs, ws, loss): the placeholders x [B, 9, 9, 3] and pairs [B, 2, 5, 5, 3], the
      six weights, and the loss [B].
    """
    shapes = [[3, 3, 3, 4], [3, 3, 4, 5], [2, 3, 5, 6], [1, 1, 6, 3], [3, 3, 3, 4], [7, 1]]
    x = tf.compat.v1.placeholder(tf.float32, [None, 9, 9, 3], name="x")
    pairs = tf.compat.v1.placeholder(tf.float32, [None, 2, 5, 5, 3], name="pairs")
    ws = [tf.Variable(rng.randn(*s).astype(np.float32) * 0.5, name=f"w{k}")
          for k, s in enumerate(shapes)]

    def conv(inputs, w, strides=1, padding="SAME"):
        return tf.nn.conv2d(inputs, w, strides=strides, padding=padding)

    h = tf.nn.relu(conv(x, ws[0]))                                 # [B, 9, 9, 4]
    h = tf.tanh(conv(h, ws[1], strides=2, padding="VALID"))      # [B, 4, 4, 5]
    h = tf.nn.relu(conv(h, ws[2]))                                 # [B, 4, 4, 6]
    h = conv(h, ws[3])                                             # [B, 4, 4, 3]
    images = tf.reshape(pairs, [-1, 5, 5, 3])                      # [2B, 5, 5, 3]
    g = tf.reshape(tf.tanh(conv(images, ws[4])), [-1, 50, 4])      # [B, 50, 4]
    features = tf.concat([tf.reduce_mean(h, axis=[1, 2]), tf.reduce_mean(g, axis=1)],
                         axis=1)                                   # [B, 7]
    loss = tf.reduce_sum(tf.square(tf.matmul(features, ws[5]) - 1.0), axis=1)   # [B]
    return x, pairs, ws, loss


def run_formed_norm_convs(graph, x, pairs, ws, loss, fetches, B, rng):
    """Runs `fetches` in `graph` on one batch of B examples drawn from `rng` for
    `formed_norm_convs`' placeholders x and pairs, and the one-example loop on it.

    Returns:
      (the fetched values, the loop's per-example gradients [B, *w.shape] of each w).
    """
    from pertower import oracle
    with graph.as_default():
        loop = oracle.SliceLoop(loss, ws)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: rng.randn(B, 9, 9, 3).astype(np.float32),
                    pairs: rng.randn(B, 2, 5, 5, 3).astype(np.float32)}
            return sess.run(fetches, feed), loop.run(sess, feed, B)


def loop_clipped_mean(per_example, clip):
    """(norms [B], clipped means) of the loop's per-example gradients `per_example`
    ([B, *w.shape] each) clipped to `clip`: each row scaled by clip / max(norm, clip), the
    rows summed and divided by B."""
    b = per_example[0].shape[0]
    norms = np.sqrt(sum(np.sum(g.reshape(b, -1) ** 2, axis=1) for g in per_example))
    factors = clip / np.maximum(norms, clip)
    return norms, [np.tensordot(factors, g, axes=1) / b for g in per_example]


def run_python(*argv, env=(), check=True, timeout=900):
    """Runs `python *argv` in a fresh interpreter, in the repository's root, for what the
    test process cannot do itself: an environment variable read when TensorFlow is
    imported (TF_ENABLE_ONEDNN_OPTS, TF_USE_LEGACY_KERAS), servers that live until
    their process ends, a script run as a user runs it. Fails the test, with the
    output, unless the process exits with 0 (or `check` is False).

    Args:
      *argv: the arguments after the Python executable, e.g. ("-c", snippet) or
        (script, argument, ...).
      env: (name, value) pairs set in the child's environment; a value None removes the
        variable. The child gets PYTHONPATH with the repository first (this checkout's
        pertower) and TF_CPP_MIN_LOG_LEVEL=2 unless given.
      check: False to return whatever the exit code (the caller reads the output).
      timeout: seconds before the child is taken as hung (and the test fails).

    Returns:
      The `subprocess.CompletedProcess` (stdout and stderr as text).
    """
    child = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    child.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name, value in dict(env).items():
        if value is None:
            child.pop(name, None)
        else:
            child[name] = value
    try:
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=child, text=True,
                              capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"python {' '.join(argv)[:200]}: no end in {timeout} s\n--- stdout\n"
                    f"{error.stdout}\n--- stderr\n{error.stderr}")
    if check and done.returncode != 0:
        pytest.fail(f"python {' '.join(argv)[:200]}: exit code {done.returncode}\n"
                    f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}")
    return done


def save_tf1_classifier(directory, seed):
    """A TF1 classifier saved as model.meta + a checkpoint in `directory`: reference
    variables, tf.compat.v1.layers.dense (4 -> 8 -> 3), the per-example sparse
    cross-entropy through tf.compat.v1.losses (reduction NONE) as "loss" [B]; and
    feeds.npz with one batch of 5 under x:0 and y:0. Returns (prefix, feeds path)."""
    rng = np.random.RandomState(seed)
    with tf.Graph().as_default() as graph, tf.compat.v1.variable_scope(
            "", use_resource=False):
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        h = tf.compat.v1.layers.dense(x, 8, activation=tf.nn.relu)
        logits = tf.compat.v1.layers.dense(h, 3)                             # [B, 3]
        tf.identity(tf.compat.v1.losses.sparse_softmax_cross_entropy(
            y, logits, reduction=tf.compat.v1.losses.Reduction.NONE), name="loss")  # [B]
        assert all(not hasattr(v, "handle") for v in tf.compat.v1.global_variables())
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            prefix = saver.save(sess, os.path.join(directory, "model"))
    feeds = os.path.join(directory, "feeds.npz")
    np.savez(feeds, **{"x:0": rng.randn(5, 4).astype(np.float32),
                       "y:0": rng.randint(0, 3, 5).astype(np.int32)})
    return prefix, feeds
