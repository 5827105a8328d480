#!/usr/bin/env bash
# Fourth session, first call (2 GPUs).
# GPU 0: Llama-3.1-8B 1 x 512, the whole step as one CUDA graph (forge bf16 / int8 with
#   GraphedStep, torch fused AdamW capturable) against the eager arms, two rounds; forge
#   arms with recompute_swiglu. A small-model smoke run first.
# GPU 1: the whole test suite, then peak memory with Liger (eager; and graphed without
#   Liger's cross-entropy, which a graph cannot capture) and recompute_swiglu.
set -uo pipefail
source benchmarks/gpu_env.sh
step install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $LOG 2>&1 \
  || echo "editable install failed: the console-script test will skip" >> $LOG
cd benchmarks
(export CUDA_VISIBLE_DEVICES=1; cd ..; gpu_tests 1 300; cd benchmarks
 step "memory liger"; timeout 110 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms forge_bf16,forge_int8 \
   --liger --recompute-swiglu --steps 10 --no-profile --out $OUT/grid_llama8b_liger_swiglu.json >> $LOG 2>&1
 step "graphed liger no ce"; timeout 110 python3 run_grid.py --models llama-3.1-8b --cells 1x512 \
   --arms forge_bf16_graphed,forge_int8_graphed --liger --no-liger-ce --recompute-swiglu --steps 10 --no-profile \
   --out $OUT/grid_llama8b_graphed_liger_no_ce.json >> $LOG 2>&1) &
(export CUDA_VISIBLE_DEVICES=0
 step "graph smoke"; timeout 100 python3 run_grid.py --models qwen3-0.6b --cells 1x512 \
   --arms forge_bf16_graphed,adamw_fused_graphed --steps 5 --warmup 3 --no-profile --out $OUT/graph_smoke.json >> $LOG 2>&1
 step grid; timeout 330 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --recompute-swiglu \
   --arms adamw_fused,forge_bf16,forge_bf16_graphed,adamw_fused_graphed,forge_int8_graphed \
   --steps 20 --rounds 2 --no-profile --out $OUT/grid_llama8b_graphed.json >> $LOG 2>&1)
step "wait"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step done
grep -v '^{' $LOG | grep -v Warning | grep -v "^ " | tail -30
grep -E "^FAILED|^ERROR|skipped|Error" $OUT/gpu_pytest.log | head -30
for f in $OUT/*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
for r in d['results']:
    print(sys.argv[1].split('/')[-1], r.get('model'), r['arm'], r.get('round', ''), r['status'], r.get('step_ms'), r.get('peak_gib'), r.get('memory_phases_gib', {}).get('peak_first_backward'), r.get('reason', '')[:300])
" $f; done
