#!/usr/bin/env bash
# `make test`'s runner: the main suite on parallel workers (pytest-xdist), each engine suite
# (in its own venv) at the same time beside it, then the tests marked `serial` alone.
#   scripts/run_tests.sh MAIN_PYTHON WORKERS [PYTHON:TEST_DIR:WORKERS ...]
# e.g. scripts/run_tests.sh .venv/bin/python 4 .venv-vllm/bin/python:tests/vllm:2
#
# Beside, not after: the engine suites wait on engine processes importing vLLM, which the
# main suite's workers fill (docs/benchmarks.md, "The test suite's wall time").
# `serial` last and alone: those tests run `tiercache clean` without a name, which removes
# every stale region on the machine, also one that a test beside it SIGKILLed a
# coordinator to inspect (tests/conftest.py skips them on xdist workers).
# The main suite's output comes as it runs, each engine suite's once it ended (whole, so
# that it reads as one run); the exit status is 1 if any run failed.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 MAIN_PYTHON WORKERS [PYTHON:TEST_DIR:WORKERS ...]" >&2
  exit 2
fi
main_python=$1 workers=$2
shift 2
logs=$(mktemp -d "${TMPDIR:-/tmp}/tiercache-tests.XXXXXX")
trap 'rm -rf "$logs"' EXIT
pids=() suites=()
for suite in "$@"; do
  IFS=: read -r python path n <<<"$suite"
  "$python" -m pytest -q -n "$n" "$path" >"$logs/${#pids[@]}.log" 2>&1 &
  pids+=("$!")
  suites+=("$path ($python, $n workers)")
done
status=0
echo "=== the main suite ($main_python, $workers workers)${suites:+; beside it: ${suites[*]}} ==="
"$main_python" -m pytest -q -n "$workers" -m "not serial" || status=1
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  echo "=== ${suites[$i]}, run beside the main suite ==="
  cat "$logs/$i.log"
done
echo "=== the tests marked serial, alone ($main_python) ==="
"$main_python" -m pytest -q -m serial || status=1
exit $status
