#!/usr/bin/env bash
# Fourth session, fourth call (2 GPUs), after aligning the argument table's rows.
# GPU 1: the whole test suite.
# GPU 0: where a graphed step's peak is set (warm-up, capture, replay), one arm per
#   process; then forge graphed against eager fused AdamW, three rounds.
set -uo pipefail
source benchmarks/gpu_env.sh
step install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $LOG 2>&1 \
  || echo "editable install failed: the console-script test will skip" >> $LOG
COMMON="--models llama-3.1-8b --cells 1x512 --liger --no-liger-ce --loss chunked --recompute-swiglu"
(export CUDA_VISIBLE_DEVICES=1; gpu_tests 1 280) &
cd benchmarks
(export CUDA_VISIBLE_DEVICES=0
 for arm in forge_bf16_graphed forge_int8_graphed; do
   step "memory $arm"; timeout 60 python3 run_grid.py $COMMON --steps 10 --no-profile --arms $arm --out $OUT/memory_$arm.json >> $LOG 2>&1
 done
 step grid; timeout 150 python3 run_grid.py $COMMON --arms adamw_fused,forge_bf16_graphed \
   --steps 20 --rounds 3 --no-profile --out $OUT/grid_llama8b_graphed_three_rounds.json >> $LOG 2>&1)
step "wait"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step done
grep -v '^{' $LOG | grep -v Warning | grep -v "^ " | grep -v "Backend impl" | tail -30
grep -E "^FAILED|^ERROR|skipped|Error" $OUT/gpu_pytest.log | head -30
for f in $OUT/*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
for r in d['results']:
    print(sys.argv[1].split('/')[-1], r['arm'], r.get('round', ''), r['status'], r.get('step_ms'), r.get('peak_gib'), r.get('allocated_at_start_gib'), {k: round(v, 3) for k, v in r.get('memory_phases_gib', {}).items()}, r.get('reason', '')[:400])
" $f; done
