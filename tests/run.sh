#!/usr/bin/env bash
# The test command: one pytest session per TensorFlow mode (see tests/conftest.py), side
# by side so that both cores stay busy until the end: tests/ (graph mode) on two
# pytest-xdist workers, tests/legacy/ and tests/eager/ in one process each. Each
# session's report is printed when it ends, the graph-mode one last; the exit code is 0
# only if every session passed. Arguments go to every session, e.g.
#   bash tests/run.sh -m heavy      (the long tests)
#   bash tests/run.sh -x -k dp      (stop at the first failure, tests named *dp*)
set -u
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
python -m pytest -q tests/legacy --durations=5 "$@" > "$logs/legacy" 2>&1 &
legacy=$!
python -m pytest -q tests/eager --durations=5 "$@" > "$logs/eager" 2>&1 &
eager=$!
python -m pytest -q tests -n 2 --dist loadfile --durations=10 "$@" > "$logs/graph" 2>&1 &
graph=$!
status=0
for session in legacy eager graph; do
  wait "${!session}"
  code=$?
  # pytest's exit code 5: no test selected in this session (e.g. by -k)
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then status=1; fi
  echo "======== tests/${session/graph/} ($session mode): exit code $code"
  cat "$logs/$session"
done
exit $status
