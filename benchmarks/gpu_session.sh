#!/usr/bin/env bash
# One lent-GPU session, most important first; every result lands in $OUT as it is made:
#   1. the core test files with compiled kernels   2. Llama-3.1-8B grid cell (issue 6)
#   3. kernel microbenchmarks, bf16 vs 8-bit state (issue 5)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
timeout ${T_TESTS:-100} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests} > $OUT/gpu_pytest.txt 2>&1; tail -4 $OUT/gpu_pytest.txt
cd benchmarks
timeout ${T_GRID:-110} python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms ${ARMS:-forge_bf16,adamw_fused,forge_int8} \
  --out $OUT/grid_llama8b.json > $OUT/grid_llama8b.log 2>&1; tail -3 $OUT/grid_llama8b.log | cut -c1-600
for s in ${STATES:-bf16 int8 al8}; do
  timeout 25 python3 kernel_microbench.py --state $s --configs first --out $OUT/mb_$s.json 2>&1 | tail -1
done
