"""Checks that need a process of their own, started once per test session.

Some checks need a process-wide TensorFlow mode that the test process cannot switch to
(eager execution, `tf.compat.v1.disable_v2_behavior()`), servers that live until their
process ends, or a fresh interpreter (the documents' Python blocks, the examples and
`pertower demo` set up their own environment). Each such process is a script or command of `PROCESSES`; a script runs
many checks and reports each on a line of its own:

    pertower-check {"name": "check_v1_cond", "ok": true, "message": ""}

The test process queues every process that its collected tests name (with the marker
`@pytest.mark.process_checks("legacy")`) as soon as collection ends; a background
thread runs them one at a time, the longest runs first (`queue_order`), so their
start-ups overlap the other tests. The queued members of one of `GROUPS` run in one
interpreter (tests/scripts/process_group.py), one TensorFlow start-up for all; the two test
processes of an xdist session share the members of a long group (`SHARED_GROUPS`) out
between two such interpreters. Each test then waits for its process and asserts the
result of its own check (`Processes.assert_passed`) or reads its output
(`Processes.completed`). tests/conftest.py holds the one `Processes` of each test
process; pytest-xdist's workers share its output directory, and claim files make each
process run once.

The script side is `run_checks`, called by the scripts of tests/scripts/. The default
run checks each mechanism once in each process-wide mode; a script's matrix of further
models, sizes and methods runs in its `NAME_heavy` process (the script's argument
"heavy", `run_checks(heavy=...)`), read by tests marked `heavy`.
"""

import dataclasses
import json
import os
import socket
import sys
import time

from tests import process_runner
from tests.process_runner import CheckResult, Completed, TIMEOUT_SECONDS, section_lines

