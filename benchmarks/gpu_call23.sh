#!/usr/bin/env bash
# Fifth session, fourth call (2 GPUs), final kernel (relaxed statistics atomics, 168-register
# cap, int8 codes by the block's reciprocal). Both GPUs: the two-GPU graphed test, then
# data-parallel speed and per-rank peak (forge_dp_graphed bf16 and int8 state, DDP, FSDP2).
# Then GPU 1: the whole test suite; GPU 0: tile configs for int8 state under the cap.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
step "two-GPU graphed test"; CUDA_VISIBLE_DEVICES=0,1 timeout 100 python3 -m pytest -q -p no:cacheprovider \
  tests/test_distributed.py -k graphed > $OUT/gpu_pytest_dp_graphed.txt 2>&1; tail -1 $OUT/gpu_pytest_dp_graphed.txt >> $LOG
cd benchmarks
step "dp speed bf16"; run_dp 200 --arms forge_dp_graphed,ddp_fused_adamw,fsdp2_fused_adamw \
  --models qwen3-1.7b,llama-3.1-8b --out $OUT/dp2_speed_graphed_final.json
step "dp speed int8"; run_dp 90 --state int8 --arms forge_dp_graphed --models qwen3-1.7b,llama-3.1-8b \
  --out $OUT/dp2_speed_graphed_int8_final.json
cd ..
(export CUDA_VISIBLE_DEVICES=1; gpu_tests 1 280) &
cd benchmarks
step "int8 configs"; CUDA_VISIBLE_DEVICES=0 timeout 120 python3 kernel_microbench.py --state int8 \
  --configs "64,64,64,4,4;64,64,64,4,3;32,64,64,4,4;64,64,32,4,4;64,128,64,8,3;128,64,64,8,3" \
  --out $OUT/kernel_sweep_int8_cap168.json 2>&1 | tail -1 >> $LOG
cd ..
step "wait"; wait; grep -E "passed|failed|rc=" $OUT/gpu_pytest.log >> $LOG
step done
grep -E "^===|passed|failed|model total" $LOG
grep -E "^FAILED|^ERROR" $OUT/gpu_pytest.log | head -10
show_dp dp2_speed_graphed_final dp2_speed_graphed_int8_final
python3 - <<PY
import json
d = json.load(open("$OUT/kernel_sweep_int8_cap168.json"))
for r in d["rows"]: print(r["shape"], {k: round(v, 3) for k, v in r["timings_ms"].items() if v})
PY
