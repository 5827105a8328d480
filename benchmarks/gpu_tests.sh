#!/usr/bin/env bash
# On the lent GPU: install the carried wheels, run the test suite with compiled kernels,
# then the kernel microbenchmark. Results land in $OUT.
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee $OUT/gpu_pytest.log | tail -25
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/kernel_microbench.py --out $OUT/kernel_microbench.json 2>&1 | tee $OUT/microbench.log
fi
