#!/usr/bin/env bash
# Seventh session, last call: the persistent kernel with int8 state too. GPU 1: the
# whole suite (int8 and bf16: same bits as the Triton kernel). GPU 0: the probe (bf16 and
# int8, ablations), then the graphed Llama-3.1-8B step against fused AdamW; the two-GPU test.
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl
install_forge
(gpu_tests 1 330) &
cd benchmarks
export CUDA_VISIBLE_DEVICES=0
step probe; timeout 150 python3 persistent_probe.py --out $OUT/persistent_probe_call44.json > $OUT/probe.txt 2>&1
llama_step_grid $OUT/grid_llama8b_1x512_graphed_persistent.json 2 240
cd ..
step "wait"; wait
step two-gpu; CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k graphed >> $OUT/gpu_pytest.log 2>&1
echo "two-gpu rc=$?" >> $OUT/gpu_pytest.log
finish
tail -4 $OUT/probe.txt
show_grid $OUT/grid_llama8b_1x512_graphed_persistent.json
