# Sourced by the gpu_call*.sh scripts on a lent GPU machine: the carried wheels (datasets,
# liger-kernel, notebook test tools), import paths, and a step marker for $OUT/session.log.
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
LOG=$OUT/session.log
step() { echo "=== $1 ($(date +%T))" >> $LOG; }
# the test suite on one GPU (the Trainer refuses to run with two visible), in 4 workers
gpu_tests() { CUDA_VISIBLE_DEVICES=$1 timeout $2 python3 -m pytest -q -p no:cacheprovider -n 4 tests > $OUT/gpu_pytest.log 2>&1
              echo "pytest rc=$?" >> $OUT/gpu_pytest.log; }
