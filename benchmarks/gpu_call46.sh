#!/usr/bin/env bash
# Eighth session, second call (2 GPUs): two sets of epilogue buffers a lane where shared
# memory allows (int8 AdamW: 224 KB with the ring of 5), the copies out released during the
# next block's main loop and the next inputs copied in after its first chunk. Call 45's
# Nsight Compute: the consumers spend ~9% of their time waiting for copies out and ~5% for
# the epilogue's inputs. Prediction: int8 kernel 50.3 -> ~45 ms, below bf16's 47.7; bf16
# with a ring of 4 and two sets against 5 and one: measured, not predicted.
# GPU 1: the whole suite (same bits as the Triton kernel with one set and with two).
# GPU 0: the probe (bits and times of both depths, both states), then the graphed step.
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl
suite_on_gpu1
step probe; timeout 240 python3 persistent_probe.py --out $OUT/persistent_probe_call46.json > $OUT/probe.txt 2>&1
grep -q "model sums" $OUT/probe.txt && llama_step_grid $OUT/grid_llama8b_1x512_graphed_persistent_call46.json 2 240
cd ..
step "wait"; wait
finish
tail -3 $OUT/probe.txt; grep -cE "'equal': 1.0" $OUT/probe.txt; grep -E "'equal': 0\.|Error|error" $OUT/probe.txt | head -5
show_grid $OUT/grid_llama8b_1x512_graphed_persistent_call46.json
