"""Sweep: per-example filter gradients of one convolution layer by every way of the
convolution rules, against the batch gradient and the one-example loop, with oneDNN
off and on (one process per setting: TensorFlow reads TF_ENABLE_ONEDNN_OPTS at import).

Run from a checkout:

    PYTHONPATH=$PWD python benchmarks/conv_ways.py              # the full grid
    PYTHONPATH=$PWD python benchmarks/conv_ways.py --quick      # a few shapes
    PYTHONPATH=$PWD python benchmarks/conv_ways.py --out sweep.json   # keep the records
    PYTHONPATH=$PWD python benchmarks/conv_ways.py --table sweep.json # their table again
    PYTHONPATH=$PWD python benchmarks/conv_ways.py --networks        # whole networks

Each row is one layer: rule (conv2d: Conv2D, depthwise: DepthwiseConv2dNative with one
filter per channel), map size H (= W), filter size k, channels (Cin -> Cout, or C),
stride s (SAME padding), batch B, float32. Each column is the median process CPU time
(ms, one intra-op thread, so that other jobs on the machine change it little) of one
`sess.run` of: "batch" the batch filter gradient (`tf.gradients`); "loop" the
one-example loop (B runs, one example fed each, as `pertower.oracle` does); each way
forced by `ConvOptions(strategy=...)` with method="rules"; "auto" the rule's own pick.
"-" where a way does not apply (e.g. "grouped" for Conv2D without oneDNN).

--networks: whole tf_keras.applications networks (weights=None, 10 classes, inference
mode, per-example softmax cross-entropy; NETWORKS: name, input side, B): the median
process CPU ms of the batch gradient, pertower's per-example gradients (default rules)
and the one-example loop, one intra-op thread, both oneDNN settings.
"""

import argparse
import json
import os
import subprocess
import sys
import time

CONV2D_WAYS = ("auto", "shifts", "patches", "grouped", "examples")
DEPTHWISE_WAYS = ("auto", "patches", "grouped", "examples")


def grid(quick):
    """The layers: dicts with rule, H, k, cin, cout, s, B."""
    rows = []
    maps = (1, 2, 4, 8, 16, 32)
    conv_channels = {1: [(256, 256)], 2: [(256, 256), (64, 64)], 4: [(128, 128), (32, 32)],
                     8: [(64, 64), (128, 128)], 16: [(32, 64), (8, 16)],
                     32: [(3, 32), (32, 32)]}
    depth_channels = {1: [576], 2: [576, 96], 4: [240, 64], 8: [144, 32], 16: [96, 16],
                      32: [32]}
    kernels, batches = (1, 3, 5, 7), (8, 32)
    if quick:
        maps, kernels, batches = (2, 8), (3, 5), (8,)
    for B in batches:
        for H in maps:
            for k in kernels:
                for s in ((1, 2) if H >= 2 else (1,)):
                    for cin, cout in conv_channels[H][:1 if quick else 2]:
                        rows.append(dict(rule="conv2d", H=H, k=k, cin=cin, cout=cout, s=s, B=B))
                    if k > 1:
                        for c in depth_channels[H][:1 if quick else 2]:
                            rows.append(dict(rule="depthwise", H=H, k=k, cin=c, cout=c, s=s,
                                             B=B))
    return rows


def _median_cpu_ms(run, repeats):
    run()   # warm up (and build the kernels' caches)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append((time.process_time() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def time_layer(case, repeats):
    """{column: ms or None} for one layer (see the module docstring)."""
    import numpy as np
    import tensorflow as tf
    import pertower
    from pertower import rules
    from pertower.rules import conv2d, depthwise_conv2d

    graph = tf.Graph()
    H, k, cin, cout, s, B = (case[n] for n in ("H", "k", "cin", "cout", "s", "B"))
    depthwise = case["rule"] == "depthwise"
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, H, H, cin])
        if depthwise:
            w = tf.Variable(tf.random.normal([k, k, cin, 1], stddev=0.1, seed=1))
            z = tf.nn.depthwise_conv2d(x, w, [1, s, s, 1], "SAME")
        else:
            w = tf.Variable(tf.random.normal([k, k, cin, cout], stddev=0.1, seed=1))
            z = tf.nn.conv2d(x, w, s, "SAME")
        ys = 0.5 * tf.reduce_sum(tf.square(z), axis=[1, 2, 3])     # dZ = z
        fetches = {"batch": tf.gradients(tf.reduce_sum(ys), w)[0]}
        for way in (DEPTHWISE_WAYS if depthwise else CONV2D_WAYS):
            registry = rules.default_registry()
            options = conv2d.ConvOptions(strategy=way)
            if depthwise:
                registry.register("DepthwiseConv2dNative",
                                  depthwise_conv2d.DepthwiseConv2DRule(options))
            else:
                registry.register("Conv2D", conv2d.Conv2DRule(options))
            try:
                fetches[way] = pertower.per_example_gradients(
                    ys, [w], batch=x, method="rules", rules=registry)[0]
            except Exception:   # pylint: disable=broad-except  (the way does not apply)
                fetches[way] = None
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1)
    values = np.random.RandomState(0).normal(size=[B, H, H, cin]).astype(np.float32)
    result = {}
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        for name, fetch in fetches.items():
            if fetch is None:
                result[name] = None
                continue
            result[name] = _median_cpu_ms(lambda f=fetch: sess.run(f, {x: values}), repeats)
        one = [{x: values[i:i + 1]} for i in range(B)]
        grad = fetches["batch"]
        result["loop"] = _median_cpu_ms(lambda: [sess.run(grad, f) for f in one], repeats)
    return result


