#!/usr/bin/env bash
# Seventh session, last call: the persistent kernel with int8 state too. GPU 1: the
# whole suite (int8 and bf16: same bits as the Triton kernel). GPU 0: the probe (bf16 and
# int8, ablations), then the graphed Llama-3.1-8B step against fused AdamW; the two-GPU test.
set -uo pipefail
source benchmarks/gpu_env.sh
suite_probe_step 44
