#!/usr/bin/env bash
# Fifth session, third call (2 GPUs), after call 21's findings: relaxed statistics atomics,
# a 168-register cap (three programs per multiprocessor), int8 codes by the block's
# reciprocal. GPU 1: the whole test suite. GPU 0: the kernel's model sum (bf16 and int8
# state), the remaining cost of the statistics, a few tile configs under the cap; then
# forge graphed (bf16, int8) against torch fused AdamW eager and graphed, two rounds.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
(export CUDA_VISIBLE_DEVICES=1; gpu_tests 1 300) &
cd benchmarks
export CUDA_VISIBLE_DEVICES=0
bench() { echo -n "$1: " >> $OUT/variants.txt; timeout 70 python3 kernel_microbench.py "${@:2}" 2>&1 | tail -1 >> $OUT/variants.txt; }
step kernel
bench "bf16 default" --configs default --out $OUT/kernel_microbench_llama8b_bf16.json
bench "int8 default" --state int8 --configs default --out $OUT/kernel_microbench_llama8b_int8.json
bench "bf16 no_stats" --configs default --variant no_stats
bench "bf16 sweep cap 168" --configs "64,64,64,4,3;64,64,32,4,4;64,128,64,4,3;128,64,64,8,3" --out $OUT/kernel_sweep_cap168.json
bench "bf16 64x64x64/4/3 cap 128" --configs "64,64,64,4,3" --maxnreg 128
step grid; timeout 250 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --liger --no-liger-ce --loss chunked \
  --recompute-swiglu --arms adamw_fused,forge_bf16_graphed,forge_int8_graphed,adamw_fused_graphed --steps 20 --rounds 2 \
  --no-profile --out $OUT/grid_llama8b_1x512_graphed_session5.json >> $LOG 2>&1
cd ..
step "wait"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step done
grep -E "^===|passed|failed" $LOG
grep -E "^FAILED|^ERROR" $OUT/gpu_pytest.log | head -10
cat $OUT/variants.txt
python3 -c "
import json; d=json.load(open('$OUT/kernel_sweep_cap168.json'))
for r in d['rows']: print(r['shape'], {k: round(v, 3) for k, v in r['timings_ms'].items() if v})
d=json.load(open('$OUT/grid_llama8b_1x512_graphed_session5.json'))
for r in d['results']: print(r['arm'], r.get('round', ''), r['status'], r.get('step_ms'), r.get('peak_gib'), r.get('reason', '')[:300])
"
