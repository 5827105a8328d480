#!/usr/bin/env bash
# Fourth session, second call (2 GPUs). Every run: Liger's RMSNorm/SwiGLU/RoPE kernels,
# forge_hf.causal_lm_loss (no fp32 copy of the logits, capturable) in every arm, forge
# arms with recompute_swiglu.
# GPU 0: small-model smoke of the graphed arms, then Llama-3.1-8B 1 x 512 speed: eager and
#   graphed forge against eager and graphed fused AdamW, two rounds.
# GPU 1: the test suite, then Llama-3.1-8B peak memory and profile of the forge arms.
set -uo pipefail
source benchmarks/gpu_env.sh
step install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $LOG 2>&1 \
  || echo "editable install failed: the console-script test will skip" >> $LOG
COMMON="--models llama-3.1-8b --cells 1x512 --liger --no-liger-ce --loss chunked --recompute-swiglu"
cd benchmarks
(export CUDA_VISIBLE_DEVICES=1; cd ..; gpu_tests 1 280; cd benchmarks
 step "memory and profile"; timeout 200 python3 run_grid.py $COMMON --steps 10 \
   --arms forge_bf16,forge_int8,forge_bf16_graphed,forge_int8_graphed --out $OUT/grid_llama8b_memory_profile.json >> $LOG 2>&1) &
(export CUDA_VISIBLE_DEVICES=0
 step "graph smoke"; timeout 100 python3 run_grid.py --models qwen3-0.6b --cells 1x512 --loss chunked \
   --arms forge_bf16_graphed,adamw_fused_graphed --steps 5 --warmup 3 --no-profile --out $OUT/graph_smoke.json >> $LOG 2>&1
 step grid; timeout 360 python3 run_grid.py $COMMON --arms adamw_fused,forge_bf16,forge_bf16_graphed,adamw_fused_graphed,forge_int8_graphed \
   --steps 20 --rounds 2 --no-profile --out $OUT/grid_llama8b_graphed.json >> $LOG 2>&1)
step "wait"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step done
grep -v '^{' $LOG | grep -v Warning | grep -v "^ " | grep -v "Backend impl" | tail -30
grep -E "^FAILED|^ERROR|skipped|Error" $OUT/gpu_pytest.log | head -30
for f in $OUT/*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
for r in d['results']:
    print(sys.argv[1].split('/')[-1], r.get('model'), r['arm'], r.get('round', ''), r['status'], r.get('step_ms'), r.get('peak_gib'), r.get('fused_kernel_ms'), r.get('gpu_busy_ms'), r.get('reason', '')[:400])
" $f; done
