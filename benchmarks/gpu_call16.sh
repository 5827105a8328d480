#!/usr/bin/env bash
# Fourth session, third call (2 GPUs), after the grid's fix (a graphed arm's model was
# still referenced when the cell collected garbage, so later cells counted it).
# GPU 1: the test suite, then peak memory and profile, one arm per process.
# GPU 0: Llama-3.1-8B speed, eager and graphed, two rounds (forge with recompute_swiglu;
#   every arm with Liger's kernels but its cross-entropy, and forge_hf.causal_lm_loss).
set -uo pipefail
source benchmarks/gpu_env.sh
step install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $LOG 2>&1 \
  || echo "editable install failed: the console-script test will skip" >> $LOG
COMMON="--models llama-3.1-8b --cells 1x512 --liger --no-liger-ce --loss chunked --recompute-swiglu"
cd benchmarks
(export CUDA_VISIBLE_DEVICES=1; cd ..; gpu_tests 1 280; cd benchmarks
 for arm in forge_bf16 forge_int8 forge_bf16_graphed forge_int8_graphed; do
   step "memory $arm"; timeout 60 python3 run_grid.py $COMMON --steps 10 --arms $arm --out $OUT/memory_$arm.json >> $LOG 2>&1
 done) &
(export CUDA_VISIBLE_DEVICES=0
 step grid; timeout 300 python3 run_grid.py $COMMON --arms adamw_fused,forge_bf16,forge_bf16_graphed,adamw_fused_graphed,forge_int8_graphed \
   --steps 20 --rounds 2 --no-profile --out $OUT/grid_llama8b_graphed.json >> $LOG 2>&1)
step "wait"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step done
grep -v '^{' $LOG | grep -v Warning | grep -v "^ " | grep -v "Backend impl" | tail -30
grep -E "^FAILED|^ERROR|skipped|Error" $OUT/gpu_pytest.log | head -30
for f in $OUT/*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
for r in d['results']:
    print(sys.argv[1].split('/')[-1], r['arm'], r.get('round', ''), r['status'], r.get('step_ms'), r.get('peak_gib'), r.get('allocated_at_start_gib'), r.get('fused_kernel_ms'), r.get('gpu_busy_ms'), r.get('reason', '')[:400])
" $f; done
