#!/usr/bin/env bash
# The test command: one pytest session per TensorFlow mode (see tests/conftest.py), one
# after the other: tests/ (graph mode) and tests/legacy/ on two pytest-xdist workers,
# then tests/eager/ in one process. (Side by side, their TensorFlow thread pools
# oversubscribe the two cores: slower with oneDNN off.) Every session runs; the exit
# code is 0 only if each passed. Arguments go to every session, e.g.
#   bash tests/run.sh -m heavy      (the long tests)
#   bash tests/run.sh -x -k dp      (stop at the first failure, tests named *dp*)
set -u
cd "$(dirname "$0")/.."
status=0
run() {
  # -p no:benchmark: no test uses pytest-benchmark; its plugin would load in every process
  python -m pytest -q -p no:benchmark "$@"
  code=$?
  # pytest's exit code 5: no test selected in this session (e.g. by -k)
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then status=1; fi
}
run tests -n 2 --dist loadfile --durations=10 "$@"
run tests/legacy -n 2 --dist loadfile --durations=5 "$@"
run tests/eager --durations=5 "$@"
exit $status
