#!/usr/bin/env bash
# Eighth session, third call (2 GPUs). (1) The Gluon kernel decodes 8-bit codes with one
# conversion (I2F.S8) instead of code_to_float's three instructions: -288 of 5712
# instructions (AdamW, int8); call 45's Nsight Compute had int8's time follow its
# instruction count at the same issue rate. Prediction: int8 kernel 50.3 -> ~48 ms.
# (2) The cross-entropy's backward keeps one fp32 block of rows alive, not three.
# Prediction: capture peaks 46.97 -> ~46.85 GiB (bf16), 33.93 -> ~33.80 (int8).
# GPU 1: the whole suite (same bits). GPU 0: capture_memory.py, the probe, the graphed step.
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl
suite_on_gpu1
for s in bf16 int8; do
  step "capture $s"; timeout 150 python3 capture_memory.py --state $s --out $OUT/capture_memory_llama8b_${s}_call47.json >> $OUT/capture_memory.txt 2>&1
done
step probe; timeout 240 python3 persistent_probe.py --out $OUT/persistent_probe_call47.json > $OUT/probe.txt 2>&1
llama_step_grid $OUT/grid_llama8b_1x512_graphed_persistent_call47.json 2 240
cd ..
step "wait"; wait
finish
for s in bf16 int8; do show_capture $OUT/capture_memory_llama8b_${s}_call47.json; done
tail -2 $OUT/probe.txt; grep -cE "'equal': 1.0" $OUT/probe.txt; grep -E "'equal': 0\.|Error|error" $OUT/probe.txt | head -5
show_grid $OUT/grid_llama8b_1x512_graphed_persistent_call47.json
