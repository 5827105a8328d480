#!/usr/bin/env bash
# Final call (2 GPUs). GPU 1: the test suite, then Qwen3-14B / 32B capability cells.
# GPU 0: host overhead, kernel step time per state precision, the Llama-3.1-8B grid.
set -uo pipefail
source benchmarks/gpu_env.sh
(export CUDA_VISIBLE_DEVICES=1
 timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests > $OUT/gpu1.log 2>&1; echo "pytest rc=$?" >> $OUT/gpu1.log
 cd benchmarks && timeout 270 python3 run_grid.py --models qwen3-14b,qwen3-32b --cells 1x512 --arms forge_int8,adamw_fused,forge_bf16 \
   --steps 5 --warmup 2 --no-profile --out $OUT/grid_qwen3.json >> $OUT/gpu1.log 2>&1) &
export CUDA_VISIBLE_DEVICES=0
cd benchmarks
step host; timeout 70 python3 host_overhead.py >> $LOG 2>&1
for s in bf16 int8 al8; do step "microbench $s"; timeout 40 python3 kernel_microbench.py --state $s --configs default --out $OUT/mb_$s.json >> $LOG 2>&1; done
step grid1; timeout 150 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms adamw_fused,forge_bf16,forge_int8 \
  --steps 10 --out $OUT/grid_llama8b.json >> $LOG 2>&1
step grid2; timeout 150 python3 run_grid.py --models llama-3.1-8b --cells 4x512,1x2048 --arms adamw_fused,forge_bf16 \
  --steps 10 --no-profile --out $OUT/grid_llama8b_cells.json >> $LOG 2>&1
step wait; wait; grep -E "passed|failed|rc=" $OUT/gpu1.log >> $LOG
grep -v '^{' $LOG | grep -v Warning | grep -A8 "us per call"; grep -v '^{' $LOG | grep -v Warning | tail -22
