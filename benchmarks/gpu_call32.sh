#!/usr/bin/env bash
# Sixth session, last call (2 GPUs): the kernel as committed (8-bit codes, metadata, the
# rule's constants loaded before the token loop; block-column metadata; int8 codes without
# conversions). GPU 1: the whole test suite. GPU 0: kernel model sums (bf16, int8, al8),
# then forge graphed (bf16, int8) against torch fused AdamW eager, three rounds in one
# process. Then the two-GPU data-parallel test on both GPUs.
set -uo pipefail
source benchmarks/gpu_env.sh
step install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $LOG 2>&1
(gpu_tests 1 330) &
cd benchmarks
export CUDA_VISIBLE_DEVICES=0
step kernel
for p in bf16 int8 al8; do
  timeout 90 python3 kernel_microbench.py --state $p --configs default --out $OUT/kernel_microbench_llama8b_${p}_session6_final.json 2>&1 | tail -1 >> $OUT/kernel.txt
done
step grid; timeout 300 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --liger --no-liger-ce --loss chunked \
  --recompute-swiglu --arms adamw_fused,forge_bf16_graphed,forge_int8_graphed --steps 20 --rounds 3 \
  --no-profile --out $OUT/grid_llama8b_1x512_graphed_session6_final.json >> $LOG 2>&1
cd ..
step "wait"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log | tail -3 >> $LOG
step dp_test; CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k graphed > $OUT/dp_test.log 2>&1
tail -2 $OUT/dp_test.log >> $LOG
step done
grep -E "^===|passed|failed" $LOG
grep -E "^FAILED|^ERROR" $OUT/gpu_pytest.log | head -10
cat $OUT/kernel.txt
python3 -c "
import json
d=json.load(open('$OUT/grid_llama8b_1x512_graphed_session6_final.json'))
for r in d['results']: print(r['arm'], r.get('round', ''), r['status'], r.get('step_ms'), r.get('peak_gib'), r.get('reason', '')[:300])
"
