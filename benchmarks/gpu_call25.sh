#!/usr/bin/env bash
# Fifth session, control for data-parallel parity (2 GPUs, Qwen3-0.6B shape, 2 ranks x 1 x 512
# against one process at 2 x 512, 5 steps): how far torch's fused AdamW under DDP drifts
# from one process, next to forge (eager under DDP, and graphed), fp32 and bf16 weights.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
par() { timeout 75 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode parity "$@" >> $LOG 2>&1; }
step "adamw fp32"; par --optimizer adamw --weights fp32 --out $OUT/dp2_parity_control_adamw_fp32.json
step "forge fp32"; par --weights fp32 --out $OUT/dp2_parity_forge_fp32.json
step "forge fp32 graphed"; par --weights fp32 --graphed --out $OUT/dp2_parity_forge_fp32_graphed.json
step "adamw bf16"; par --optimizer adamw --weights bf16 --out $OUT/dp2_parity_control_adamw_bf16.json
step done
grep -E "^===" $LOG
for f in $OUT/dp2_*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
g=lambda s: {k: (round(v, 8) if isinstance(v, float) else v) for k, v in s.items() if k in ('equal_frac','max_rel','over_1ulp_frac','max_abs')}
print(sys.argv[1].split('/')[-1], d['replicas_identical'], 'linear', g(d['fused']), 'other', g(d['nonfused']), d['dp_loss'][-1], d['single_loss'][-1])
" $f; done
