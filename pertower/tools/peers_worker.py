"""The child process of `pertower bench --peers`: one framework, one round.

    python -m pertower.tools.peers_worker --framework {tf,torch,jax} --repeats R
        [--check] JOB_DIR [JOB_DIR ...]

imports only its framework (TensorFlow and pertower for "tf", PyTorch and Opacus for
"torch", JAX for "jax"), builds each job's model with the weights the driver
(`pertower.tools.peers`) exported from the TensorFlow model, and prints one JSON
object on stdout: {"framework", "versions", "entries": [...]}. With --check it first
compares each entry's result with the references in the job folder (the loop's
per-example gradients, their mean, their clipped mean).

Notation:
    B   examples        C   clip norm       σ   noise multiplier     lr  learning rate
    g_i the gradient of example i's loss over all weights; n_i = ||g_i||_2
    clipped mean = (1/B) sum_i g_i * min(1, C / n_i)

Layouts. The job folder holds every array in TensorFlow's layout: Dense kernel
[in, out], Conv2D kernel HWIO [h, w, in, out], images NHWC [B, H, W, C], and the
per-example gradients [B, *x.shape]. PyTorch holds Linear weight [out, in], Conv2d
weight OIHW [out, in, h, w] and images NCHW; its per-example gradients are brought
back to TensorFlow's layout before the comparison. The JAX models are written in
TensorFlow's layouts (lax.conv_general_dilated with ("NHWC", "HWIO", "NHWC")).
A Flatten after a convolution flattens NHWC in (H, W, C) order: the PyTorch CNN
permutes NCHW to NHWC before flattening, so the Dense kernel needs no reordering.

A job folder (written by `pertower.tools.peers.prepare_job`):
    meta.json     {"model", "batch_size", "lr", "clip", "noise_multiplier", "shapes"}
    x.npy, t.npy  the batch (t: float targets [B, 1], or int labels [B] for "cifar")
    w{k}.npy      weight k, TensorFlow layout, model order (kernel, bias per layer)
    g{k}.npy      the loop's per-example gradients of weight k, [B, *w_k.shape]
    mean{k}.npy   their mean over B (what a plain SGD step applies)
    clipped{k}.npy  their clipped mean (what a DP-SGD step with σ = 0 applies)
"""

import argparse
import json
import os
import sys
import time
import warnings

import numpy as np

__all__ = ["main", "compare", "TORCH_VMAP", "JAX_VMAP", "TF_PLAIN", "PERTOWER_DP",
           "OPACUS_HOOKS", "OPACUS_GHOST", "JAX_DP", "ENTRIES"]

# Entry names, and what each computes: "gradients" (per-example, [B, *x.shape]),
# "step" (a plain SGD step: the mean gradient) or "dp step" (a DP-SGD step: the
# clipped mean, checked with σ = 0, timed with the job's σ).
TORCH_VMAP = "torch vmap(grad)"
JAX_VMAP = "jax jit(vmap(grad))"
TF_PLAIN = "step: tf plain SGD"
PERTOWER_DP = "dp step: pertower"
OPACUS_HOOKS = "dp step: opacus hooks"
OPACUS_GHOST = "dp step: opacus ghost"
JAX_DP = "dp step: jax"
ENTRIES = {"tf": [(TF_PLAIN, "step"), (PERTOWER_DP, "dp step")],
           "torch": [(TORCH_VMAP, "gradients"), (OPACUS_HOOKS, "dp step"),
                     (OPACUS_GHOST, "dp step")],
           "jax": [(JAX_VMAP, "gradients"), (JAX_DP, "dp step")]}


# Jobs and comparison (numpy only) ------------------------------------------------------


class Job:
    """One job folder, loaded: meta, batch, weights; references opened on demand."""

    def __init__(self, folder):
        self.folder = folder
        with open(os.path.join(folder, "meta.json"), encoding="utf-8") as handle:
            self.meta = json.load(handle)
        self.model = self.meta["model"]
        self.B = self.meta["batch_size"]
        self.lr = self.meta["lr"]
        self.clip = self.meta["clip"]
        self.sigma = self.meta["noise_multiplier"]
        self.x = np.load(os.path.join(folder, "x.npy"))
        self.t = np.load(os.path.join(folder, "t.npy"))
        self.weights = [np.load(os.path.join(folder, f"w{k}.npy"))
                        for k in range(len(self.meta["shapes"]))]

    def reference(self, computes):
        """The loop's arrays an entry computing `computes` is compared with (memory-mapped:
        the per-example gradients can be large)."""
        prefix = {"gradients": "g", "step": "mean", "dp step": "clipped"}[computes]
        return [np.load(os.path.join(self.folder, f"{prefix}{k}.npy"), mmap_mode="r")
                for k in range(len(self.weights))]


