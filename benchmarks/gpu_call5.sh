#!/usr/bin/env bash
# Final call (2 GPUs), after the direct-launch change. GPU 1: the test suite. GPU 0: host
# overhead, the Llama-3.1-8B cell with and without activation checkpointing. Then both
# GPUs: data-parallel speed against DDP.
set -uo pipefail
source benchmarks/gpu_env.sh
(CUDA_VISIBLE_DEVICES=1 timeout 230 python3 -m pytest -q -p no:cacheprovider -n 4 tests > $OUT/gpu1.log 2>&1
 echo "pytest rc=$?" >> $OUT/gpu1.log) &
cd benchmarks
(export CUDA_VISIBLE_DEVICES=0
 step host; timeout 60 python3 host_overhead.py >> $LOG 2>&1
 step grid; timeout 100 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms adamw_fused,forge_bf16,forge_int8 \
   --steps 10 --out $OUT/grid_llama8b.json >> $LOG 2>&1
 step checkpointing; timeout 90 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms forge_bf16,forge_int8,adamw_fused \
   --steps 10 --no-profile --checkpointing --out $OUT/grid_llama8b_ckpt.json >> $LOG 2>&1)
step "wait for tests"; wait; grep -E "passed|failed|rc=" $OUT/gpu1.log >> $LOG
step "dp speed"; timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --arms forge_dp,ddp_fused_adamw --models qwen3-1.7b,llama-3.1-8b --out $OUT/dp_speed.json >> $LOG 2>&1
step done
grep -v '^{' $LOG | grep -v Warning | grep -A8 "us per call"; grep -v '^{' $LOG | grep -v Warning | grep -v "^ " | tail -14