__all__ = ["PROCESSES", "Processes", "Completed", "CheckResult", "run_checks",
           "require_legacy_mode", "LEGACY_HEAVY_CHECKS", "legacy_process", "legacy_params",
           "free_ports", "GROUPS", "SHARED_GROUPS", "IN_GROUP_ENV", "COSTS", "DEFAULT_COST",
           "queue_order", "section_lines", "TIMEOUT_SECONDS"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclasses.dataclass(frozen=True)
class _Command:
    """How to start one process.

    Attributes:
      argv: the arguments after the Python executable.
      legacy_keras_env: True to pass TF_USE_LEGACY_KERAS=1 (tests/conftest.py sets it in
        this process); False to remove it, so that the process must set it up itself.
      one_thread: True to run TensorFlow on one thread.
      environment: (name, value) pairs to set in the process's environment (in a
        group's run: for all of its members).
      fresh: True for a process that runs as a user's fresh interpreter does: started
        without TF_USE_LEGACY_KERAS, it sets up Keras and graph mode itself. In a
        group's run the fresh members run first (in the group's order), before any
        member has imported TensorFlow or switched a mode; `legacy_keras_env` False.
    """

    argv: tuple
    legacy_keras_env: bool = True
    one_thread: bool = True
    environment: tuple = ()
    fresh: bool = False


_ONEDNN_ON = (("TF_ENABLE_ONEDNN_OPTS", "1"),)


PROCESSES = {
    # tf.compat.v1.disable_v2_behavior(): reference variables, v1 control flow.
    "legacy": _Command((os.path.join(HERE, "scripts", "legacy_mode_checks.py"),)),
    # its long checks (LEGACY_HEAVY_CHECKS), for the heavy run (-m heavy)
    "legacy_heavy": _Command((os.path.join(HERE, "scripts", "legacy_mode_checks.py"), "heavy")),
    # the same, for the rules of tests/test_rules_published.py.
    "published_legacy": _Command((os.path.join(HERE, "scripts", "published_rules_checks.py"),)),
    "unseen_legacy": _Command((os.path.join(HERE, "scripts", "unseen_networks_checks.py"),)),
    "published_legacy_zoo": _Command(
        (os.path.join(HERE, "scripts", "published_rules_checks.py"), "zoo")),
    # the same, for the weight functions of tests/test_rules_weight_functions.py.
    "weight_functions_legacy": _Command((os.path.join(HERE, "scripts",
                                                      "weight_function_checks.py"),)),
    # weights read inside while loops on the rules (tests/test_rules_recurrent.py)
    "recurrent_legacy": _Command((os.path.join(HERE, "scripts", "recurrent_rules_checks.py"),)),
    "recurrent_legacy_heavy": _Command((os.path.join(HERE, "scripts",
                                                     "recurrent_rules_checks.py"), "heavy")),
    "recurrent_v1": _Command((os.path.join(HERE, "scripts", "recurrent_v1_checks.py"),)),
    "recurrent_v1_heavy": _Command((os.path.join(HERE, "scripts", "recurrent_v1_checks.py"),
                                    "heavy")),
    # batch sizes used as shapes and indices in the towers, under disable_v2_behavior()
    "tower_sizes": _Command((os.path.join(HERE, "scripts", "tower_sizes_checks.py"),)),
    "tower_sizes_heavy": _Command((os.path.join(HERE, "scripts", "tower_sizes_checks.py"),
                                   "heavy")),
    # joined batches through v1 loops and the row passes' fed-size message
    "messages_joined_legacy": _Command(
        (os.path.join(HERE, "scripts", "messages_and_joined_checks.py"),)),
    "messages_joined_legacy_heavy": _Command(
        (os.path.join(HERE, "scripts", "messages_and_joined_checks.py"), "heavy")),
    # Python gradients and transposed convolutions in the towers, the environment's oneDNN
    "python_gradients_legacy": _Command(
        (os.path.join(HERE, "scripts", "python_gradient_checks.py"), "inherit", "legacy"),
        one_thread=False),
    # loops bounded by a batch reduction and Python gradients on row passes, v1 loops
    "never_wrong_loops": _Command((os.path.join(HERE, "scripts", "never_wrong_loop_checks.py"),)),
    "never_wrong_loops_heavy": _Command(
        (os.path.join(HERE, "scripts", "never_wrong_loop_checks.py"), "heavy")),
    # non-float variables in DPOptimizer and the rules' static sizes, in each shape mode
    **{f"never_wrong_{kind}_{mode}": _Command(
        (os.path.join(HERE, "scripts", f"never_wrong_{kind}_checks.py"), mode),
        one_thread=False)
       for kind in ("dtype", "shape") for mode in ("graph", "legacy")},
    "curvature_legacy": _Command((os.path.join(HERE, "scripts", "curvature_legacy_checks.py"),)),
    "curvature_legacy_heavy": _Command(
        (os.path.join(HERE, "scripts", "curvature_legacy_checks.py"), "heavy")),
    "curvature_convs_legacy": _Command((os.path.join(HERE, "scripts", "curvature_conv_checks.py"),)),
    "curvature_convs_legacy_heavy": _Command(
        (os.path.join(HERE, "scripts", "curvature_conv_checks.py"), "heavy")),
    # the DP modes and per-weight norms under disable_v2_behavior()
    "dp_modes_legacy": _Command((os.path.join(HERE, "scripts", "dp_modes_legacy_checks.py"),)),
    "vgg_paths_legacy": _Command((os.path.join(HERE, "scripts", "vgg_paths_legacy.py"),)),
    # legacy TF1 idioms of tests/test_legacy_idioms.py (sampled losses, v1 layers, cells)
    **{name: _Command((os.path.join(HERE, "scripts", "legacy_idioms_checks.py"), *args))
       for name, args in (("legacy_idioms", ()), ("legacy_idioms_heavy", ("heavy",)))},
    # tests/test_rules_convs.py under disable_v2_behavior() and with TF_ENABLE_ONEDNN_OPTS=1
    # (the oneDNN ones set TF_ENABLE_ONEDNN_OPTS=1 themselves too, when run alone)
    # (TF_USE_LEGACY_KERAS: they set it themselves, and import tf_keras by name)
    **{f"convs_{mode}": _Command((os.path.join(HERE, "scripts", "conv_rules_checks.py"), mode),
                                 one_thread=mode == "legacy", legacy_keras_env=mode == "legacy",
                                 environment=_ONEDNN_ON if mode == "onednn" else ())
       for mode in ("legacy", "onednn")},
    "convs_legacy_heavy": _Command(
        (os.path.join(HERE, "scripts", "conv_rules_checks.py"), "legacy", "heavy")),
    **{f"zoo_speed_{m}": _Command((os.path.join(HERE, "scripts", "zoo_speed_checks.py"), m),
                                  legacy_keras_env=m == "legacy",
                                  environment=_ONEDNN_ON if m == "onednn" else ())
       for m in ("legacy", "onednn")},   # tests/test_rules_zoo_speed.py in the other modes
    # eager execution on (TensorFlow 2's default): pertower refuses, naming the switch.
    "eager": _Command((os.path.join(HERE, "scripts", "eager_mode_checks.py"),),
                      legacy_keras_env=False),
    # two tf.distribute.Servers, alive until the process ends.
    "distributed": _Command((os.path.join(HERE, "scripts", "distributed_towers.py"),)),
    "distributed_heavy": _Command((os.path.join(HERE, "scripts", "distributed_towers.py"),
                                   "heavy")),
    # DPSyncReplicasOptimizer on a ps and two workers (in-process servers, one thread each)
    **{name: _Command((os.path.join(HERE, "scripts", "dp_distributed_checks.py"), *args),
                      one_thread=False)
       for name, args in (("dp_distributed", ()), ("dp_distributed_stats", ("stats",)),
                          ("dp_distributed_legacy", ("legacy",)))},
    # the user-facing commands and the documents' Python blocks, as a user runs them:
    # they set their environment up (the blocks of tests/test_docs.py first: a fresh
    # interpreter is what its first check checks)
    "doc_blocks": _Command((os.path.join(HERE, "scripts", "run_doc_blocks.py"),),
                           legacy_keras_env=False, fresh=True),
    "scenario_examples": _Command((os.path.join(HERE, "scripts", "scenario_examples.py"),),
                                  legacy_keras_env=False, fresh=True),
    # Keras 3 (tf.keras without TF_USE_LEGACY_KERAS): its own summary line, no checks.
    "keras3": _Command((os.path.join(HERE, "scripts", "keras3_weights.py"),),
                       legacy_keras_env=False),
}


# The checks of tests/scripts/legacy_mode_checks.py that take several seconds each and
# check a mechanism that another legacy check of the default run checks too (v1 frames
# on the rules: check_v1_dynamic_rnn_gru_with_sequence_length_matches_oracle): they run
# in the process "legacy_heavy", read by heavy tests only; the others in "legacy".
LEGACY_HEAVY_CHECKS = frozenset({
    "check_v1_dynamic_rnn_lstm_matches_oracle",
    "check_keras_lstm_with_v1_loops_matches_oracle",
    "check_v1_map_fn_and_scan_over_time_match_oracle",
    # (v1 conds on a batch reduction: unproven, checked at run time; a v1 loop bounded
    # by one: never_wrong_loops' check_max_bounded_loop_without_mask_is_checked_and_caught)
    "check_static_rnn_with_sequence_length_matches_oracle",
    "check_v1_bidirectional_dynamic_rnn_microbatches_match_oracle",
    "check_legacy_lstm_example_runs_and_matches_the_loop",
    "check_v1_dynamic_rnn_final_state_of_each_cell_is_proven",
    "check_v1_raw_rnn_is_checked_at_run_time_and_matches_oracle",
    "check_v1_dynamic_rnn_basic_rnn_and_multi_rnn_cells_match_oracle",
    "check_lstm_with_control_flow_v2_matches_oracle",
    "check_v1_map_fn_over_the_batch_is_proven",
    "check_v1_dynamic_rnn_final_state_with_sequence_length_is_proven",
})


def legacy_process(check):
    """The process that runs legacy check `check`: "legacy_heavy" or "legacy"."""
    return "legacy_heavy" if check in LEGACY_HEAVY_CHECKS else "legacy"


def legacy_params(checks):
    """pytest parameters for the legacy checks named `checks`, each marked with the
    process that runs it (and `heavy` for the long ones)."""
    import pytest  # pylint: disable=import-outside-toplevel  (the scripts import this module)
    return [pytest.param(check, marks=(pytest.mark.process_checks(legacy_process(check)),)
                         + ((pytest.mark.heavy,) if check in LEGACY_HEAVY_CHECKS else ()))
            for check in checks]


# Processes that run in one interpreter, one after the other (tests/scripts/
# process_group.py), when several of them are queued: each would otherwise spend its
# own TensorFlow start-up (~7-10 s of CPU). Members share a mode (disable_v2_behavior(),
# or graph mode, or eager execution with Keras 3 in graphs of its own) and environment
# (`legacy_keras_env`, which the group's run sets for each member; the `environment` of
# each member queued is set for the whole run: the last group runs with oneDNN on when
# a oneDNN member is queued); a group runs on one thread only if each of its members
# does. The `fresh` members of a group run first, in a fresh interpreter (the
# documents' blocks, then the examples and the demo, which switch graph mode on and
# Keras 2 as a user's script does); the graph-mode members follow in that mode. For
# the long group (SHARED_GROUPS, the legacy one) each test process of an xdist session
# starts a run, and the two runs share the members out as they go
# (`process_runner.Runner`), so that the group keeps both cores busy until its last
# member; a shorter group is not worth a second start-up.
GROUPS = (
    ("legacy", "published_legacy", "weight_functions_legacy", "recurrent_legacy",
     "tower_sizes", "messages_joined_legacy", "never_wrong_loops", "dp_modes_legacy",
     "convs_legacy", "curvature_legacy", "never_wrong_shape_legacy",
     "never_wrong_dtype_legacy", "python_gradients_legacy", "recurrent_v1",
     "curvature_convs_legacy", "zoo_speed_legacy", "vgg_paths_legacy", "unseen_legacy",
     "legacy_idioms"),
    # graph mode (disable_eager_execution()), after the fresh members that set it up;
    # the servers of "distributed" and "dp_distributed" live on beside the others'
    # clusters and local sessions
    ("doc_blocks", "scenario_examples", "never_wrong_shape_graph", "never_wrong_dtype_graph",
     "distributed", "dp_distributed"),
    # the processes that leave eager execution on (keras3 and the oneDNN checks build
    # their graphs in a tf.Graph of their own); not with the graph-mode group, whose
    # never_wrong_shape_graph meets TensorFlow's own wrong oneDNN filter gradients
    ("eager", "keras3", "convs_onednn", "zoo_speed_onednn"),
)
SHARED_GROUPS = GROUPS[:1]
# set in the environment of a group's run (tests/scripts/process_group.py): a member
# that would end its process with os._exit returns its exit code instead
IN_GROUP_ENV = "PERTOWER_PROCESS_GROUP"
_GROUP_SCRIPT = os.path.join(HERE, "scripts", "process_group.py")

# Rough CPU seconds of each process's checks after its TensorFlow start-up (the
# `cpu_seconds` of their reports, summed, or the `pertower-member-cost` lines of
# tests/scripts/process_group.py; on a loaded machine, so roughly; a fresh member's
# include the TensorFlow import of its group's run): `queue_order` starts
# the longest runs first. A process not listed counts as DEFAULT_COST.
COSTS = {
    "legacy": 30, "messages_joined_legacy": 13, "weight_functions_legacy": 10,
    "legacy_idioms": 7, "python_gradients_legacy": 8, "never_wrong_loops": 8,
    "unseen_legacy": 7, "tower_sizes": 6, "recurrent_v1": 6, "published_legacy": 5,
    "curvature_convs_legacy": 5, "recurrent_legacy": 4, "convs_legacy": 4,
    "dp_modes_legacy": 3, "curvature_legacy": 3, "never_wrong_shape_legacy": 2.5,
    "vgg_paths_legacy": 2, "never_wrong_dtype_legacy": 1, "zoo_speed_legacy": 3,
    "dp_distributed": 6, "never_wrong_shape_graph": 2.5, "never_wrong_dtype_graph": 0.4,
    "distributed": 1, "eager": 0.5, "keras3": 2, "convs_onednn": 6,
    "doc_blocks": 22, "scenario_examples": 6.5,
}
DEFAULT_COST = 5


def queue_order(names):
    """`names` in the order to start them (longest first, as two machines share jobs).

    Each group (its members among `names`) or process of no group is a run of the
    summed `COSTS` of its members. First the runs of one interpreter, the costliest
    first (the two test processes' queues take one each, then the next as they come
    free); then the groups of SHARED_GROUPS, whose members the two queues share out
    as they come free, their costliest members first, so that the short ones fill the
    end on both cores. The members of another group keep their order in `names`
    (tests/conftest.py queues them in the order of the tests that read them;
    `process_runner.Runner` starts the fresh ones first)."""
    cost = {name: COSTS.get(name, DEFAULT_COST) for name in names}
    group_of = {name: group for group in GROUPS for name in group}
    run = {name: group_of.get(name, (name,)) for name in names}
    totals, first = {}, {}   # each run's cost and first position in `names`
    for i, name in enumerate(names):
        totals[run[name]] = totals.get(run[name], 0) + cost[name]
        first.setdefault(run[name], i)

    def key(name):
        shared = run[name] in SHARED_GROUPS
        return (shared, -totals[run[name]], first[run[name]],
                -cost[name] if shared else 0, names.index(name))

    return sorted(names, key=key)


class Processes(process_runner.Runner):
    """The processes of `PROCESSES` (or of `processes`), each run at most once per
    session: see `process_runner.Runner` (`start`, `completed`, `assert_passed`, `stop`).

    Args:
      processes: name -> `_Command` (default `PROCESSES`; only then do the members of
        `GROUPS` run together).
      directory: the directory for the output files, shared by the test processes of one
        session; None for a private temporary one (removed by `stop`).
    """

    def __init__(self, processes=None, directory=None):
        default = processes is None
        super().__init__(PROCESSES if default else processes,
                         groups=GROUPS if default else (), group_script=_GROUP_SCRIPT,
                         directory=directory, shared=SHARED_GROUPS if default else ())
        self._default = default

    def start(self, *names):
        """`process_runner.Runner.start`, in the order of `queue_order` (for the
        default processes)."""
        super().start(*(queue_order(names) if self._default else names))


def run_checks(checks, title, heavy=()):
    """Runs each check; prints one `pertower-check` line each and a summary.

    Args:
      checks: a list of functions without arguments; a check fails by raising, and may
        return a string (reported as its output). The name reported is the function's
        `__name__`.
      title: the summary's words, e.g. "legacy checks".
      heavy: the names of the checks of `checks` that belong to the heavy run: they run
        only when the script's arguments include "heavy" (its `NAME_heavy` process of
        `PROCESSES`), and then only they; the others run without it.

    Returns:
      The exit code: 0 if every check passed, else 1.
    """
    if heavy:
        unknown = set(heavy) - {check.__name__ for check in checks}
        if unknown:
            raise ValueError(f"run_checks: `heavy` names no check of `checks`: {sorted(unknown)}")
        wanted = "heavy" in sys.argv[1:]
        checks = [check for check in checks if (check.__name__ in heavy) == wanted]
        title += " (heavy)" if wanted else ""
    failed = 0
    for check in checks:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            output = check()
            record = {"name": check.__name__, "ok": True, "message": "",
                      "output": output if isinstance(output, str) else ""}
        except Exception as error:  # pylint: disable=broad-except  # report all, then fail
            failed += 1
            record = {"name": check.__name__, "ok": False,
                      "message": f"{type(error).__name__}: {error}", "output": ""}
        # wall and CPU seconds (user+sys of every thread): the wall time depends on
        # the machine's load, the CPU time much less
        record["seconds"] = round(time.perf_counter() - start, 2)
        record["cpu_seconds"] = round(time.process_time() - cpu, 2)
        print(process_runner.CHECK_PREFIX + json.dumps(record), flush=True)
    print(f"{title}: {len(checks) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


def require_legacy_mode(control_flow_v1=False):
    """For the checks of the legacy scripts: raises AssertionError unless the process runs
    under `tf.compat.v1.disable_v2_behavior()` (reference variables, graph mode) and, with
    `control_flow_v1`, v1 control flow."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (conftest: no TF here)
    if tf.compat.v1.resource_variables_enabled() or tf.executing_eagerly():
        raise AssertionError("expected disable_v2_behavior(): reference variables, graph mode")
    if control_flow_v1 and tf.compat.v1.control_flow_v2_enabled():
        raise AssertionError("expected control flow v1")


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
