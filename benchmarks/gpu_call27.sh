#!/usr/bin/env bash
# Runs at commit a2f1119 (the subtiles experiment, reverted in the commit after it).
# Sixth session, first call (2 GPUs): programs that own several tiles (subtiles), so the
# token loop's x and dy loads serve two or four tiles. Prediction: the main loop is bound
# by L2 -> SM traffic (64 x 64 tiles re-read x and dy 128 KB a tile, ~240 GB a step; main
# loop alone 28.6 ms ~ 8 TB/s), so sharing one operand (1x2, 2x1) cuts it by a quarter
# and 2x2 by half, if the extra live accumulator does not cost more than it saves.
# GPU 0: bf16 state sweep; GPU 1: int8 state sweep, then the subtile tests.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
CONFIGS="64,64,64,4,4,1,1,168;64,64,64,4,4,1,2,168;64,64,64,4,4,1,2,232;64,64,64,4,4,2,1,232;64,64,64,4,4,2,1,168;\
64,64,64,4,3,1,2,232;64,64,32,4,4,1,2,232;64,64,64,8,4,2,2,0;64,64,64,8,3,2,2,0;64,64,64,8,4,2,2,128;64,64,64,4,4,2,2,255"
step sweeps
(CUDA_VISIBLE_DEVICES=0 timeout 400 python3 kernel_microbench.py --configs "$CONFIGS" --out $OUT/kernel_sweep_subtiles_bf16.json > $OUT/sweep_bf16.txt 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 400 python3 kernel_microbench.py --state int8 --configs "$CONFIGS" --out $OUT/kernel_sweep_subtiles_int8.json > $OUT/sweep_int8.txt 2>&1
 cd .. && CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_subtiles.py > $OUT/subtile_tests.txt 2>&1) &
wait
step done
tail -3 $OUT/subtile_tests.txt
for p in bf16 int8; do echo "== $p"; grep -E "model total|Error|error" $OUT/sweep_$p.txt | head -5
python3 -c "
import json, collections
d=json.load(open('$OUT/kernel_sweep_subtiles_$p.json')); tot=collections.Counter()
for r in d['rows']:
    for c, v in r['timings_ms'].items(): tot[c] += (v if v else 1e9) * r['count']
for c, v in sorted(tot.items(), key=lambda kv: kv[1]): print(f'{v:9.1f} ms  {c}')
"; done
