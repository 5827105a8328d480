#!/usr/bin/env bash
# Sixth session, last call (2 GPUs). Call 33 found the capture's extra 0.26 GiB: under
# capture, transformers 5.17 (the machine's) builds a 4-D causal mask (it treats stream
# capture as tracing), so SDPA takes the masked, repeat_kv path (expanded k and v kept for
# backward, 256 MB). transformers >= 5.18 skips the mask when there is no padding mask.
# Here with transformers 5.18 carried (.whl_tf). Prediction: capture peak ~46.98 GiB (bf16
# state, under 47) and ~33.9 (int8, under 34); step no slower (flash attention, is_causal).
# GPU 1: the whole test suite under 5.18. GPU 0: capture_memory.py, then the step grid.
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl
python3 -c "import transformers; print('transformers', transformers.__version__)" >> $LOG 2>&1 || { cat $LOG; exit 1; }
suite_on_gpu1
step capture; timeout 120 python3 capture_memory.py --state bf16 --out $OUT/capture_memory_llama8b_bf16_tf518.json > $OUT/capture_memory.txt 2>&1
llama_step_grid $OUT/grid_llama8b_1x512_graphed_tf518.json 2 200
cd ..
step "wait"; wait; finish
show_capture $OUT/capture_memory_llama8b_bf16_tf518.json
show_grid $OUT/grid_llama8b_1x512_graphed_tf518.json
