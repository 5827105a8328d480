#!/usr/bin/env bash
# Seventh session: the persistent Gluon kernel taken by every eligible layer. GPU 1: the
# whole suite (the new tests: same bits as the Triton kernel, all rules). GPU 0: the kernel
# probe with ablations, then the graphed Llama-3.1-8B step against fused AdamW. Then the
# two-GPU test.
set -uo pipefail
source benchmarks/gpu_env.sh
suite_probe_step 43
