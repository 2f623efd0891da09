#!/usr/bin/env bash
# One device call for the byte path's host time (issues 20 and 21): GPU tests, the engine
# pattern before (.after: a checkout of the previous tree) and after (this tree),
# alternating, and the call profile of .baseline against .after, alternating, pinned to
# one CPU; the bench on this tree (STEPS picks). Logs under $OUT. Carry: .whl .baseline .after
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; lscpu | head -25
  grep PRETTY /etc/os-release; ldconfig -p | grep -E "libcurl|libnuma|libibverbs" || echo "no curl/numa/ibverbs"
  python3 -c 'import torch, numpy; print(torch.__version__, numpy.__version__)'; } > "$OUT/machine.txt" 2>&1
PATTERN_STEPS=${PATTERN_STEPS:-30}
if [[ " ${STEPS:-tests pattern profile} " == *" tests "* ]]; then
  # the cluster tier's tests need Mooncake and crc32c, which the device image lacks
  PYTHONPATH=.:/tmp/site timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider \
    --ignore=tests/tiers/test_cluster_object.py --ignore=tests/tiers/test_cluster_tier.py ${TEST_ARGS:-tests} > "$OUT/tests.log" 2>&1
  tail -5 "$OUT/tests.log"
fi
if [[ " ${STEPS:-tests pattern profile} " == *" pattern "* ]]; then
  cp tiercache/tools/bench/engine.py .after/tiercache/tools/bench/engine.py
  for r in 1 2; do
    for tree in .after .; do
      echo "=== tree $tree round $r" | tee -a "$OUT/pattern.txt"
      PYTHONPATH=$tree:/tmp/site timeout 150 python3 scripts/engine_pattern.py --steps $PATTERN_STEPS 2>&1 | grep -v "^\[" | tee -a "$OUT/pattern.txt"
    done
  done
fi
if [[ " ${STEPS:-tests pattern profile} " == *" bench "* ]]; then
  PYTHONPATH=.:/tmp/site timeout 300 python3 -m tiercache.tools.bench ${BENCH_ARGS:---backend auto --page-kib 16 32 64 --reps 5} \
    --json "$OUT/bench.json" 2>"$OUT/bench_progress.log" | tee "$OUT/bench.txt"
fi
if [[ " ${STEPS:-tests pattern profile} " == *" profile "* ]]; then
  for r in 1 2 3; do
    echo "=== before (.baseline) round $r, taskset -c 3" >> "$OUT/profile.txt"
    (cd .baseline && PYTHONPATH=.:/tmp/site taskset -c 3 timeout 100 python3 engine_call_profile_old.py 2>&1 | grep "^RESULT") >> "$OUT/profile.txt"
    echo "=== after (.after) round $r, taskset -c 3" >> "$OUT/profile.txt"
    PYTHONPATH=.after:/tmp/site taskset -c 3 timeout 100 python3 .after/scripts/engine_call_profile.py 2>&1 | grep "^RESULT" >> "$OUT/profile.txt"
  done
  grep -c RESULT "$OUT/profile.txt"
fi
