#!/usr/bin/env bash
# (Its grid, printing and final checks were later moved into gpu_env.sh helpers, unchanged.)
# Sixth session, second call (2 GPUs). int8 codes without conversion instructions: the
# absmax codec rounds by adding 1.5 * 2**23 and stores the low byte of the float's bits;
# codes are decoded by adding their bits to that pattern. Prediction: the int8 kernel's
# I2F/F2I/FRND (6 per element, 1/8 of the FP32 rate: ~11 ms of issue at 7.5e9 elements)
# were most of its 12.7 ms over bf16, so int8 should come to about bf16's time.
# GPU 1: the whole test suite. GPU 0: kernel model sums (bf16, int8), then the step:
# forge graphed (bf16, int8) against torch fused AdamW eager, two rounds, one process.
set -uo pipefail
source benchmarks/gpu_env.sh
suite_on_gpu1
kernel_sums session6 bf16 int8
llama_step_grid $OUT/grid_llama8b_1x512_graphed_session6.json 2 260
cd ..
step "wait"; wait; finish
cat $OUT/kernel.txt
show_grid $OUT/grid_llama8b_1x512_graphed_session6.json
