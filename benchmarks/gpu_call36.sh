#!/usr/bin/env bash
# Seventh session: first run of the persistent warp-specialised Gluon kernel (bf16 state):
# agreement with the Triton kernel, then model sums per config.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
step probe; timeout 420 python3 persistent_probe.py --out $OUT/persistent_probe_call36.json > $OUT/probe.txt 2>&1
echo "probe rc=$?" >> $OUT/probe.txt
tail -c 6000 $OUT/probe.txt
