#!/bin/bash
# before (the base commit 9c8e87e, git archive into /tmp/trust_base) and after (trust) alternating, same VM, same session
for i in 1 2 3; do
  echo "=== before $i $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd /tmp/trust_base && PYTHONPATH=/tmp/trust_base timeout 900 /work/main/.venv/bin/python scripts/cluster_tier_bench.py --blocks 32 --json /tmp/trust_bench/before_$i.json 2>/tmp/trust_bench/before_$i.err)
  echo "=== after $i $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd /work/wt-trust && PYTHONPATH=/work/wt-trust timeout 900 /work/main/.venv/bin/python scripts/cluster_tier_bench.py --blocks 32 --json /tmp/trust_bench/after_$i.json 2>/tmp/trust_bench/after_$i.err)
done
echo "=== end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
