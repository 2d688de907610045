"""`python -m benchmarks --dp-fit`: an epoch of tf_keras' `model.fit` in graph mode with
`pertower.keras.DPKerasSGDOptimizer` against the same epoch with tf_keras' plain legacy
SGD, on the CIFAR-style net (`benchmarks.models.cifar_keras_model`), timed side by side
(round robin).

Notation:
    B   examples per batch      S   batches per epoch (N = S * B examples)
    C   clip norm (1)           σ   noise multiplier (1; 0 in the "σ=0" row)

Rows (section "dp fit", per model and B), each the median ms of one call:

    plain fit epoch          model.fit(x, y, batch_size=B, epochs=1) on N examples,
                             SGD on the mean cross-entropy (Keras' default reduction)
    dp fit epoch             the same with DPKerasSGDOptimizer(C, σ), the loss of
                             reduction NONE ([B]), one microbatch per example
    dp fit epoch σ=0         the DP epoch without noise: the clipping alone
    plain train_on_batch     one `train_on_batch` of B examples (Keras' step without
    dp train_on_batch        fit's loop: its callbacks, data handling and progress)

So the fit loop's own cost per step is the epoch / S minus train_on_batch, and the DP
step's extra time splits into the clipping (σ=0 minus plain) and the noise (dp minus
σ=0). Every model starts from the same weights; the timed epochs train them (learning
rate 1e-3). Importing this module imports neither TensorFlow nor numpy
(`benchmarks.sides` reads `reference`).
"""


from pertower.tools import timing
from benchmarks import models as models_lib
from benchmarks import records

__all__ = ["SECTION", "FIT_BATCH_SIZES", "STEPS_PER_EPOCH", "run_dp_fit_bench",
           "format_dp_fit_table", "measured_rows", "reference"]

SECTION = "dp fit"
FIT_BATCH_SIZES = {"cifar": (64,)}
STEPS_PER_EPOCH = 8
LEARNING_RATE = 1e-3
_KERAS_MODELS = {"cifar": (models_lib.cifar_keras_model, models_lib.CIFAR_INPUT_SHAPE)}
_ROWS = ("plain fit epoch", "dp fit epoch", "dp fit epoch σ=0", "plain train_on_batch",
         "dp train_on_batch")


def reference(name):
    """The row a "dp fit" row is divided by ("dp fit epoch σ=0" -> "plain fit epoch",
    "dp train_on_batch" -> "plain train_on_batch"), None for a plain row."""
    if name.startswith("plain "):
        return None
    return "plain " + name.split(" ", 1)[1].split(" σ=")[0]


def _compiled(build, weights, optimizer, reduction):
    import tf_keras  # pylint: disable=import-outside-toplevel

    model = build()
    model.set_weights(weights)
    model.compile(optimizer=optimizer, loss=tf_keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction))
    return model


def run_dp_fit_bench(models=None, batch_sizes=None, repeats=5, steps=STEPS_PER_EPOCH,
                     report=print):
    """Times the rows of the module docstring in graph mode (eager execution off).

    Args:
      models: names of FIT_BATCH_SIZES (default all; others are skipped).
      batch_sizes: a list of B for every model (default FIT_BATCH_SIZES).
      repeats: timed calls of each row, after one warm-up call.
      steps: S, the batches of an epoch.
      report: called with each line of progress.

    Returns:
      A list of `benchmarks.dp.DPEntry` (its `name` the row's).
    """
    # pylint: disable=import-outside-toplevel
    import numpy as np
    import tensorflow as tf
    import tf_keras

    import pertower.keras
    from benchmarks import dp as dp_lib
    # pylint: enable=import-outside-toplevel

    entries = []
    for model_name in [m for m in (models or FIT_BATCH_SIZES) if m in _KERAS_MODELS]:
        build, input_shape = _KERAS_MODELS[model_name]
        for B in batch_sizes or FIT_BATCH_SIZES[model_name]:
            report(f"dp fit {model_name} B={B}: building ...")
            rng = np.random.default_rng(B)
            x = rng.normal(size=(steps * B, *input_shape)).astype("float32")   # [N, ...]
            y = rng.integers(0, models_lib.CIFAR_CLASSES, size=steps * B)        # [N]
            with tf.Graph().as_default():
                tf.compat.v1.set_random_seed(B)
                weights = build().get_weights()
                none = tf_keras.losses.Reduction.NONE
                sgd = tf_keras.optimizers.legacy.SGD
                dp_sgd = pertower.keras.DPKerasSGDOptimizer
                plain = _compiled(build, weights, sgd(LEARNING_RATE),
                                  tf_keras.losses.Reduction.AUTO)
                noisy = _compiled(build, weights, dp_sgd(1.0, 1.0, learning_rate=LEARNING_RATE,
                                                         seed=B), none)
                quiet = _compiled(build, weights, dp_sgd(1.0, 0.0, learning_rate=LEARNING_RATE),
                                  none)
                compiled = (plain, noisy, quiet, plain, noisy)   # in the order of _ROWS
                runs = [(lambda m=m: m.fit(x, y, batch_size=B, epochs=1, shuffle=False,
                                           verbose=0)) for m in compiled[:3]]
                runs += [(lambda m=m: m.train_on_batch(x[:B], y[:B])) for m in compiled[3:]]
                rows = [dp_lib.DPEntry(model_name, B, name) for name in _ROWS]
                for run in runs:
                    run()                                         # warm-up (builds)
                times = timing.round_robin([(records.counted(run, row), repeats)
                                            for row, run in zip(rows, runs)])
                for row, seconds in zip(rows, times):
                    row.runs_ms.extend(1e3 * t for t in seconds)
                entries += rows
    return entries


def format_dp_fit_table(entries, steps=STEPS_PER_EPOCH):
    """The rows as text: median CPU ms and ms per call, their ratio to the plain row,
    and, for the epochs, the ms per step (ms / S)."""
    medians = {(e.model, e.batch_size, e.name): e.median_ms for e in entries}
    rows = []
    for e in entries:
        base = reference(e.name)
        base_ms = medians.get((e.model, e.batch_size, base)) if base else None
        ratio = e.median_ms / base_ms if base_ms and e.median_ms is not None else None
        per_step = e.median_ms / steps if "epoch" in e.name and e.median_ms else None
        rows.append((e.model, str(e.batch_size), e.name,
                     *(_cell(v, ".1f") for v in (e.median_cpu_ms, e.median_ms, per_step)),
                     _cell(ratio, ".2f")))
    return timing.format_table(("model", "B", "row", "cpu ms", "ms", "ms / step", "x plain"),
                               rows)



def measured_rows(models, batch_sizes, repeats, report):
    """`python -m benchmarks --dp-fit`: `run_dp_fit_bench`'s rows, printed with their
    table; returns them as the JSON's "dp_fit" list."""
    report("")
    entries = run_dp_fit_bench(models=models, batch_sizes=batch_sizes, repeats=repeats,
                               report=report)
    report("")
    report(format_dp_fit_table(entries))
    report(f"ms: median per call, round-robin (an epoch: {STEPS_PER_EPOCH} batches; ms / "
           "step: its ms over them); cpu ms: the process's median CPU ms per call, all "
           "threads; x plain: over the plain row of the same kind (epoch, train_on_batch) "
           "in the same run.")
    return [{"model": e.model, "batch_size": e.batch_size, "step": e.name,
             "median_ms": e.median_ms, "runs_ms": e.runs_ms,
             "median_cpu_ms": e.median_cpu_ms, "cpu_ms": e.cpu_ms} for e in entries]


def _cell(value, spec):
    return "-" if value is None else format(value, spec)
