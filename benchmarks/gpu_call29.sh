#!/usr/bin/env bash
# Sixth session, third call (2 GPUs). Call 28 refuted "conversions are int8's extra cost"
# (66.5 -> 66.2 ms with none left). Where does int8 state lose its 12.6 ms to bf16?
# Ablations and candidates, model sums at 512 tokens, default tiles:
#  - no_meta: no metadata loads/stores (wrong results). Prediction: if the 64 scattered
#    4-byte scale words per tile and slot (a 32-byte sector each, partial writes) cost, this
#    is much faster, and meta_transposed (the same words, 256 contiguous bytes) recovers it.
#  - mainloop_only, no_epilogue_loads: as in call 21, for int8.
#  - the kernel now hints evict-first on the weight/state tiles (L2 keeps x and dy);
#    no_cache_hints measures that hint, bf16 and int8.
set -uo pipefail
source benchmarks/gpu_env.sh
install_forge
cd benchmarks
step variants
(for v in base no_cache_hints no_meta meta_transposed; do kernel_variant 0 int8 $v; done) &
(for v in base no_cache_hints; do kernel_variant 1 bf16 $v; done; for v in mainloop_only no_epilogue_loads; do kernel_variant 1 int8 $v; done) &
wait
step done
cat $OUT/variants_0.txt $OUT/variants_1.txt
