"""Run in a process of its own (servers live until the process ends): towers on the two
tasks of a TensorFlow cluster of in-process `tf.distribute.Server`s on 127.0.0.1,
a session on the first server's target, values against the one-example oracle.

    python tests/scripts/distributed_towers.py [heavy]

run by tests/test_devices.py with `heavy` (`tests.common.run_python`: the towers
replaying a While loop too; the default run's checks run in tests/scripts/clusters.py);
prints one line per check (`tests.scripts.run_each`) and exits 1 if one failed.
"""

import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()

import tf_keras as keras  # noqa: E402

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402
from tests import common  # noqa: E402
from tests import scripts  # noqa: E402

TASKS = ["/job:worker/task:0", "/job:worker/task:1"]


def _start_cluster():
    ports = scripts.free_ports(2)
    cluster = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{p}" for p in ports]})
    servers = [tf.distribute.Server(cluster, job_name="worker", task_index=i, start=True)
               for i in range(2)]
    return servers


def _close(got, want, what, rtol=None, atol=None, kind="tight"):
    common.assert_all_close(got, want, rtol, atol, what, kind)


def _model(gru=False):
    """A Keras MLP, with `gru` a GRU branch too (a While op), the variables on task 0."""
    graph = tf.Graph()
    with graph.as_default(), tf.device(TASKS[0]):
        tf.compat.v1.set_random_seed(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        dense, head = keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)
        hidden, xs = dense(x), dense.trainable_weights
        rng = np.random.RandomState(0)
        feed = {x: rng.randn(4, 4).astype(np.float32)}
        if gru:
            seq = tf.compat.v1.placeholder(tf.float32, [None, 3, 2], name="seq")
            layer = keras.layers.GRU(3)
            hidden = tf.concat([hidden, layer(seq)], axis=1)
            xs = xs + layer.trainable_weights
            feed[seq] = rng.randn(4, 3, 2).astype(np.float32)
        out = head(hidden)                                          # [B, 1]
        ys = tf.reduce_sum(out ** 2, axis=1)                        # [B]
        xs = xs + head.trainable_weights
    return graph, ys, xs, feed


def check_towers_on_two_tasks(servers, gru=False):
    """Per-example gradients and microbatches with towers on task 0 and task 1 (of an
    MLP, with `gru` a GRU branch too)."""
    graph, ys, xs, feed = _model(gru)
    with graph.as_default():
        loop = oracle.SliceLoop(ys, xs)
        grads = pertower.per_example_gradients(ys, xs, batch_size=4, devices=TASKS, name="pex",
                                               method="towers")
        micro = pertower.microbatch_gradients(ys, xs, num_microbatches=2, batch_size=4,
                                              devices=TASKS, name="micro", method="towers")
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(servers[0].target, graph=graph) as sess:
        sess.run(init)
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        metadata = tf.compat.v1.RunMetadata()
        got, got_micro = sess.run([grads, micro], feed, options=options, run_metadata=metadata)
        _close(got, loop.run(sess, feed, 4), "per-example gradients on two tasks", kind="deep")
        _close(got_micro, loop.run(sess, feed, 2), "microbatches on two tasks", kind="deep")
    tasks_seen = set()
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            match = re.match(r"pex/towers/replay/t(\d+)/", node.node_name)
            # names whose last part starts with "_" are the runtime's Send/Recv nodes
            if match and not node.node_name.rsplit("/", 1)[-1].startswith("_"):
                t = int(match.group(1))
                if f"/job:worker/replica:0/task:{t % 2}/" not in device.device + "/":
                    raise AssertionError(f"{node.node_name} ran on {device.device}")
                tasks_seen.add(t % 2)
    if tasks_seen != {0, 1}:
        raise AssertionError(f"tower ops seen on tasks {sorted(tasks_seen)}, expected 0 and 1")
    return f"{len(metadata.step_stats.dev_stats)} devices in the trace"


def check_graph_placement():
    """The copies and replayed ops carry the task device strings."""
    graph, ys, xs, _ = _model()
    with graph.as_default():
        towers = pertower.build_towers(ys, xs, batch_size=4, devices=TASKS)
    for t in range(4):
        for copies in towers.copies:
            device = tf.DeviceSpec.from_string(copies[t].op.device)
            if (device.job, device.task) != ("worker", t % 2):
                raise AssertionError(f"{copies[t].op.name} on {copies[t].op.device}")
        device = tf.DeviceSpec.from_string(towers.outputs[t].op.device)
        if (device.job, device.task) != ("worker", t % 2):
            raise AssertionError(f"{towers.outputs[t].op.name} on {towers.outputs[t].op.device}")


def check_cluster_devices(servers):
    """Both tasks answer through the first server's session."""
    with tf.Graph().as_default() as graph:
        with tf.device(TASKS[1]):
            value = tf.constant(2.0) * 3.0
        with tf.compat.v1.Session(servers[0].target, graph=graph) as sess:
            names = [d.name for d in sess.list_devices()]
            if not any("/job:worker/replica:0/task:1/" in n for n in names):
                raise AssertionError(f"task 1 not listed: {names}")
            if sess.run(value) != 6.0:
                raise AssertionError("task 1 computed a wrong value")


def checks(heavy=False):
    """The checks on a cluster started now (with `heavy`, the towers replaying a While
    loop on the two tasks too, placed like the MLP's ops of the default run's check)."""
    servers = _start_cluster()

    def check_cluster_devices_answer():
        check_cluster_devices(servers)

    def check_towers_on_two_tasks_match_oracle():
        check_towers_on_two_tasks(servers)

    def check_towers_with_a_loop_on_two_tasks_match_oracle():
        check_towers_on_two_tasks(servers, gru=True)

    return [check_cluster_devices_answer, check_graph_placement,
            check_towers_on_two_tasks_match_oracle,
            *([check_towers_with_a_loop_on_two_tasks_match_oracle] if heavy else [])]


def main():
    code = scripts.run_each(checks(heavy=sys.argv[1:] == ["heavy"]))
    # Servers cannot be stopped cleanly in-process; leave without waiting for them.
    os._exit(code)  # pylint: disable=protected-access


if __name__ == "__main__":
    main()
