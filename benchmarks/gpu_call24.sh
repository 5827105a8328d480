#!/usr/bin/env bash
# Fifth session, last call (one H200): the grid's other cells with the final kernel and the
# graphed arms - Llama-3.1-8B at 4 x 512 and 1 x 2048, Qwen3-14B at 1 x 512 - forge graphed
# (bf16, int8 state) against torch fused AdamW eager and graphed, in one process per model.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
OPTS="--liger --no-liger-ce --loss chunked --recompute-swiglu --steps 10 --warmup 3 --no-profile"
step "llama cells"; timeout 230 python3 run_grid.py --models llama-3.1-8b --cells 4x512,1x2048 $OPTS \
  --arms adamw_fused,forge_bf16_graphed,forge_int8_graphed,adamw_fused_graphed \
  --out $OUT/grid_llama8b_4x512_1x2048_graphed.json >> $LOG 2>&1
step "qwen3-14b"; timeout 150 python3 run_grid.py --models qwen3-14b --cells 1x512 $OPTS \
  --arms adamw_fused,forge_bf16_graphed,forge_int8_graphed --out $OUT/grid_qwen3_14b_graphed.json >> $LOG 2>&1
step done
grep -E "^===" $LOG
for f in $OUT/grid_*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
for r in d['results']:
    print(r['model'], r['batch'], r['seq'], r['arm'], r['status'], r.get('step_ms'), r.get('peak_gib'), r.get('reason', '')[:200])
" $f; done
