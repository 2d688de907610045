"""Scripts that the tests run in a fresh interpreter (`tests.common.run_python`): what
needs servers alive until their process ends (tests/scripts/clusters.py runs the
default checks of tests/scripts/distributed_towers.py and
tests/scripts/dp_distributed_checks.py) or a process set up as a user's is
(tests/scripts/run_doc_blocks.py, tests/scripts/scenario_examples.py)."""

import socket
import sys
import traceback

__all__ = ["run_each", "free_ports"]


def run_each(checks):
    """Runs each check (a function without arguments that raises on failure, and may
    return a string to print); prints "passed NAME" or "FAILED NAME" and the traceback
    for each. Returns the exit code: 1 if a check failed, else 0."""
    failed = 0
    for check in checks:
        try:
            output = check()
        except Exception:  # pylint: disable=broad-except  # report all, then fail
            failed += 1
            print(f"FAILED {check.__name__}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"passed {check.__name__}" + (f": {output}" if output else ""), flush=True)
    print(f"{len(checks) - failed} passed, {failed} failed", flush=True)
    sys.stdout.flush()
    return 1 if failed else 0


def free_ports(n):
    """n ports the OS reports free on 127.0.0.1 (bound together, then released), for the
    scripts that start tf.distribute.Servers."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
