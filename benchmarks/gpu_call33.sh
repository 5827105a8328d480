#!/usr/bin/env bash
# Sixth session: what is alive at the graphed step's capture peak (0.27 GiB above the eager
# step's: 47.24 against 46.97 GiB, bf16 state), against the eager step (capture_memory.py).
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
step bf16; CUDA_VISIBLE_DEVICES=0 timeout 200 python3 capture_memory.py --state bf16 --out $OUT/capture_memory_llama8b_bf16.json > $OUT/capture_memory.txt 2>&1
step done
tail -80 $OUT/capture_memory.txt
