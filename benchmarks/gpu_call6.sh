#!/usr/bin/env bash
# Last call: the whole test suite with compiled kernels, split over the two GPUs.
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu_pytest.log
timeout 230 python3 -m pytest -q -p no:cacheprovider -n 6 tests >> $OUT/gpu_pytest.log 2>&1; echo "pytest rc=$?" >> $OUT/gpu_pytest.log
grep -E "^(FAILED|ERROR)|passed|failed|rc=" $OUT/gpu_pytest.log
