#!/usr/bin/env bash
# Third session, last call (2 GPUs), final code. The package installed (editable) so the
# console-script test runs too; GPU 1: the test suite. GPU 0: Llama-3.1-8B, forge bf16
# against fused AdamW, two rounds. Then both GPUs: data-parallel speed against DDP and
# FSDP2 (bf16 state), and forge with int8 state.
set -uo pipefail
source benchmarks/gpu_env.sh
step install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $LOG 2>&1 \
  || echo "editable install failed: the console-script test will skip" >> $LOG
gpu_tests 1 260 &
cd benchmarks
(export CUDA_VISIBLE_DEVICES=0
 step grid; timeout 200 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --arms forge_bf16,adamw_fused \
   --steps 20 --rounds 2 --no-profile --out $OUT/grid_llama8b_rounds.json >> $LOG 2>&1)
step "wait for tests"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step "dp speed"; timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --arms forge_dp,ddp_fused_adamw,fsdp2_fused_adamw --models llama-3.1-8b,qwen3-1.7b --out $OUT/dp_speed.json >> $LOG 2>&1
step "dp int8"; timeout 80 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --arms forge_dp --state int8 --models llama-3.1-8b --out $OUT/dp_speed_int8.json >> $LOG 2>&1
step done
grep -v '^{' $LOG | grep -v Warning | grep -v "^ " | grep -v "Backend impl" | tail -20
grep -E "^FAILED|^ERROR|skipped" $OUT/gpu_pytest.log | head -20
for f in $OUT/*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
for r in d['results']:
    print(sys.argv[1].split('/')[-1], r.get('model'), r['arm'], r.get('round', ''), r['status'], r.get('step_ms'), r.get('peak_gib', r.get('peak_gib_max')))
" $f; done
