#!/usr/bin/env bash
# Fifth session, last call (2 GPUs): fp32-weight parity with the core tests' criterion (the
# share of each tensor within 1e-5 of its largest weight), forge eager and graphed and the
# torch fused AdamW + DDP control; Qwen3-0.6B shape, 2 ranks x 1 x 512 against 1 x 2 x 512.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
par() { timeout 60 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode parity --weights fp32 "$@" >> $LOG 2>&1; }
step "forge graphed"; par --graphed --out $OUT/dp2_parity_forge_fp32_graphed_core.json
step "adamw"; par --optimizer adamw --out $OUT/dp2_parity_control_adamw_fp32_core.json
step "forge"; par --out $OUT/dp2_parity_forge_fp32_core.json
step done
for f in $OUT/dp2_*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print(sys.argv[1].split('/')[-1], d['replicas_identical'], [(k, d[k]['within_core_frac'], d[k]['worst_within_core'], d[k]['max_rel']) for k in ('fused', 'nonfused')])
" $f; done
