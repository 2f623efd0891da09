#!/usr/bin/env bash
# One device call for the transfer engine: GPU tests, probe, benchmark. Logs under $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c 'import torch, triton, numpy; print(torch.__version__, torch.version.cuda, triton.__version__, numpy.__version__)' | tee -a "$OUT/machine.txt"
STEPS=${STEPS:-"tests probe bench"}
for step in $STEPS; do
  case $step in
    tests) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backends_gpu.py ${TEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    probe) timeout 200 python3 scripts/transfer_probe.py 2>&1 | tee "$OUT/probe.log" | grep -v '^\[' ;;
    bench) timeout 400 python3 -m tiercache.bench ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>"$OUT/bench_progress.log" | tee "$OUT/bench.txt"; tail -3 "$OUT/bench_progress.log" ;;
  esac
done
