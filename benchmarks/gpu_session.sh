#!/usr/bin/env bash
# One device call for the transfer engine: GPU tests, probes, benchmark. Logs under $OUT.
#   STEPS="tests bench baseline" benchmarks/gpu_session.sh
# baseline: the same benchmark on another checkout of the package (BASELINE_DIR, e.g. a
# `git archive <rev> tiercache` unpacked into an ignored folder), for before/after
# figures from one machine. pattern: the engine's pattern (benchmarks/engine_pattern.py) on
# BASELINE_DIR and on this tree, alternately, twice (engine.py copied into the baseline).
# profile: the call profile (benchmarks/engine_call_profile.py) of BASELINE_DIR and this
# tree, alternately, three times, pinned to one CPU. one-block: where a one-block load's
# time goes (benchmarks/one_block_probe.py). pattern-here: the engine's pattern on this tree, twice.
# matmul-sweep: the matmul beside staged copies per pack/unpack launch shape (benchmarks/matmul_sweep.py,
# SWEEP_ARGS). tail: where the slow calls of the pattern spend their time (benchmarks/call_tail_probe.py).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # packages the device image lacks (posix_ipc, test tools), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site || exit 1
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c 'import torch, triton, numpy; print(torch.__version__, torch.version.cuda, triton.__version__, numpy.__version__)' | tee -a "$OUT/machine.txt"
STEPS=${STEPS:-"tests probe bench"}
BENCH_ARGS=${BENCH_ARGS:-"--matmul --reps 7"}
BASELINE_ARGS=${BASELINE_ARGS:-"--page-kib 32 --backend auto staged ce --reps 7"}
for step in $STEPS; do
  case $step in
    tests) # the cluster tier's test modules import crc32c: skip them where it is not carried
      python3 -c 'import crc32c' 2>/dev/null || TEST_ARGS="${TEST_ARGS:-} --ignore=tests/tiers/test_cluster_object.py --ignore=tests/tiers/test_cluster_tier.py"
      # the lint and deploy checks hold no gpu test and import tools the device image lacks
      python3 -c 'import mypy' 2>/dev/null || TEST_ARGS="${TEST_ARGS:-} --ignore=tests/test_typing.py"
      python3 -c 'import kubernetes_validate' 2>/dev/null || TEST_ARGS="${TEST_ARGS:-} --ignore=tests/deploy"
      timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests ${TEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -15 ;;
    block-probe) timeout 150 python3 benchmarks/block_kernel_probe.py 2>&1 | tee "$OUT/block_probe.log" | tail -25 ;;
    probe) timeout 200 python3 benchmarks/transfer_probe.py 2>&1 | tee "$OUT/probe.log" | grep -v '^\[' ;;
    staged-probe) for mode in main ce both; do timeout 150 python3 benchmarks/staged_probe.py $mode 2>&1 | tee -a "$OUT/staged_probe.log" | grep RESULT; done ;;
    bench) timeout 400 python3 -m tiercache.tools.bench $BENCH_ARGS --json "$OUT/bench.json" 2>"$OUT/bench_progress.log" | tee "$OUT/bench.txt"; tail -3 "$OUT/bench_progress.log" ;;
    pattern)
      cp tiercache/tools/bench/engine.py "${BASELINE_DIR:-.baseline}/tiercache/tools/bench/engine.py"
      for r in 1 2; do
        for tree in "${BASELINE_DIR:-.baseline}" .; do
          echo "=== tree $tree round $r" | tee -a "$OUT/pattern.txt"
          PYTHONPATH=$tree:/tmp/site timeout 150 python3 benchmarks/engine_pattern.py 2>&1 | grep -v '^\[' | tee -a "$OUT/pattern.txt"
        done
      done ;;
    profile)
      for r in 1 2 3; do
        for tree in "${BASELINE_DIR:-.baseline}" .; do
          echo "=== tree $tree round $r, taskset -c 3" >> "$OUT/profile.txt"
          PYTHONPATH=$tree:/tmp/site taskset -c 3 timeout 100 python3 benchmarks/engine_call_profile.py 2>&1 | grep '^RESULT' >> "$OUT/profile.txt"
        done
      done ;;
    one-block) timeout 250 python3 benchmarks/one_block_probe.py --json "$OUT/one_block.json" 2>&1 | grep -v '^\[' | tee "$OUT/one_block.txt" ;;
    matmul-sweep) timeout 400 python3 benchmarks/matmul_sweep.py ${SWEEP_ARGS:-} --json "$OUT/matmul_sweep.json" 2>&1 | grep -v '^\[' | tee "$OUT/matmul_sweep.txt" ;;
    tail) timeout 300 python3 benchmarks/call_tail_probe.py --json "$OUT/call_tail.json" 2>&1 | grep -v '^\[' | tee "$OUT/call_tail.txt" ;;
    zero-copy) timeout 400 python3 benchmarks/zero_copy_probe.py ${ZERO_ARGS:-} --json "$OUT/zero_copy.json" 2>&1 | grep -v '^\[' | tee "$OUT/zero_copy.txt" ;;
    pattern-here) for r in 1 2; do timeout 150 python3 benchmarks/engine_pattern.py 2>&1 | grep -v '^\[' | tee -a "$OUT/pattern_here.txt"; done ;;
    baseline) (cd "${BASELINE_DIR:-.baseline}" && PYTHONPATH=. timeout 200 python3 -m tiercache.tools.bench $BASELINE_ARGS --json "$OUT/baseline.json" 2>"$OUT/baseline_progress.log" | tee "$OUT/baseline.txt") ;;
  esac
done
