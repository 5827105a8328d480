#!/usr/bin/env bash
# Third session, third call (2 GPUs): data parallel after the token gather became one packed
# collective and the updated rows moved to a communicator of their own. Parity against one
# process (Qwen3-0.6B shape), then speed against DDP, profiled per rank.
set -uo pipefail
source benchmarks/gpu_env.sh
cd benchmarks
step "dp parity"; timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode parity \
  --out $OUT/dp_parity.json >> $LOG 2>&1
step "dp speed"; timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --arms forge_dp,ddp_fused_adamw --models llama-3.1-8b,qwen3-1.7b --profile --out $OUT/dp_speed.json >> $LOG 2>&1
step done
grep -v '^{' $LOG | grep -v Warning | grep -v "^ " | grep -v "Backend impl" | tail -20
