#!/usr/bin/env bash
# Third session, first call (2 GPUs). GPU 1: the test suite with one GPU visible. GPU 0:
# Llama-3.1-8B memory with Liger's RMSNorm/SwiGLU/RoPE. Then both GPUs: data-parallel
# step profiled per rank, sharded and replicated, against DDP.
set -uo pipefail
source benchmarks/gpu_env.sh
gpu_tests 1 290 &
cd benchmarks
(export CUDA_VISIBLE_DEVICES=0
 step grid_liger; timeout 200 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms forge_bf16,forge_int8,adamw_fused \
   --steps 10 --no-profile --liger --out $OUT/grid_llama8b_liger.json >> $LOG 2>&1)
step "wait for tests"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step "dp profile"; timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --arms forge_dp,forge_dp_replicated,ddp_fused_adamw --models llama-3.1-8b --profile --out $OUT/dp_profile.json >> $LOG 2>&1
step done
grep -v '^{' $LOG | grep -v Warning | grep -v "^ " | tail -20
grep -E "^FAILED|^ERROR" $OUT/gpu_pytest.log | head -20
