#!/usr/bin/env bash
# Third session, fourth call (2 GPUs): where the data-parallel step's time goes. Llama-3.1-8B
# shape, forward / backward / optimizer timed apart (host and GPU), forge_dp as it is, with
# no count exchange in forward, and with no token gather at all (ablations), and DDP.
set -uo pipefail
source benchmarks/gpu_env.sh
cd benchmarks
run() { timeout 110 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed \
  --models llama-3.1-8b --out $OUT/dp_$1.json --ablate "${@:2}" >> $LOG 2>&1; }
step "as is"; run as_is none --arms forge_dp,ddp_fused_adamw
step "no_announce"; run no_announce no_announce --arms forge_dp
step "local_tokens"; run local_tokens local_tokens --arms forge_dp
step done
for f in $OUT/dp_*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
for r in d['results']:
    print(sys.argv[1].split('/')[-1], r['arm'], r.get('step_ms'), [{k: round(v, 1) for k, v in p.get('phases_ms', {}).items()} for p in r['per_rank']])
" $f; done
