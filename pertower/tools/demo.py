"""`pertower demo`: three scenarios on built-in models, each checked against the
one-slice-at-a-time loop of `pertower.oracle` and timed (medians of runs taken in turn
after one warm-up run): pertower's `sess.run` against the loop users write today, one
`sess.run` of `tf.gradients` per example (scenario 2: per batch), its gradient ops
built once.

Notation:
    B   examples in the batch           M   microbatches (scenario 2: M = 2 batches)
    x   one weight                      [B, *x.shape] one gradient of x per example

Needs graph mode and TF_USE_LEGACY_KERAS=1 (for `tf.compat.v1.layers`); `pertower demo`
sets both up.
"""

import dataclasses
import os
import statistics
import time
import warnings

import numpy as np
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from pertower.tools import timing

__all__ = ["ScenarioResult", "run_demo", "format_table", "cnn_keras_model"]

# Agreement with the loop: float32, so |pertower - loop| <= ATOL * max(1, |loop|max)
# + RTOL * |loop| for every entry.
RTOL = 1e-4
ATOL = 1e-5


@dataclasses.dataclass(frozen=True)
class ScenarioResult:
    """What one scenario measured: its table name ("1 keras mlp"), a line saying what
    is computed and one from the result; B and the `sess.run` calls of one pass of the
    loop; the build time of the pertower call; max |pertower - loop| over all entries
    and whether each is within (RTOL, ATOL); the first pertower run (graph optimization
    included), then the median times of pertower's run and of one pass of the loop."""

    name: str
    description: str
    detail: str
    batch_size: int
    loop_runs: int
    build_seconds: float
    max_abs_diff: float
    agrees: bool
    first_run_seconds: float
    pertower_seconds: float
    loop_seconds: float

    @property
    def speedup(self):
        """loop time / pertower time."""
        return self.loop_seconds / self.pertower_seconds


def run_demo(batch_size=32, repeats=5, report=print):
    """Runs the three scenarios; returns a list of three `ScenarioResult`s.

    batch_size is B, the examples per scenario (scenario 2: two batches of B // 2);
    repeats the timed runs after the warm-up (the median is reported); `report` is
    called with each line of progress.
    """
    _require_legacy_keras()
    scenarios = [_scenario_keras_mlp, _scenario_two_batches_cosine, _scenario_cnn_jacobian]
    results = []
    for number, scenario in enumerate(scenarios, start=1):
        r = scenario(batch_size, repeats)
        verdict = "agrees" if r.agrees else "DISAGREES (beyond tolerance)"
        report(f"[{number}/{len(scenarios)}] {r.description}")
        report(f"      {r.detail}")
        report(f"      max |pertower - loop| = {r.max_abs_diff:.2e}: {verdict} with the loop")
        report(f"      pertower {1e3 * r.pertower_seconds:.1f} ms, loop "
               f"{1e3 * r.loop_seconds:.1f} ms ({r.loop_runs} sess.run), speed-up "
               f"{r.speedup:.1f}x; pertower's graph built in {r.build_seconds:.2f} s, first "
               f"run {r.first_run_seconds:.2f} s")
        results.append(r)
    return results


def _require_legacy_keras():
    """Raises RuntimeError unless TF_USE_LEGACY_KERAS is on (tf.compat.v1.layers needs it)."""
    # the values TensorFlow itself reads as on
    if os.environ.get("TF_USE_LEGACY_KERAS", "") not in ("1", "true", "True"):
        raise RuntimeError(
            "pertower.demo: scenario 2 builds its model with tf.compat.v1.layers, which "
            "needs Keras 2: set TF_USE_LEGACY_KERAS=1 before TensorFlow is used, or use "
            "the `pertower demo` command, which sets it.")


