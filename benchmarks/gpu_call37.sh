#!/usr/bin/env bash
# Seventh session: the Gluon kernel with one MMA in flight, TMA stores, three consumers.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
step probe; timeout 500 python3 persistent_probe.py --out $OUT/persistent_probe_call37.json \
  --configs "2,3,232,40,168,1,0;2,3,232,40,168,1,1;2,4,232,40,168,1,1;3,2,160,24,128,1,1;3,3,160,24,128,1,1;3,3,160,24,128,1,0" > $OUT/probe.txt 2>&1
echo "probe rc=$?" >> $OUT/probe.txt
grep -v "^{'shape'" $OUT/probe.txt | cut -c1-400 | tail -40
