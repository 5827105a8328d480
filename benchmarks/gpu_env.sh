# Sourced by the gpu_call*.sh scripts on a lent GPU machine: the carried wheels (datasets,
# liger-kernel, notebook test tools), import paths, and a step marker for $OUT/session.log.
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
LOG=$OUT/session.log
step() { echo "=== $1 ($(date +%T))" >> $LOG; }
# the test suite on one GPU (the Trainer refuses to run with two visible), in 4 workers
gpu_tests() { CUDA_VISIBLE_DEVICES=$1 timeout $2 python3 -m pytest -q -p no:cacheprovider -n 4 tests > $OUT/gpu_pytest.log 2>&1
              echo "pytest rc=$?" >> $OUT/gpu_pytest.log; }
# (run from benchmarks/) the graphed Llama-3.1-8B 1 x 512 step: fused AdamW eager against
# forge graphed with bf16 and int8 state; $1 the JSON to write, $2 rounds, $3 timeout
llama_step_grid() { step grid; timeout $3 python3 run_grid.py --models llama-3.1-8b --cells 1x512 --liger --no-liger-ce \
                      --loss chunked --recompute-swiglu --arms adamw_fused,forge_bf16_graphed,forge_int8_graphed \
                      --steps 20 --rounds $2 --no-profile --out $1 >> $LOG 2>&1; }
show_grid() { python3 -c "
import json
for r in json.load(open('$1'))['results']:
    print(r['arm'], r.get('round', ''), r['status'], r.get('step_ms'), r.get('peak_gib'), r.get('reason', '')[:300])"; }
# the suite's outcome after `wait`, then the session log's steps and any failures
finish() { grep -E "passed|failed|rc=" $OUT/gpu_pytest.log | tail -3 >> $LOG; step done
           grep -E "^===|passed|failed|transformers" $LOG; grep -E "^FAILED|^ERROR" $OUT/gpu_pytest.log | head -10; }
# (run from benchmarks/) one kernel variant's model sum: $1 GPU, $2 state, $3 variant
kernel_variant() { echo -n "$1 $2 $3: " >> $OUT/variants_$1.txt
                   CUDA_VISIBLE_DEVICES=$1 timeout 90 python3 kernel_microbench.py --state $2 --configs default --variant $3 \
                     --out $OUT/variant_$2_$3.json 2>&1 | tail -1 >> $OUT/variants_$1.txt; }
show_capture() { python3 -c "
import json
d = json.load(open('$1'))
for k in ('eager', 'capture', 'replay'): print(k, round(d[k]['peak_gib'], 4), list(d[k]['sites_mib'].items())[:6])"; }
install_forge() { step install; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $LOG 2>&1; }
# (run from benchmarks/) the kernel's model sum per state: $1 the files' suffix, then states
kernel_sums() { step kernel; local suffix=$1; shift
                for p in "$@"; do timeout 90 python3 kernel_microbench.py --state $p --configs default \
                  --out $OUT/kernel_microbench_llama8b_${p}_$suffix.json 2>&1 | tail -1 >> $OUT/kernel.txt; done; }
# (run from benchmarks/) dp_bench.py's speed mode on two ranks: $1 the timeout, then its options
run_dp() { timeout $1 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed "${@:2}" >> $LOG 2>&1; }
# dp_bench.py's results: each argument a JSON under $OUT, without .json
show_dp() { python3 -c "
import json, sys
for f in sys.argv[1:]:
    try: d = json.load(open('$OUT/' + f + '.json'))
    except Exception as e: print(f, e); continue
    for r in d['results']:
        print(f, r.get('model'), r['arm'], r.get('status'), r.get('step_ms'), r.get('peak_gib_max'), r.get('reason', '')[:300])" "$@"; }
# two GPUs: install forge, start the whole suite on GPU 1 in the background, then go on
# in benchmarks/ with GPU 0 alone (`wait` for the suite later)
suite_on_gpu1() { install_forge; (gpu_tests 1 330) & cd benchmarks; export CUDA_VISIBLE_DEVICES=0; }
# seventh session, two GPUs: GPU 1 the whole suite; GPU 0 persistent_probe.py, then the
# graphed step grid (2 rounds); then the two-GPU test. $1: the call's number
suite_probe_step() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_tf/*.whl
  suite_on_gpu1
  step probe; timeout 150 python3 persistent_probe.py --out $OUT/persistent_probe_call$1.json > $OUT/probe.txt 2>&1
  llama_step_grid $OUT/grid_llama8b_1x512_graphed_persistent.json 2 240
  cd ..
  step "wait"; wait
  step two-gpu; CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k graphed >> $OUT/gpu_pytest.log 2>&1
  echo "two-gpu rc=$?" >> $OUT/gpu_pytest.log
  finish
  tail -4 $OUT/probe.txt
  show_grid $OUT/grid_llama8b_1x512_graphed_persistent.json
}
# (run from benchmarks/) Nsight Compute on the persistent kernel, gate/up_proj shape at 512
# tokens, $1 the state: the full set of sections, and stall samples per SASS instruction
ncu_persistent() { timeout 120 ncu --clock-control none --kernel-name regex:persistent_update --launch-skip 3 --launch-count 1 \
                     --set full --import-source no -f -o $OUT/ncu_persistent_$1 python3 profile_kernel.py --state $1 > $OUT/ncu_run_$1.txt 2>&1
                   ncu -i $OUT/ncu_persistent_$1.ncu-rep --page details > $OUT/ncu_persistent_$1_details.txt 2>&1
                   ncu -i $OUT/ncu_persistent_$1.ncu-rep --page source --csv --print-source sass > $OUT/ncu_persistent_$1_sass.csv 2>&1; }