NETWORKS = (("MobileNetV3Small", 32, 8, {}), ("MobileNetV3Small", 64, 8, {}),
            ("EfficientNetV2B0", 32, 8, {}), ("EfficientNetV2B0", 64, 8, {}),
            ("MobileNetV2", 32, 16, {"alpha": 0.35}))


def time_network(name, side, B, kwargs, repeats):
    """{column: ms} for one network (see --networks in the module docstring)."""
    import numpy as np
    import tensorflow as tf
    import tf_keras
    import pertower

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, side, side, 3])
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        model = getattr(tf_keras.applications, name)(
            input_shape=(side, side, 3), weights=None, classes=10, **kwargs)
        logits = model(x, training=False)
        ys = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        weights = model.trainable_weights
        fetches = {"batch": tf.gradients(tf.reduce_sum(ys), weights),
                   "per_example": pertower.per_example_gradients(ys, weights)}
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1)
    rng = np.random.RandomState(0)
    feed = {x: rng.uniform(size=[B, side, side, 3]).astype(np.float32),
            labels: rng.randint(0, 10, size=[B])}
    result = {}
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        for column, fetch in fetches.items():
            result[column] = _median_cpu_ms(lambda f=fetch: sess.run(f, feed), repeats)
        one = [{x: feed[x][i:i + 1], labels: feed[labels][i:i + 1]} for i in range(B)]
        result["loop"] = _median_cpu_ms(
            lambda: [sess.run(fetches["batch"], f) for f in one], repeats)
    return result


def network_worker(args):
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    tf.get_logger().setLevel("ERROR")
    for name, side, B, kwargs in NETWORKS:
        record = dict(network=name, side=side, B=B, kwargs=kwargs,
                      onednn=os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                      ms=time_network(name, side, B, kwargs, args.repeats))
        print(json.dumps(record), flush=True)


def network_table(records):
    """One line per network, both oneDNN settings side by side."""
    by_key = {}
    for r in records:
        by_key.setdefault((r["network"], r["side"], r["B"]), {})[r["onednn"]] = r["ms"]
    lines = ["| network | side | B | batch | per-example | loop || batch | per-example | "
             "loop |", "|---|---|---|---|---|---||---|---|---|"]
    for (name, side, B), by in by_key.items():
        cells = [" | ".join(_cell(by.get(o, {}).get(c)) for c in
                            ("batch", "per_example", "loop")) for o in ("0", "1")]
        lines.append(f"| {name} | {side} | {B} | {cells[0]} || {cells[1]} |")
    return "\n".join(lines)


def worker(args):
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    tf.get_logger().setLevel("ERROR")
    out = []
    for case in grid(args.quick):
        case = dict(case, onednn=os.environ.get("TF_ENABLE_ONEDNN_OPTS"))
        case["ms"] = time_layer(case, args.repeats)
        out.append(case)
        print(json.dumps(case), flush=True)
    return out


def _cell(value):
    return "-" if value is None else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def table(records):
    """Markdown table: one line per layer, both oneDNN settings side by side."""
    by_key = {}
    for r in records:
        key = tuple(r[n] for n in ("rule", "H", "k", "cin", "cout", "s", "B"))
        by_key.setdefault(key, {})[r["onednn"]] = r["ms"]
    lines = []
    for rule, ways in (("conv2d", CONV2D_WAYS), ("depthwise", DEPTHWISE_WAYS)):
        cols = ["batch", "loop"] + list(ways)
        head = " | ".join(cols)
        lines.append(f"\n{rule}: ms, oneDNN off || oneDNN on\n")
        lines.append(f"| H | k | Cin->Cout | s | B | {head} || {head} |")
        lines.append("|" + "---|" * (5 + 2 * len(cols)))
        for key, by in sorted(by_key.items()):
            if key[0] != rule:
                continue
            cells = [" | ".join(_cell(by.get(o, {}).get(c)) for c in cols) for o in ("0", "1")]
            lines.append(f"| {key[1]} | {key[2]} | {key[3]}->{key[4]} | {key[5]} | {key[6]} | "
                         f"{cells[0]} || {cells[1]} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the records (JSON lines) here")
    parser.add_argument("--table", default=None, help="print the table of this JSON-lines file")
    parser.add_argument("--networks", action="store_true", help="whole networks instead")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            records = [json.loads(line) for line in f if line.strip()]
        print(network_table(records) if "network" in records[0] else table(records))
        return
    if args.worker:
        (network_worker if args.networks else worker)(args)
        return
    records = []
    for onednn in ("0", "1"):
        env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2")
        command = [sys.executable, __file__, "--worker", "--repeats", str(args.repeats)]
        command += ["--quick"] * args.quick + ["--networks"] * args.networks
        done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        records += [json.loads(line) for line in done.stdout.splitlines()
                    if line.startswith("{")]
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"load {open('/proc/loadavg').read().split()[:3]}")
    print(network_table(records) if args.networks else table(records))


if __name__ == "__main__":
    main()
