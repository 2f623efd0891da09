#!/usr/bin/env bash
# The cluster tier's benchmark (benchmarks/cluster_tier_bench.py: a mooncake_master on loopback,
# two nodes in one process, Mooncake's own batch put/get as the ceiling) on a host with no
# internet and Python 3.12 (the GPU machine's host). Run from the repo root:
#
#   carry [".whl", ".debs"], command: bash benchmarks/device_cluster_bench.sh
#   (RUNS=3 BLOCKS=512 BENCH_ARGS="..." override; results under $OUT)
#
# What it expects in the repo root (both ignored by git, made on the development VM):
#   .whl/   wheels for cp312 (pip download --no-deps --only-binary=:all: --python-version 3.12
#           --platform manylinux_2_28_x86_64 ...):
#             mooncake_transfer_engine_non_cuda-0.3.13.post1-cp312-cp312-manylinux_2_28_x86_64.whl
#             crc32c-2.9.post0-cp312-...whl, posix_ipc-1.3.2-cp312-...whl
#           (numpy, psutil and prometheus_client are on the host already)
#   .debs/  Debian 12 (bookworm) .deb files (`apt-get download`), the shared libraries
#           Mooncake's store.so and mooncake_master link (even over TCP), from `ldd` on the
#           VM, less libc6, libgcc-s1 and libstdc++6; 7.8 MiB:
#             libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 libnghttp2-14
#             libidn2-0 libunistring2 librtmp1 libssh2-1 libpsl5 libssl3 libgssapi-krb5-2
#             libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 libldap-2.5-0
#             libsasl2-2 libgnutls30 libgmp10 libhogweed6 libnettle8 libp11-kit0 libtasn1-6
#             libffi8 libbrotli1 libzstd1 zlib1g
#
# The .debs are unpacked with `dpkg -x` into /tmp/debroot, never into /. A library the host
# has is used from the host (its own build of it, for its own glibc); only the sonames the
# host lacks are linked into /tmp/debroot/use, which goes on LD_LIBRARY_PATH (DEBS_ALL=1 puts
# every unpacked lib dir there instead). Wheels go to /tmp/site (pip --target, no index).
set -uo pipefail
export PYTHONUNBUFFERED=1 GLOG_minloglevel=2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUNS=${RUNS:-3}
BLOCKS=${BLOCKS:-512}
BENCH_ARGS=${BENCH_ARGS:-}
PY=${PYTHON:-python3}
log() { echo "device_cluster_bench: $*" | tee -a "$OUT/machine.txt"; }

{ echo "== $(date -u +%FT%TZ)"; $PY --version; nproc; lscpu | grep -E 'Model name|^L3|NUMA node\(s\)';
  free -g | head -2; df -h /dev/shm | tail -1; cat /etc/os-release 2>/dev/null | head -2; } \
  >"$OUT/machine.txt" 2>&1
for d in .whl .debs; do
  [ -d "$d" ] || { log "no $d/ in $(pwd): carry it (see this script's header)"; exit 2; }
done

# --- Debian libraries, unpacked aside ------------------------------------------------------
rm -rf /tmp/debroot && mkdir -p /tmp/debroot/use
for f in .debs/*.deb; do dpkg -x "$f" /tmp/debroot || { log "dpkg -x $f failed"; exit 2; }; done
# the sonames the .debs hold (libfoo.so.N: the names the loader looks for)
sonames=$(find /tmp/debroot -path /tmp/debroot/use -prune -o -regextype posix-extended \
  -regex '.*/[^/]+\.so\.[0-9]+' \( -type f -o -type l \) -print | sort)
if [ "${DEBS_ALL:-0}" = 1 ]; then
  LIBPATH=$(for lib in $sonames; do dirname "$lib"; done | sort -u | paste -sd:)
else
  system=$(ldconfig -p 2>/dev/null | awk '{print $1}' | sort -u)
  for lib in $sonames; do
    name=$(basename "$lib")
    grep -qx "$name" <<<"$system" || [ -e "/tmp/debroot/use/$name" ] || ln -s "$lib" "/tmp/debroot/use/$name"
  done
  LIBPATH=/tmp/debroot/use
  log "from .debs (the host lacks them): $(ls /tmp/debroot/use | tr '\n' ' ')"
fi
export LD_LIBRARY_PATH=$LIBPATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# --- wheels ----------------------------------------------------------------------------------
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  || { log "pip install of .whl/ failed"; exit 2; }
export PYTHONPATH=.:/tmp/site

# --- does Mooncake load? ---------------------------------------------------------------------
MC=/tmp/site/mooncake
chmod +x "$MC/mooncake_master" 2>/dev/null
export MOONCAKE_MASTER=$MC/mooncake_master
missing() { ldd "$1" | grep 'not found' | sed "s|^|  $(basename "$1"): |"; }
if ! "$MOONCAKE_MASTER" --version >>"$OUT/machine.txt" 2>&1; then
  log "mooncake_master does not run; its missing libraries:"; missing "$MOONCAKE_MASTER" | tee -a "$OUT/machine.txt"
  exit 3
fi
if ! $PY -c 'from mooncake.store import MooncakeDistributedStore' >>"$OUT/machine.txt" 2>&1; then
  log "mooncake.store does not import; missing libraries:"
  for so in "$MC"/store.so "$MC"/engine.so; do missing "$so"; done | tee -a "$OUT/machine.txt"
  exit 3
fi
$PY -c 'import tiercache, crc32c, posix_ipc, numpy; print("tiercache", tiercache.__file__, "numpy", numpy.__version__)' \
  >>"$OUT/machine.txt" 2>&1 || { log "tiercache's imports fail"; tail -5 "$OUT/machine.txt"; exit 3; }
log "Mooncake loads; $RUNS run(s) of the bench, --blocks $BLOCKS $BENCH_ARGS"

# --- the bench, $RUNS times (each the best of 3 rounds) --------------------------------------
rc=0
for i in $(seq 1 "$RUNS"); do
  echo "== run $i" >>"$OUT/bench.txt"
  timeout 170 $PY benchmarks/cluster_tier_bench.py --blocks "$BLOCKS" $BENCH_ARGS \
      --json "$OUT/cluster_tier_host_$i.json" >>"$OUT/bench.txt" 2>>"$OUT/bench_progress.log" \
    || { rc=$?; log "run $i failed (exit $rc); last lines:"; tail -5 "$OUT/bench_progress.log"; }
done
cat "$OUT/bench.txt"
exit $rc
