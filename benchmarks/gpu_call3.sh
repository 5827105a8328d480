#!/usr/bin/env bash
# Third call (2 GPUs): data-parallel parity with fp32 weights and bf16 state; then the test
# suite on GPU 1 while GPU 0 measures host overhead, a kernel sweep and three grid arms.
set -uo pipefail
source benchmarks/gpu_env.sh
step parity
timeout 100 python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/dp_bench.py --mode parity \
  --weights fp32 --state bf16 --out $OUT/dp_parity_fp32w.json >> $LOG 2>&1
(CUDA_VISIBLE_DEVICES=1 timeout 360 python3 -m pytest -q -p no:cacheprovider -n 4 tests > $OUT/gpu_pytest.log 2>&1; \
  echo "pytest rc=$?" >> $OUT/gpu_pytest.log) &
export CUDA_VISIBLE_DEVICES=0
cd benchmarks
step host; timeout 90 python3 host_overhead.py > $OUT/host_overhead.txt 2>&1
step sweep; timeout 90 python3 kernel_microbench.py --state bf16 --configs all --out $OUT/mb_bf16_sweep.json >> $LOG 2>&1
step grid; timeout 150 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms adamw_foreach,grad_release_fused,forge_fp32 \
  --steps 10 --out $OUT/grid_more_arms.json >> $LOG 2>&1
step wait; wait; tail -3 $OUT/gpu_pytest.log >> $LOG
grep -v '^{' $LOG | grep -v Warning | tail -25; head -12 $OUT/host_overhead.txt
