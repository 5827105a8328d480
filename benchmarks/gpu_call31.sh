#!/usr/bin/env bash
# Sixth session, fifth call (2 GPUs). The epilogue's tile loads are its largest exposed
# latency (no_epilogue_loads: -16 ms). Loading them before the token loop was 2-5% slower
# for bf16 in the second session (live registers); int8 codes are a quarter of bf16's
# bytes, and offline the compiled int8 kernel with prefetched codes has no fp32 layout
# conversions left (BAR 37 -> 25, 3096 -> 2936 instructions). Prediction: prefetch_codes
# takes int8 below 55 ms; prefetch_all decides bf16 again.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
step variants
(for v in base prefetch_codes prefetch_all; do kernel_variant 0 int8 $v; done) &
(for v in base prefetch_all; do kernel_variant 1 bf16 $v; done; kernel_variant 1 int8 prefetch_codes) &
wait
step done
cat $OUT/variants_0.txt $OUT/variants_1.txt
