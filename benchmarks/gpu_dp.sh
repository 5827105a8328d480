#!/usr/bin/env bash
# Issue 10 on a lent 2-GPU machine: data-parallel FORGE parity against one process, then
# step time / peak memory against DDP and FSDP2 with fused AdamW. Results land in $OUT.
#   PARITY_ARGS / SPEED_ARGS: extra flags, e.g. PARITY_ARGS="--rounding nearest"
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
else
  export PYTHONPATH=$PWD:$PWD/benchmarks
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
NPROC=${NPROC:-2}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
timeout ${T_PARITY:-150} python3 -m torch.distributed.run --standalone --nproc_per_node $NPROC benchmarks/dp_bench.py --mode parity \
  --out $OUT/dp_parity.json ${PARITY_ARGS:-} > $OUT/dp_parity.log 2>&1
echo "parity rc=$?"; tail -c 3000 $OUT/dp_parity.log
timeout ${T_SPEED:-300} python3 -m torch.distributed.run --standalone --nproc_per_node $NPROC benchmarks/dp_bench.py --mode speed \
  --models ${MODELS:-qwen3-1.7b,llama-3.1-8b} --out $OUT/dp_speed.json ${SPEED_ARGS:-} > $OUT/dp_speed.log 2>&1
echo "speed rc=$?"; grep '^{"model"' $OUT/dp_speed.log | cut -c1-400; grep -v '^{"model"' $OUT/dp_speed.log | tail -8 | cut -c1-600
