#!/usr/bin/env bash
# Third session, second call (2 GPUs), after the data-parallel forward stopped waiting on
# the host. GPU 1: the test suite (new: no host-device sync in a step). GPU 0: Llama-3.1-8B
# memory with Liger's kernels and cross-entropy. Then both GPUs: data-parallel speed against
# DDP and FSDP2 (bf16 state), and forge with int8 state.
set -uo pipefail
source benchmarks/gpu_env.sh
gpu_tests 1 290 &
cd benchmarks
(export CUDA_VISIBLE_DEVICES=0
 step grid_liger; timeout 200 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms forge_bf16,forge_int8,adamw_fused \
   --steps 10 --no-profile --liger --out $OUT/grid_llama8b_liger.json >> $LOG 2>&1)
step "wait for tests"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step "dp speed"; timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --arms forge_dp,ddp_fused_adamw,fsdp2_fused_adamw --models llama-3.1-8b,qwen3-1.7b --out $OUT/dp_speed.json >> $LOG 2>&1
step "dp int8"; timeout 90 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --arms forge_dp --state int8 --models llama-3.1-8b --out $OUT/dp_speed_int8.json >> $LOG 2>&1
step done
grep -v '^{' $LOG | grep -v Warning | grep -v "^ " | grep -v "Backend impl" | tail -20
grep -E "^FAILED|^ERROR" $OUT/gpu_pytest.log | head -20
