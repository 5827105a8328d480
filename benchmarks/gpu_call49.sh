#!/usr/bin/env bash
# Eighth session, last call (2 GPUs). Eager fused AdamW's step varied 121.8-173.1 ms over
# calls 47-48 (forge's graphed step 87-90): four more rounds of the graphed Llama-3.1-8B
# step with nothing else running on the machine, then the two-GPU test on the final code
# (the suite ran in call 47 on the same package code; only benchmarks/ changed since).
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl
install_forge
cd benchmarks
CUDA_VISIBLE_DEVICES=0 llama_step_grid $OUT/grid_llama8b_1x512_graphed_persistent_call49.json 4 300
cd ..
step two-gpu; CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k graphed > $OUT/gpu_pytest.log 2>&1
echo "two-gpu rc=$?" >> $OUT/gpu_pytest.log
step done; grep -E "^===" $LOG; tail -2 $OUT/gpu_pytest.log
show_grid $OUT/grid_llama8b_1x512_graphed_persistent_call49.json
