#!/usr/bin/env bash
# Fifth session, second call (2 GPUs). GPU 1: the whole test suite. Both GPUs: parity of the
# graphed data-parallel step on the Qwen3-0.6B shape. GPU 0 (after the parity run): where
# the fused kernel's time goes - ablations and candidates of kernel_variants.py and register
# caps, model sum over Llama-3.1-8B's linears at 512 tokens; then Nsight Compute's warp
# states for gate/up_proj.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
(gpu_tests 1 300) &
TESTS=$!
cd benchmarks
step "graphed dp parity"; timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py \
  --mode parity --graphed --out $OUT/dp_parity_graphed.json >> $LOG 2>&1
bench() { CUDA_VISIBLE_DEVICES=0 timeout 60 python3 kernel_microbench.py --configs default "$@" 2>&1 | tail -1 >> $OUT/variants.txt; }
step variants
for v in base no_stats no_epilogue_loads mainloop_only rule_reciprocal; do echo -n "bf16 $v: " >> $OUT/variants.txt; bench --variant $v; done
for r in 128 168; do echo -n "bf16 maxnreg $r: " >> $OUT/variants.txt; bench --maxnreg $r; done
for v in base int8_reciprocal_encode; do echo -n "int8 $v: " >> $OUT/variants.txt; bench --state int8 --variant $v; done
echo -n "int8 maxnreg 168: " >> $OUT/variants.txt; bench --state int8 --maxnreg 168
step ncu; CUDA_VISIBLE_DEVICES=0 timeout 80 ncu --clock-control none --kernel-name regex:fused_update --launch-skip 3 \
  --launch-count 1 --section WarpStateStats --section Occupancy --section LaunchStats --section SpeedOfLight \
  python3 profile_kernel.py > $OUT/ncu_warp_states.txt 2>&1
cd ..
wait $TESTS
step done
grep -E "passed|failed|^===" $LOG; tail -2 $OUT/gpu_pytest.log
grep -E "^FAILED|^ERROR" $OUT/gpu_pytest.log | head -10
cat $OUT/variants.txt
python3 -c "
import json; d=json.load(open('$OUT/dp_parity_graphed.json')); print('parity', d['replicas_identical'], d['fused']['equal_frac'], d['fused']['over_1ulp_frac'], d['dp_loss'], d['single_loss'])"
grep -E "Stall|Warp Cycles|Registers|Achieved Occupancy|Duration|Issued" $OUT/ncu_warp_states.txt | head -20
