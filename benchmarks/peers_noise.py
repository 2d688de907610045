"""`python -m benchmarks --dp`'s reference for the noise draw: PyTorch's in-place `normal_`
on P numbers, timed in a child process of the peers' Python.

    python -m benchmarks.peers_noise --repeats R [--fills K] P [P ...]

imports only PyTorch, fills one preallocated float32 tensor of each size P with N(0, 1)
draws (`torch.Tensor.normal_`, the fastest way to P Gaussian numbers we know of on a
CPU), one warm-up and R timed runs of K fills each (K = 10 by default), and prints one
JSON object on stdout: {"torch": version, "threads": torch's intra-op threads,
"fills": K, "runs_ms": {"P": [ms, ...]}}, each run's time divided by K: the cost of one
fill, as the TensorFlow side's "noise draw" row is K chained draws in one `sess.run`
divided by K (neither side then counts its per-call overhead).

The driver (`torch_normal_runs`) starts it with `--peers-python` or
$PERTOWER_PEERS_PYTHON (else this interpreter), as the other peers' children.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import peers as peers_lib

__all__ = ["FILLS_PER_RUN", "torch_normal_runs", "main"]

_TIMEOUT_SECONDS = 600
# fills per timed run: the per-call overhead of Python and of the dispatch is shared
FILLS_PER_RUN = 10


def torch_normal_runs(sizes, repeats, python=None, fills=FILLS_PER_RUN):
    """{P: [ms, ...]}: `repeats` timed runs of `fills` `normal_` fills of P float32
    numbers each, each run's time divided by `fills` (ms per fill), in a child process;
    raises RuntimeError (with the child's last line) when it fails, e.g. when its
    Python has no torch.

    Args:
      sizes: the P to time.
      repeats: timed runs per size, after one warm-up.
      python: the child's interpreter (default: $PERTOWER_PEERS_PYTHON, else this one).
      fills: K, the fills per timed run.
    """
    python = python or os.environ.get(peers_lib.PYTHON_VARIABLE) or sys.executable
    command = [python, "-m", "benchmarks.peers_noise", "--repeats",
               str(repeats), "--fills", str(int(fills))] + [str(int(P)) for P in sizes]
    # pylint: disable-next=protected-access
    done = subprocess.run(command, env=peers_lib._child_env(), capture_output=True,
                          text=True, timeout=_TIMEOUT_SECONDS, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the torch noise child exited with {done.returncode}: "
                           f"{tail}"[:300])
    result = json.loads(lines[-1])
    return {int(P): runs for P, runs in result["runs_ms"].items()}


def main(argv=None):
    """The child: times `normal_` on each size; prints the JSON object."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers_noise")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--fills", type=int, default=FILLS_PER_RUN)
    parser.add_argument("sizes", type=int, nargs="+")
    args = parser.parse_args(argv)
    import torch  # pylint: disable=import-outside-toplevel
    runs = {}
    for P in args.sizes:
        draws = torch.empty(P, dtype=torch.float32)        # [P]
        draws.normal_()                                    # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.fills):
                draws.normal_()
            times.append(1e3 * (time.perf_counter() - start) / args.fills)
        runs[str(P)] = times
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "fills": args.fills, "runs_ms": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
