#!/usr/bin/env bash
# Fourth session, last call (2 GPUs), final code. Data parallel after this session's
# changes (the fused forward's Function is applied through forge_apply): parity against
# one process, then speed and per-rank peak of forge_dp against DDP and FSDP2 (fused AdamW)
# for Qwen3-1.7B and Llama-3.1-8B in one run. Then the whole test suite on one GPU.
set -uo pipefail
source benchmarks/gpu_env.sh
step install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $LOG 2>&1 \
  || echo "editable install failed: the console-script test will skip" >> $LOG
cd benchmarks
step "dp parity"; timeout 70 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode parity \
  --out $OUT/dp_parity.json >> $LOG 2>&1
step "dp speed"; timeout 170 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --arms forge_dp,ddp_fused_adamw,fsdp2_fused_adamw --models qwen3-1.7b,llama-3.1-8b --out $OUT/dp_speed.json >> $LOG 2>&1
cd ..; step tests; gpu_tests 1 230; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step done
grep -E "passed|failed|^===" $LOG
grep -E "^FAILED|^ERROR|skipped" $OUT/gpu_pytest.log | head -20
python3 -c "
import json; d=json.load(open('$OUT/dp_parity.json')); print('parity', d['replicas_identical'], d['fused']['equal_frac'], d['dp_loss'][-1], d['single_loss'][-1])
d=json.load(open('$OUT/dp_speed.json'))
for r in d['results']:
    print(r.get('model'), r['arm'], r.get('status'), r.get('step_ms'), r.get('peak_gib_max'))
"
