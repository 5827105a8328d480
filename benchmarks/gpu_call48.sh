#!/usr/bin/env bash
# Eighth session, fourth call (1 GPU). (1) run_grid.py frees cuBLAS's per-stream workspaces
# before each arm (call 47: arms started with 0.06-0.19 GiB left by earlier arms). Prediction:
# every forge arm's peak as in a process of its own (bf16 ~46.97 GiB, int8 ~33.93 in both
# rounds). (2) Where int8's step loses the ~0.5-2 ms its faster kernel gains: the rule step
# of the non-fused embedding (Triton kernel), bf16 against int8, a few tile shapes.
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl
install_forge
cd benchmarks
step "rule step"; timeout 150 python3 rule_step_probe.py --out $OUT/rule_step_probe_call48.json > $OUT/rule_step.txt 2>&1
llama_step_grid $OUT/grid_llama8b_1x512_graphed_persistent_call48.json 2 240
cd ..
step done; grep -E "^===" $LOG; cat $OUT/rule_step.txt | tail -14
show_grid $OUT/grid_llama8b_1x512_graphed_persistent_call48.json
python3 -c "
import json
for r in json.load(open('$OUT/grid_llama8b_1x512_graphed_persistent_call48.json'))['results']: print(r['arm'], r['round'], r.get('allocated_at_start_gib'))"
