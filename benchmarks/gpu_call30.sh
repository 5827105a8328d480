#!/usr/bin/env bash
# Sixth session, fourth call (2 GPUs). Call 29: the evict-first hints gained nothing
# (removed again); int8 metadata traffic costs 6.4 ms (no_meta 59.9 vs 66.3), of which the
# block-column layout (a tile's 64 scale words contiguous) recovered 3.2 ms. Now the kernel
# stores metadata that way and loads it, with the rule's constants and the rounding seed,
# before the token loop. Prediction: int8 about 60 ms (the no_meta ablation), bf16 a
# little faster (the constants' load latency left the epilogue).
# GPU 1: the whole test suite. GPU 0: kernel model sums (bf16, int8, int8 no_meta), the step.
set -uo pipefail
source benchmarks/gpu_env.sh
step install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $LOG 2>&1
(gpu_tests 1 330) &
cd benchmarks
export CUDA_VISIBLE_DEVICES=0
step kernel
for p in bf16 int8; do
  timeout 90 python3 kernel_microbench.py --state $p --configs default --out $OUT/kernel_microbench_llama8b_${p}_session6b.json 2>&1 | tail -1 >> $OUT/kernel.txt
done
timeout 90 python3 kernel_microbench.py --state int8 --configs default --variant no_meta 2>&1 | tail -1 >> $OUT/kernel.txt
step grid; timeout 260 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --liger --no-liger-ce --loss chunked \
  --recompute-swiglu --arms adamw_fused,forge_bf16_graphed,forge_int8_graphed --steps 20 --rounds 2 \
  --no-profile --out $OUT/grid_llama8b_1x512_graphed_session6b.json >> $LOG 2>&1
cd ..
step "wait"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log | tail -3 >> $LOG
step done
grep -E "^===|passed|failed" $LOG
grep -E "^FAILED|^ERROR" $OUT/gpu_pytest.log | head -10
cat $OUT/kernel.txt
python3 -c "
import json
d=json.load(open('$OUT/grid_llama8b_1x512_graphed_session6b.json'))
for r in d['results']: print(r['arm'], r.get('round', ''), r['status'], r.get('step_ms'), r.get('peak_gib'), r.get('reason', '')[:300])
"
