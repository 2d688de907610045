"""The JAX child of `python -m benchmarks --peers`: jit(vmap(grad)) and a jitted DP-SGD step,
on each job's model, written in TensorFlow's layouts (lax.conv_general_dilated with
("NHWC", "HWIO", "NHWC")) with the TensorFlow model's weights.

Notation: that of `benchmarks.peers_jobs` (B examples, C clip norm, σ noise
multiplier, lr learning rate, g_i example i's gradient, n_i = ||g_i||_2).
"""

import numpy as np

from benchmarks import peers_jobs
from benchmarks import records

__all__ = ["jax_entries"]


def jax_entries(jobs, check, repeats):
    """(versions, entry dicts) of the JAX entries on every job (`peers_jobs.measure`)."""
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

        entries.append(peers_jobs.measure(job, records.JAX_VMAP, "gradients", vmap_grad,
                                          check, repeats))
        entries.append(peers_jobs.measure(job, records.JAX_DP, "dp step", dp, check, repeats))
    return versions, entries
