"""Run in a process of its own (servers live until the process ends), one TensorFlow
start-up for both: the default run's checks of tests/scripts/distributed_towers.py
(towers on the two tasks of a cluster) and of tests/scripts/dp_distributed_checks.py
(DP-SGD across a parameter server and two workers), each on servers of its own.

    python tests/scripts/clusters.py

run by tests/test_clusters.py (`tests.common.run_python`); prints one line per check
(`tests.scripts.run_each`) and exits 1 if one failed.
"""

import os

from tests import scripts
from tests.scripts import distributed_towers  # graph mode, on import
from tests.scripts import dp_distributed_checks


def main():
    code = scripts.run_each(distributed_towers.checks()
                            + dp_distributed_checks.default_checks())
    # Servers cannot be stopped cleanly in-process; leave without waiting for them.
    os._exit(code)  # pylint: disable=protected-access


if __name__ == "__main__":
    main()
