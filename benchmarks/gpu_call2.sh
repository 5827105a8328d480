#!/usr/bin/env bash
# Second call (2 GPUs): issue 10's runs on both GPUs, then on GPU 0 the kernel sweep, an
# Nsight Compute profile of the fused kernel, and a profiled Llama-3.1-8B forge step.
set -uo pipefail
source benchmarks/gpu_env.sh
step parity
timeout 110 python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/dp_bench.py --mode parity \
  --out $OUT/dp_parity.json >> $LOG 2>&1
step speed
timeout 230 python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/dp_bench.py --mode speed \
  --models qwen3-1.7b,llama-3.1-8b --out $OUT/dp_speed.json >> $LOG 2>&1
export CUDA_VISIBLE_DEVICES=0
cd benchmarks
step sweep; timeout 120 python3 kernel_microbench.py --state bf16 --configs all --out $OUT/mb_bf16_sweep.json >> $LOG 2>&1
step ncu; timeout 50 ncu --kernel-name regex:fused_update --launch-skip 3 --launch-count 1 --section SpeedOfLight \
  --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis python3 profile_kernel.py > $OUT/ncu.txt 2>&1
step grid; timeout 80 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms forge_bf16 --steps 10 \
  --out $OUT/grid_profile.json >> $LOG 2>&1
step done
grep -v '^{' $LOG | grep -v Warning | tail -30
