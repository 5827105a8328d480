#!/usr/bin/env bash
# One call on a lent 2-GPU machine: the test suite with compiled kernels on GPU 1 while
# GPU 0 measures (kernel sweep, 8-bit kernels, Llama-3.1-8B grid cell, data-parallel code
# path at world size 1). At most 8 files come back: logs go to one file.
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader >> $LOG
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $LOG
if [ "${TESTS:-1}" = 1 ]; then
  (CUDA_VISIBLE_DEVICES=1 timeout ${T_TESTS:-540} python3 -m pytest -q -p no:cacheprovider ${TEST_PATHS:-tests} \
     > $OUT/gpu_pytest.log 2>&1; echo "pytest rc=$?" >> $OUT/gpu_pytest.log) &
fi
export CUDA_VISIBLE_DEVICES=0
cd benchmarks
if [ "${SWEEP:-1}" = 1 ]; then
  step sweep; timeout 240 python3 kernel_microbench.py --state bf16 --configs all --out $OUT/mb_bf16_sweep.json >> $LOG 2>&1
fi
for s in ${STATES:-int8 al8}; do
  step "microbench $s"; timeout 60 python3 kernel_microbench.py --state $s --configs default --out $OUT/mb_$s.json >> $LOG 2>&1
done
if [ -n "${GRID_ARMS:-adamw_fused,forge_bf16,forge_int8}" ]; then
  step grid; timeout ${T_GRID:-200} python3 run_grid.py --models ${GRID_MODELS:-llama-3.1-8b} --cells ${GRID_CELLS:-1x512} \
    --arms ${GRID_ARMS:-adamw_fused,forge_bf16,forge_int8} --out $OUT/grid.json >> $LOG 2>&1
fi
if [ "${WORLD1:-1}" = 1 ]; then
  step "world of one"; timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node 1 dp_bench.py --mode speed \
    --arms forge_plain,forge_dp,forge_plain,forge_dp --models qwen3-1.7b --out $OUT/dp_world1.json >> $LOG 2>&1
fi
step "waiting for tests"; wait; tail -3 $OUT/gpu_pytest.log >> $LOG 2>/dev/null
grep -v "^{" $LOG | tail -40
