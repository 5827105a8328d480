#!/usr/bin/env bash
# Fifth session, first call (2 GPUs): the data-parallel step captured as one CUDA graph
# (GraphedStep with enable_data_parallel). The two-GPU test, then speed and per-rank peak
# of forge_dp_graphed against eager forge_dp, DDP and FSDP2 (fused AdamW), bf16 state; then
# the forge arms with int8 state.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
step "two-GPU graphed test"; CUDA_VISIBLE_DEVICES=0,1 timeout 130 python3 -m pytest -q -p no:cacheprovider \
  tests/test_distributed.py -k graphed > $OUT/gpu_pytest_dp_graphed.txt 2>&1; tail -3 $OUT/gpu_pytest_dp_graphed.txt >> $LOG
cd benchmarks
step "dp speed bf16"; run_dp 250 --arms forge_dp_graphed,forge_dp,ddp_fused_adamw,fsdp2_fused_adamw \
  --models qwen3-1.7b,llama-3.1-8b --out $OUT/dp_speed_graphed.json
step "dp speed int8"; run_dp 130 --state int8 --arms forge_dp_graphed,forge_dp --models qwen3-1.7b,llama-3.1-8b \
  --out $OUT/dp_speed_graphed_int8.json
step done
cd ..
grep -E "passed|failed|^===" $LOG
show_dp dp_speed_graphed dp_speed_graphed_int8
