#!/usr/bin/env bash
# Third session, extra call (2 GPUs, ~4 min): token counts exchanged once per backward
# instead of once per fused forward. The host-sync tests, parity against one process, then
# speed against DDP with per-phase times.
set -uo pipefail
source benchmarks/gpu_env.sh
step "host-sync tests"; CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_host_sync.py >> $LOG 2>&1
cd benchmarks
step "dp parity"; timeout 70 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode parity \
  --out $OUT/dp_parity.json >> $LOG 2>&1
step "dp speed"; timeout 110 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --arms forge_dp,ddp_fused_adamw --models llama-3.1-8b --out $OUT/dp_speed.json >> $LOG 2>&1
step done
grep -E "passed|failed|^===" $LOG
python3 -c "
import json; d=json.load(open('$OUT/dp_parity.json')); print('parity', d['replicas_identical'], d['fused']['equal_frac'], d['dp_loss'][-1], d['single_loss'][-1])
d=json.load(open('$OUT/dp_speed.json'))
for r in d['results']:
    print(r['arm'], r.get('step_ms'), r.get('peak_gib_max'), [{k: round(v, 1) for k, v in p.get('phases_ms', {}).items()} for p in r['per_rank']])
"