def compare(values, reference):
    """(max |value - reference|, max |reference|, where) over lists of arrays, row by
    row (the temporaries stay one example's size); `where` is [k, i], the weight and
    the example (row) of the largest difference (i None for an array without a batch
    axis); (inf, 0, None) when the shapes differ."""
    diff = scale = 0.0
    where = None
    if len(values) != len(reference):
        return float("inf"), 0.0, None
    for k, (got, want) in enumerate(zip(values, reference)):
        got = np.asarray(got)
        if got.shape != want.shape:
            return float("inf"), 0.0, None
        rows = enumerate(zip(got, want)) if got.ndim else [(None, (got, np.asarray(want)))]
        for i, (got_row, want_row) in rows:
            if want_row.size:
                row_diff = float(np.max(np.abs(got_row - want_row)))
                if row_diff > diff or where is None:
                    diff, where = max(diff, row_diff), [k, i]
                scale = max(scale, float(np.max(np.abs(want_row))))
    return diff, scale, where


def _short(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _measure(job, name, computes, build, check, repeats):
    """Builds an entry (`build()` -> (run, result)): `run()` does one pass and returns
    when it is finished, `result()` returns the values to check, in TensorFlow's layout,
    after the first run. Returns the entry's dict."""
    entry = {"model": job.model, "batch_size": job.B, "name": name, "computes": computes,
             "status": "ok", "reason": "", "runs_ms": []}
    try:
        start = time.perf_counter()
        run, result = build()
        entry["build_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        run()
        entry["first_run_seconds"] = time.perf_counter() - start
        if check:
            entry["max_abs_diff"], entry["max_abs_reference"], entry["worst"] = compare(
                result(), job.reference(computes))
        for r in range(repeats):
            start = time.perf_counter()
            run()
            entry["runs_ms"].append(1e3 * (time.perf_counter() - start))
            if check and r == 0 and computes == "gradients":
                # the same inputs again: a different max |diff| shows a result that
                # changes from run to run (a DP step's check holds its first result)
                entry["max_abs_diff_rerun"] = compare(
                    result(), job.reference(computes))[0]
    except Exception as error:  # pylint: disable=broad-except
        entry["status"], entry["reason"] = "error", _short(error)
    return entry


# TensorFlow: a plain SGD step and pertower's DP-SGD step -------------------------------


def _tf_entries(jobs, check, repeats):
    from pertower.tools import environment  # pylint: disable=import-outside-toplevel

    environment.prepare_tensorflow()
    # TensorFlow's lite utilities import jax when it is installed (`from jax import
    # jit`, ImportError tolerated): keep JAX out of the TensorFlow child
    sys.modules.setdefault("jax", None)
    with environment.quiet_native_logs():
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.compat.v1.disable_eager_execution()
    import pertower  # pylint: disable=import-outside-toplevel
    from pertower.tools import peers  # pylint: disable=import-outside-toplevel

    versions = {"tensorflow": tf.__version__, "pertower": pertower.__version__}
    entries = []
    for job in jobs:
        with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
            model = peers.build_tf_model(job.model, job.B, np.random.default_rng(0))
            x_in, t_in = peers.split_feed(model.feed)
            feed = {x_in: job.x, t_in: job.t}
            ys = model.ys
            loss = (ys if ys.shape.rank == 1 else
                    tf.reduce_sum(ys, axis=list(range(1, ys.shape.rank))))  # [B]
            sgd = tf.compat.v1.train.GradientDescentOptimizer

            def plain():
                mean_grads = tf.gradients(tf.reduce_mean(loss), model.weights)
                step = sgd(job.lr).minimize(tf.reduce_mean(loss), var_list=model.weights)
                return step, mean_grads

            def dp():
                check_grads = [g for g, _ in pertower.DPOptimizer(
                    sgd(job.lr), job.clip, 0.0).compute_gradients(
                        loss, var_list=model.weights, batch_size=job.B)]
                step = pertower.DPOptimizer(sgd(job.lr), job.clip, job.sigma).minimize(
                    loss, var_list=model.weights, batch_size=job.B)
                return step, check_grads

            def builder(make):
                def build():
                    step, check_tensors = make()
                    sess.run(tf.compat.v1.global_variables_initializer())
                    for w, value in zip(model.weights, job.weights):
                        w.load(value, sess)
                    # the check runs before the first step moves the weights
                    values = sess.run(check_tensors, feed) if check else None
                    return (lambda: sess.run(step, feed)), (lambda: values)
                return build

            with environment.quiet_native_logs():
                entries.append(_measure(job, TF_PLAIN, "step", builder(plain), check,
                                        repeats))
                entries.append(_measure(job, PERTOWER_DP, "dp step", builder(dp), check,
                                        repeats))
    return versions, entries


# PyTorch: torch.func vmap(grad), Opacus hooks and ghost clipping -----------------------


def _torch_model(torch, job):
    """The job's model as a torch.nn.Module with its weights loaded (OIHW, [out, in])."""
    nn = torch.nn
    F = torch.nn.functional
    shapes = [tuple(s) for s in job.meta["shapes"]]

    class Net(nn.Module):
        """mlp: Linear+ReLU ... Linear; cnn: Conv(elu) -> NHWC flatten -> Linear(relu) ->
        Linear; cifar: 3 x (Conv relu), AvgPool 2 after the first two, global average
        pool, Linear."""

        def __init__(self):
            super().__init__()
            layers = []
            for kernel in shapes[::2]:
                if len(kernel) == 4:                      # HWIO
                    h, _, i, o = kernel
                    layers.append(nn.Conv2d(i, o, h, padding=h // 2))
                else:                                     # [in, out]
                    layers.append(nn.Linear(*kernel))
            self.layers = nn.ModuleList(layers)

        def forward(self, x):
            if job.model == "mlp":
                for k, layer in enumerate(self.layers):
                    x = layer(x)
                    x = F.relu(x) if k + 1 < len(self.layers) else x
                return x
            # NHWC -> NCHW [B, C, H, W], contiguous: Opacus 1.6's conv grad sampler
            # (hooks) is wrong on channels-last strides, which avg_pool2d would keep
            x = x.permute(0, 3, 1, 2).contiguous()
            if job.model == "cnn":
                conv, dense1, dense2 = self.layers
                x = F.elu(conv(x))                        # [B, 16, H, W]
                x = x.permute(0, 2, 3, 1).flatten(1)      # [B, H*W*16], TF's order
                return dense2(F.relu(dense1(x)))          # [B, 1]
            conv1, conv2, conv3, dense = self.layers
            x = F.avg_pool2d(F.relu(conv1(x)), 2)         # [B, 32, H/2, W/2]
            x = F.avg_pool2d(F.relu(conv2(x)), 2)         # [B, 64, H/4, W/4]
            x = F.relu(conv3(x)).mean(dim=(2, 3))         # [B, 64]
            return dense(x)                               # [B, 10]

    net = Net()
    with torch.no_grad():
        for p, value in zip(net.parameters(), job.weights):
            p.copy_(torch.from_numpy(_to_torch_layout(value)))
    return net


def _squared_error(torch):
    """A criterion class: sum over the output's columns of (out - t)^2, per example [B]
    with reduction "none", else their mean or sum. (nn.MSELoss with reduction "none"
    would give [B, 1], which Opacus's ghost clipping broadcasts against [B] wrongly.)"""

    class SquaredError(torch.nn.Module):
        """((out - t) ** 2).sum(dim=1), reduced by `self.reduction`."""

        def __init__(self, reduction="mean"):
            super().__init__()
            self.reduction = reduction

        def forward(self, out, t):
            per_example = ((out - t) ** 2).sum(dim=1)              # [B]
            if self.reduction == "none":
                return per_example
            return per_example.sum() if self.reduction == "sum" else per_example.mean()

    return SquaredError


def _to_torch_layout(value):
    """A TF weight in PyTorch's layout: [in, out] -> [out, in]; HWIO -> OIHW."""
    if value.ndim == 2:
        return np.ascontiguousarray(value.T)
    if value.ndim == 4:
        return np.ascontiguousarray(value.transpose(3, 2, 0, 1))
    return value


def _per_example_to_tf_layout(grad):
    """[B, out, in] -> [B, in, out]; [B, O, I, H, W] -> [B, H, W, I, O]; as numpy."""
    grad = grad.detach().numpy()
    if grad.ndim == 3:
        return grad.transpose(0, 2, 1)
    if grad.ndim == 5:
        return grad.transpose(0, 3, 4, 2, 1)
    return grad


def _to_tf_layout(grad):
    """One weight's gradient back in TF's layout (no batch axis)."""
    return _per_example_to_tf_layout(grad[None])[0]


def _torch_entries(jobs, check, repeats):
    import torch  # pylint: disable=import-outside-toplevel
    from torch import func  # pylint: disable=import-outside-toplevel

    # Exact float32 arithmetic, stated rather than assumed: torch can be set (process
    # wide, or by a library) to compute float32 matmuls and oneDNN convolutions in
    # reduced precision (TF32 / bfloat16 passes); "highest" and "ieee" are its switches
    # back to full float32.
    torch.set_float32_matmul_precision("highest")
    mkldnn = torch.backends.mkldnn
    precision = {"matmul": torch.get_float32_matmul_precision()}
    if hasattr(getattr(mkldnn, "conv", None), "fp32_precision"):     # torch >= 2.9
        mkldnn.matmul.fp32_precision = mkldnn.conv.fp32_precision = "ieee"
        precision.update(mkldnn_matmul=mkldnn.matmul.fp32_precision,
                         mkldnn_conv=mkldnn.conv.fp32_precision)
    versions = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "fp32": precision}
    try:
        import opacus  # pylint: disable=import-outside-toplevel
        versions["opacus"] = opacus.__version__
    except ImportError:
        opacus = None
    entries = []
    for job in jobs:
        classes = job.model == "cifar"
        X = torch.from_numpy(job.x)
        T = torch.from_numpy(job.t.astype(np.int64) if classes else job.t)

        def per_example_loss(out, t):                     # [B]
            if classes:
                return torch.nn.functional.cross_entropy(out, t, reduction="none")
            return ((out - t) ** 2).sum(dim=1)

        def criterion():
            return torch.nn.CrossEntropyLoss() if classes else _squared_error(torch)()

        def vmap_grad():
            net = _torch_model(torch, job)
            params = {k: v.detach() for k, v in net.named_parameters()}

            def one_loss(p, x, t):                        # one example, x [...], t [...]
                out = func.functional_call(net, p, (x[None],))
                return per_example_loss(out, t[None]).sum()

            per_example = func.vmap(func.grad(one_loss), in_dims=(None, 0, 0))
            held = {}

            def run():
                held["grads"] = per_example(params, X, T)  # [B, *p.shape] each

            def result():
                return [_per_example_to_tf_layout(held["grads"][k]) for k in params]
            return run, result

        def opacus_step(mode):
            def build():
                if opacus is None:
                    raise NotImplementedError("opacus is not installed")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    net = _torch_model(torch, job)
                    optimizer = torch.optim.SGD(net.parameters(), lr=job.lr)
                    loader = torch.utils.data.DataLoader(
                        torch.utils.data.TensorDataset(X, T), batch_size=job.B)
                    made = opacus.PrivacyEngine().make_private(
                        module=net, optimizer=optimizer, criterion=criterion(),
                        data_loader=loader, noise_multiplier=0.0 if check else job.sigma,
                        max_grad_norm=job.clip, poisson_sampling=False,
                        grad_sample_mode=mode)
                if mode == "ghost":
                    net, optimizer, loss_fn, _ = made
                else:
                    net, optimizer, _ = made
                    loss_fn = criterion()
                state = {"first": True}

                def run():
                    optimizer.zero_grad()
                    loss_fn(net(X), T).backward()
                    optimizer.step()
                    if state["first"]:   # the checked step had σ = 0; time with σ
                        state["first"] = False
                        state["grads"] = [_to_tf_layout(p.grad) for p in net.parameters()]
                        optimizer.noise_multiplier = job.sigma

                return run, lambda: state["grads"]
            return build

        entries.append(_measure(job, TORCH_VMAP, "gradients", vmap_grad, check, repeats))
        for name, mode in [(OPACUS_HOOKS, "hooks"), (OPACUS_GHOST, "ghost")]:
            entry = _measure(job, name, "dp step", opacus_step(mode), check, repeats)
            if entry["reason"].startswith("NotImplementedError"):
                entry["status"] = "n/a"
            entries.append(entry)
    return versions, entries


# JAX: jit(vmap(grad)) and a jitted DP-SGD step -----------------------------------------


def _jax_entries(jobs, check, repeats):
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    versions = {"jax": jax.__version__, "jax_devices": [str(d) for d in jax.devices()]}
    entries = []
    for job in jobs:
        params = [jnp.asarray(w) for w in job.weights]
        X, T = jnp.asarray(job.x), jnp.asarray(job.t)
        classes = job.model == "cifar"

        def conv(x, kernel, bias):                        # NHWC, HWIO, "same"
            return jax.lax.conv_general_dilated(
                x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + bias

        def pool(x):                                      # [B, H, W, C] -> [B, H/2, W/2, C]
            B, H, W, C = x.shape
            return x.reshape(B, H // 2, 2, W // 2, 2, C).mean(axis=(2, 4))

        def forward(p, x):
            if job.model == "mlp":
                for k in range(0, len(p), 2):
                    x = x @ p[k] + p[k + 1]
                    x = jax.nn.relu(x) if k + 2 < len(p) else x
                return x
            if job.model == "cnn":
                x = jax.nn.elu(conv(x, p[0], p[1]))       # [B, H, W, 16]
                x = x.reshape(x.shape[0], -1)             # [B, H*W*16]
                return jax.nn.relu(x @ p[2] + p[3]) @ p[4] + p[5]
            x = pool(jax.nn.relu(conv(x, p[0], p[1])))
            x = pool(jax.nn.relu(conv(x, p[2], p[3])))
            x = jax.nn.relu(conv(x, p[4], p[5])).mean(axis=(1, 2))  # [B, 64]
            return x @ p[6] + p[7]                        # [B, 10]

        def one_loss(p, x, t):                            # one example
            out = forward(p, x[None])
            if classes:
                return -jax.nn.log_softmax(out)[0, t]
            return jnp.sum((out - t[None]) ** 2)

        per_example = jax.jit(jax.vmap(jax.grad(one_loss), in_axes=(None, 0, 0)))

        @jax.jit
        def dp_step(p, x, t, key, sigma):
            """SGD on (sum_i g_i min(1, C/n_i) + N(0, (σC)^2)) / B; returns (p', g)."""
            grads = jax.vmap(jax.grad(one_loss), in_axes=(None, 0, 0))(p, x, t)
            squares = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in grads)
            factors = jnp.minimum(1.0, job.clip / jnp.sqrt(squares))       # [B]
            keys = jax.random.split(key, len(grads))
            noisy = [(jnp.tensordot(factors, g, axes=1)
                      + sigma * job.clip * jax.random.normal(k, g.shape[1:])) / x.shape[0]
                     for g, k in zip(grads, keys)]
            return [w - job.lr * g for w, g in zip(p, noisy)], noisy

        def vmap_grad():
            held = {}

            def run():
                held["grads"] = jax.block_until_ready(per_example(params, X, T))
            return run, lambda: [np.asarray(g) for g in held["grads"]]

        def dp():
            state = {"params": params, "key": jax.random.PRNGKey(0), "first": True}

            def run():
                state["key"], key = jax.random.split(state["key"])
                sigma = 0.0 if state["first"] and check else job.sigma
                state["params"], grads = jax.block_until_ready(
                    dp_step(state["params"], X, T, key, sigma))
                if state["first"]:
                    state["first"], state["grads"] = False, [np.asarray(g) for g in grads]
            return run, lambda: state["grads"]

        entries.append(_measure(job, JAX_VMAP, "gradients", vmap_grad, check, repeats))
        entries.append(_measure(job, JAX_DP, "dp step", dp, check, repeats))
    return versions, entries


_RUNNERS = {"tf": _tf_entries, "torch": _torch_entries, "jax": _jax_entries}
_MODULES = {"tensorflow": "tf", "torch": "torch", "jax": "jax"}


def main(argv=None):
    """Runs the jobs for one framework; prints the JSON result on stdout; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m pertower.tools.peers_worker")
    parser.add_argument("--framework", choices=sorted(_RUNNERS), required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("jobs", nargs="+")
    args = parser.parse_args(argv)
    jobs = [Job(folder) for folder in args.jobs]
    stdout = sys.stdout
    sys.stdout = sys.stderr          # library prints must not corrupt the JSON
    try:
        versions, entries = _RUNNERS[args.framework](jobs, args.check, args.repeats)
    finally:
        sys.stdout = stdout
    # the frameworks this process loaded: its own only
    versions["loaded"] = [name for name in _MODULES if sys.modules.get(name) is not None]
    json.dump({"framework": args.framework, "versions": versions, "entries": entries},
              stdout)
    stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
