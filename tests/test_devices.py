"""devices=[...]: towers placed round-robin on two virtual CPU devices (placement read
from the graph and from the run's step stats), values against the oracle. The same on
TensorFlow's distributed runtime with two in-process servers: tests/test_clusters.py
(with a While loop: heavy, here)."""

import re

import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import cases
from tests import common

DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def _two_cpu_session(graph):
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2}, allow_soft_placement=False)
    sess = tf.compat.v1.Session(graph=graph, config=config)
    with graph.as_default():
        sess.run(tf.compat.v1.global_variables_initializer())
    return sess


def _ran_on(sess, fetches, feed):
    """(values, {node name: device}) from a fully traced run."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    values = sess.run(fetches, feed, options=options, run_metadata=metadata)
    placed = {}
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            placed[node.node_name] = device.device
    return values, placed


@pytest.fixture(scope="module", params=["mlp", "embedding"])
def placed(request):
    """A model from tests.common with towers on two virtual CPUs (B = 4 towers)."""
    case = cases.BUILDERS[request.param]()
    case.sess.close()
    with case.graph.as_default():
        loop = oracle.SliceLoop(case.ys, case.xs)
        # devices place towers; the rules (method="auto") run one batched computation
        grads = pertower.per_example_gradients(case.ys, case.xs, batch_size=case.B,
                                               devices=DEVICES, name="pex", method="towers")
        micro = pertower.microbatch_gradients(case.ys, case.xs, num_microbatches=2,
                                              batch_size=case.B, devices=DEVICES[::-1],
                                              name="micro", method="towers")
        towers = pertower.build_towers(case.ys, case.xs, batch_size=case.B, devices=DEVICES)
    case.sess = _two_cpu_session(case.graph)
    yield case, loop, grads, micro, towers
    case.sess.close()


def test_towers_are_placed_round_robin_in_the_graph(placed):
    case, _, _, _, towers = placed
    assert towers.devices == tuple(DEVICES)
    for t, output in enumerate(towers.outputs):
        want = DEVICES[t % 2]
        assert output.op.device == want, (output.op.name, output.op.device)
        for copies in towers.copies:
            assert copies[t].op.device == want, (copies[t].op.name, copies[t].op.device)
    replayed = [op for op in case.graph.get_operations() if "/replay/t" in op.name
                and op.name.startswith("towers/")]
    assert replayed
    for op in replayed:
        t = int(re.search(r"/replay/t(\d+)/", op.name).group(1))
        assert op.device == DEVICES[t % 2], (op.name, op.device)


def test_towers_run_on_their_devices_and_match_oracle(placed):
    case, loop, grads, micro, _ = placed
    (got, got_micro), ran_on = _ran_on(case.sess, [grads, micro], case.feed)
    common.assert_all_close(got, loop.run(case.sess, case.feed, case.B), case.rtol, case.atol,
                            f"{case.name} per-example gradients on two CPUs")
    common.assert_all_close(got_micro, loop.run(case.sess, case.feed, 2), case.rtol,
                            case.atol, f"{case.name} microbatches on two CPUs")
    seen = {}
    for name, device in ran_on.items():
        match = re.match(r"pex/towers/replay/t(\d+)/", name)
        if match:
            t = int(match.group(1))
            assert device.endswith(f"CPU:{t % 2}"), (name, device)
            seen[t] = True
        match = re.match(r"micro/towers/replay/t(\d+)/", name)
        if match:  # DEVICES reversed: microbatch m on CPU (1 - m % 2)
            t = int(match.group(1))
            assert device.endswith(f"CPU:{1 - t % 2}"), (name, device)
    assert sorted(seen) == list(range(case.B)), sorted(seen)
    # each tower's backward pass runs on its tower's device: tower 0's is built by
    # tf.gradients (under pex/gradients/t0/), the others are its copies (.../t<t>/)
    backward = {}
    for name, device in ran_on.items():
        match = re.match(r"pex/gradients/t(\d+)/", name)
        if match:
            backward.setdefault(int(match.group(1)), []).append(device)
    assert sorted(backward) == list(range(case.B)), sorted(backward)
    for t, devices in backward.items():
        assert all(d.endswith(f"CPU:{t % 2}") for d in devices), (t, devices)


@pytest.mark.parametrize("bad,error,words", [
    ("/cpu:0", TypeError, r"`devices` must be a list of device strings"),
    ([], ValueError, r"`devices` is empty"),
    (["/cpu:0", 3], TypeError, r"`devices\[1\]` must be a device string, but received int"),
    (["/cpu:0", "not a device"], ValueError, r"`devices\[1\]` \('not a device'\) is not a "
                                             r"device string"),
])
def test_bad_devices_are_refused(bad, error, words):
    case = cases.build_mlp(B=2)
    case.sess.close()
    with case.graph.as_default():
        with pytest.raises(error, match=r"pertower.per_example_gradients: " + words):
            pertower.per_example_gradients(case.ys, case.xs, batch_size=2, devices=bad)


@pytest.mark.heavy
def test_towers_with_a_loop_on_two_servers_of_a_cluster_match_oracle():
    """tests/scripts/distributed_towers.py in a fresh interpreter: the checks of
    tests/test_clusters.py's towers and the towers with a GRU branch (a While loop
    replayed in each tower)."""
    done = common.run_python("tests/scripts/distributed_towers.py", "heavy")
    assert "passed check_towers_with_a_loop_on_two_tasks_match_oracle" in done.stdout, done.stdout
