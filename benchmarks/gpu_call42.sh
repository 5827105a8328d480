#!/usr/bin/env bash
# Seventh session: the TMA copies out waited for at the next tile instead of at once.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
n=0
for cfg in "2,5,1,232,40,168,0,0,1,4,1" "2,5,1,232,40,168,0"; do
  n=$((n+1)); step "probe $cfg"
  timeout 150 python3 persistent_probe.py --out $OUT/persistent_probe_call42_$n.json --configs "$cfg" > $OUT/probe_$n.txt 2>&1
  echo "probe $cfg rc=$?" >> $OUT/probe_$n.txt
  grep -v "^{'shape'" $OUT/probe_$n.txt | sed "s/'equal': 1.0, 'max_ulp': 0, 'max_abs': 0.0/same/g" | cut -c1-250 | tail -6
done
