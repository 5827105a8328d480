#!/usr/bin/env bash
# Seventh session: epilogue tiles copied in once the ring is first full; CUDA-graph timing.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
step probe; timeout 500 python3 persistent_probe.py --out $OUT/persistent_probe_call39.json \
  --configs "2,5,1,232,40,168,0;2,5,1,232,40,168,1;2,4,1,232,40,168,1;3,3,1,160,24,128,1;2,2,2,232,40,168,1" > $OUT/probe.txt 2>&1
echo "probe rc=$?" >> $OUT/probe.txt
grep -v "^{'shape'" $OUT/probe.txt | sed "s/'equal': 1.0, 'max_ulp': 0, 'max_abs': 0.0/same/g" | cut -c1-300 | tail -30
