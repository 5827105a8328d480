#!/usr/bin/env bash
# Eighth session, first call (2 GPUs). GPU 1: the whole suite. GPU 0: the capture's peak
# with causal_lm_loss keeping the cache under capture (seventh session's fix; prediction:
# 46.98 / 33.93 GiB as in call 34), then Nsight Compute on the persistent kernel (gate/up
# shape, bf16 and int8 state): where its warps stall, per SASS instruction, and how busy
# L2 and DRAM are. Then the two-GPU test.
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl
suite_on_gpu1
for s in bf16 int8; do
  step "capture $s"; timeout 150 python3 capture_memory.py --state $s --out $OUT/capture_memory_llama8b_${s}_call45.json >> $OUT/capture_memory.txt 2>&1
done
for s in bf16 int8; do step "ncu $s"; ncu_persistent $s; done
cd ..
step "wait"; wait
step two-gpu; CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k graphed >> $OUT/gpu_pytest.log 2>&1
echo "two-gpu rc=$?" >> $OUT/gpu_pytest.log
finish
for s in bf16 int8; do show_capture $OUT/capture_memory_llama8b_${s}_call45.json; done
tail -3 $OUT/capture_memory.txt
for s in bf16 int8; do grep -E "Duration|L2 Cache Throughput|DRAM Throughput|Memory Throughput|Registers Per|Warp Cycles Per Issued|Issued Ipc" $OUT/ncu_persistent_${s}_details.txt | head -12; done
