#!/usr/bin/env bash
# Sixth session: int8 state's capture peak in a process of its own (call 34's grid counted
# 0.19 GiB that earlier cells left allocated), transformers 5.18 carried.
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl
install_forge
cd benchmarks
step capture; timeout 100 python3 capture_memory.py --state int8 --out $OUT/capture_memory_llama8b_int8_tf518.json > $OUT/capture_memory.txt 2>&1
show_capture $OUT/capture_memory_llama8b_int8_tf518.json
