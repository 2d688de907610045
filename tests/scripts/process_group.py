"""Runs several processes of tests/process_checks.PROCESSES in this one interpreter, one
after the other, so that they share one TensorFlow start-up:

    python tests/scripts/process_group.py legacy tower_sizes ...

Each process's script runs as `__main__` with its own arguments (`PROCESSES[name].argv`);
its output is framed by the lines of `process_checks.section_lines(name)`, the end line
carrying the exit code the script gave to `sys.exit`. The members of a group
(`process_checks.GROUPS`) share a mode (disable_v2_behavior()) and an environment;
TF_USE_LEGACY_KERAS is set (or removed) for each member as its `legacy_keras_env` says,
so that the members after the fresh ones (which set it themselves) find it as when
they run alone.
Started by `process_runner.Runner`, it claims each member before running it
(`process_runner.claim_member`) and skips the members that another run (of the same
group, for the other test process) has claimed meanwhile: no line for those.
"""

import os
import runpy
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import process_checks  # noqa: E402
from tests import process_runner  # noqa: E402


_COST_PREFIX = "pertower-member-cost "


def _exit_code(code):
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def main(names):
    """Runs the processes `names`; returns 0 if each exited with 0, else 1."""
    failed = False
    for name in names:
        if not process_runner.claim_member(name):
            continue   # another run has it
        command = process_checks.PROCESSES[name]
        path, *args = command.argv
        if command.legacy_keras_env:
            os.environ["TF_USE_LEGACY_KERAS"] = "1"
        else:
            os.environ.pop("TF_USE_LEGACY_KERAS", None)
        start, end = process_checks.section_lines(name)
        print(start, flush=True)
        cpu, wall = time.process_time(), time.perf_counter()
        saved = sys.argv
        sys.argv = [path, *args]
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as done:
            code = _exit_code(done.code)
        except Exception:  # pylint: disable=broad-except  # report, then run the others
            traceback.print_exc()
            code = 1
        finally:
            sys.argv = saved
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"{end} {code}", flush=True)
        # (outside the section) the member's CPU and wall seconds, the first member's
        # including the TensorFlow start-up: what tests/process_checks.COSTS estimates
        print(f"{_COST_PREFIX}{name} {time.process_time() - cpu:.2f} "
              f"{time.perf_counter() - wall:.2f}", flush=True)
        failed = failed or code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ[process_checks.IN_GROUP_ENV] = "1"   # the members leave the exit to us
    CODE = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # without waiting for what a member leaves running (tf.distribute.Servers cannot
    # be stopped cleanly in-process)
    os._exit(CODE)  # pylint: disable=protected-access