def format_table(results):
    """The results as a plain-text table (a string, no trailing newline)."""
    header = ("scenario", "B", "max|diff|", "pertower ms", "loop ms", "runs", "speed-up",
              "build s", "1st run s", "agrees")
    rows = [(r.name, str(r.batch_size), f"{r.max_abs_diff:.1e}",
             f"{1e3 * r.pertower_seconds:.1f}", f"{1e3 * r.loop_seconds:.1f}",
             str(r.loop_runs), f"{r.speedup:.1f}x", f"{r.build_seconds:.2f}",
             f"{r.first_run_seconds:.2f}", "yes" if r.agrees else "NO")
            for r in results]
    return timing.format_table(header, rows)


def _scenario_keras_mlp(B, repeats, n_in=32):
    """Scenario 1: per-example gradients of (net(x) - y) ** 2 for a Keras MLP."""
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        net = keras.Sequential([
            keras.layers.Dense(128, activation="tanh", input_shape=(n_in,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(1),
        ])
        x = tf.compat.v1.placeholder(tf.float32, [None, n_in], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        cost = (net(x) - y) ** 2                                # [B, 1]
        weights = net.trainable_weights
        start = time.perf_counter()
        grads = pertower.per_example_gradients(cost, weights, batch_size=B)  # [B, *x.shape]
        build_seconds = time.perf_counter() - start
        norms = pertower.global_norms(grads)                    # [B]
        rng = np.random.default_rng(1)
        feed = {x: rng.normal(size=(B, n_in)).astype(np.float32),
                y: rng.normal(size=(B, 1)).astype(np.float32)}
        loop = _initialized_loop(sess, cost, weights)
        reference = loop.run(sess, feed, B)                     # one sess.run per example
        _, measured = _measure(sess, grads, feed, reference, repeats, loop, feed, B)
        detail = (f"{len(weights)} weights, {_num_params(weights)} parameters; median "
                  f"per-example gradient norm {np.median(sess.run(norms, feed)):.3f}")
    return ScenarioResult(
        "1 keras mlp", f"Scenario 1: per-example gradients of (net(x) - y)**2, Keras MLP "
        f"{n_in}-128-128-1, B={B}", detail, B, B, build_seconds, *measured)


def _scenario_two_batches_cosine(B, repeats):
    """Scenario 2: gradients of two batches of B // 2 through a tf.compat.v1.layers MLP,
    and their cosine, from `microbatch_gradients(..., num_microbatches=2)`."""
    n = max(1, B // 2)
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        s1 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s1")
        s2 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s2")
        s = tf.concat([s1, s2], axis=0)                         # [2n, 3]
        with tf.compat.v1.variable_scope("f"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*tf\.layers\.dense.* is deprecated")
            h = tf.compat.v1.layers.dense(s, 64, activation=tf.tanh)
            h = tf.compat.v1.layers.dense(h, 64, activation=tf.tanh)
            f = tf.compat.v1.layers.dense(h, 1)                 # [2n, 1]
        weights = tf.compat.v1.trainable_variables("f")
        start = time.perf_counter()
        g = pertower.microbatch_gradients(f, weights, batch=s, num_microbatches=2,
                                          batch_size=2 * n)     # [2, *x.shape] each
        build_seconds = time.perf_counter() - start
        cos = pertower.cosine_similarity([w[0] for w in g], [w[1] for w in g])
        rng = np.random.default_rng(2)
        S1 = rng.normal(size=(n, 3)).astype(np.float32)
        S2 = rng.normal(size=(n, 3)).astype(np.float32)
        loop = _initialized_loop(sess, f, weights)
        concatenated = {s: np.concatenate([S1, S2])}           # the oracle feeds s itself
        reference = loop.run(sess, concatenated, 2)            # one sess.run per batch
        g1, g2 = (np.concatenate([w[k].ravel() for w in reference]) for k in (0, 1))
        reference.append(np.float32(g1 @ g2 / (np.linalg.norm(g1) * np.linalg.norm(g2))))
        values, measured = _measure(sess, g + [cos], {s1: S1, s2: S2}, reference, repeats,
                                    loop, concatenated, 2)
        detail = f"cos(g1, g2) = {values[-1]:.6f} (loop: {reference[-1]:.6f})"
    return ScenarioResult(
        "2 two-batch cosine", f"Scenario 2: gradients of two batches of {n} and their "
        "cosine, tf.compat.v1.layers MLP 3-64-64-1, M=2", detail, 2 * n, 2, build_seconds,
        *measured)


def _scenario_cnn_jacobian(B, repeats):
    """Scenario 3: per-example dy/dθ of Conv2D(16, 5) -> Flatten -> Dense(128) -> Dense(1)
    on 32x32x1 images, [B, 1, *x.shape] per weight."""
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        model = cnn_keras_model()
        x = tf.compat.v1.placeholder(tf.float32, [None, 32, 32, 1], name="x")
        y = model(x)                                            # [B, 1]
        weights = model.trainable_weights
        start = time.perf_counter()
        jac = pertower.per_example_jacobians(y, weights, batch_size=B)  # [B, 1, *x.shape]
        build_seconds = time.perf_counter() - start
        feed = {x: np.random.default_rng(3).normal(size=(B, 32, 32, 1)).astype(np.float32)}
        # one output (K = 1): the loop's row is the gradient of the summed output
        loop = _initialized_loop(sess, y, weights)
        reference = oracle.loop_per_example_jacobians(sess, y, weights, feed)
        values, measured = _measure(sess, jac, feed, reference, repeats, loop, feed, B)
        detail = (f"{_num_params(weights)} parameters; Jacobian of {weights[2].name} "
                  f"{tuple(values[2].shape)}")
    return ScenarioResult(
        "3 cnn jacobian", f"Scenario 3: per-example dy/dtheta of the CNN Conv2D(16,5)-"
        f"Dense(128)-Dense(1) on 32x32x1, B={B}", detail, B, B, build_seconds, *measured)


def cnn_keras_model():
    """Scenario 3's CNN (also the benchmarks' "cnn"), [None, 32, 32, 1] -> [None, 1]."""
    return keras.Sequential([
        keras.layers.Conv2D(16, 5, padding="same", activation="elu", input_shape=(32, 32, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(1),
    ])


# Measuring ----------------------------------------------------------------------------


def _initialized_loop(sess, ys, weights):
    """The loop's `tf.gradients` of one slice's summed `ys`, built once, then the
    variables initialized."""
    loop = oracle.SliceLoop(ys, weights)
    sess.run(tf.compat.v1.global_variables_initializer())
    return loop


def _measure(sess, fetches, feed, reference, repeats, loop, loop_feed, loop_runs):
    """Runs pertower's `fetches` once (warm-up and result), compares them with
    `reference`, then times them and the `loop` (`loop_runs` slices of `loop_feed`) in
    turn; returns (values, the measurements in `ScenarioResult`'s order after build_seconds)."""
    start = time.perf_counter()
    values = sess.run(fetches, feed)
    first_run_seconds = time.perf_counter() - start
    max_diff, agrees = 0.0, len(values) == len(reference)
    for got, want in zip(values, reference):
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            max_diff, agrees = float("inf"), False
            break
        if got.size:
            max_diff = max(max_diff, float(np.max(np.abs(got - want))))
            atol = ATOL * max(1.0, float(np.max(np.abs(want))))
            agrees = agrees and np.allclose(got, want, rtol=RTOL, atol=atol)
    loop.run(sess, loop_feed, loop_runs)  # warm-up
    times = timing.round_robin([(lambda: sess.run(fetches, feed), repeats),
                                (lambda: loop.run(sess, loop_feed, loop_runs), repeats)])
    return values, (max_diff, agrees, first_run_seconds, *map(statistics.median, times))


def _num_params(weights):
    return sum(int(np.prod(w.shape.as_list())) for w in weights)
