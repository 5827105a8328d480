#!/usr/bin/env bash
# Sixth session, fourth call (2 GPUs). Call 29: the evict-first hints gained nothing
# (removed again); int8 metadata traffic costs 6.4 ms (no_meta 59.9 vs 66.3), of which the
# block-column layout (a tile's 64 scale words contiguous) recovered 3.2 ms. Now the kernel
# stores metadata that way and loads it, with the rule's constants and the rounding seed,
# before the token loop. Prediction: int8 about 60 ms (the no_meta ablation), bf16 a
# little faster (the constants' load latency left the epilogue).
# GPU 1: the whole test suite. GPU 0: kernel model sums (bf16, int8, int8 no_meta), the step.
set -uo pipefail
source benchmarks/gpu_env.sh
suite_on_gpu1
kernel_sums session6b bf16 int8
timeout 90 python3 kernel_microbench.py --state int8 --configs default --variant no_meta 2>&1 | tail -1 >> $OUT/kernel.txt
llama_step_grid $OUT/grid_llama8b_1x512_graphed_session6b.json 2 260
cd ..
step "wait"; wait; finish
cat $OUT/kernel.txt
show_grid $OUT/grid_llama8b_1x512_graphed_session6b.json
