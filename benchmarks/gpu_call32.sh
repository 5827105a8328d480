#!/usr/bin/env bash
# Sixth session, last call (2 GPUs): the kernel as committed (8-bit codes, metadata, the
# rule's constants loaded before the token loop; block-column metadata; int8 codes without
# conversions). GPU 1: the whole test suite. GPU 0: kernel model sums (bf16, int8, al8),
# then forge graphed (bf16, int8) against torch fused AdamW eager, three rounds in one
# process. Then the two-GPU data-parallel test on both GPUs.
set -uo pipefail
source benchmarks/gpu_env.sh
suite_on_gpu1
kernel_sums session6_final bf16 int8 al8
llama_step_grid $OUT/grid_llama8b_1x512_graphed_session6_final.json 3 300
cd ..
step "wait"; wait
step dp_test; CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k graphed > $OUT/dp_test.log 2>&1
tail -2 $OUT/dp_test.log >> $LOG
finish
cat $OUT/kernel.txt
show_grid $OUT/grid_llama8b_1x512_graphed_session6_final.json
