#!/usr/bin/env bash
# The benchmarks and GPU tests on a GPU machine, one sub-command a call, from the repository
# root; logs, JSON and new results-table rows go to $OUT (default /tmp/forge_gpu_out):
#
#   bash benchmarks/gpu.sh tests && bash benchmarks/gpu.sh grid --models llama-3.1-8b --cells 1x512
#
#   install         wheels carried in .whl/ into /tmp/site (no index), forge_hf editable; the
#                   other sub-commands run it first if it has not run on this machine
#   tests [ARGS]    the pytest suite on one GPU (ARGS replace "tests"), then with two or more
#                   GPUs the two-GPU data-parallel test; log in $OUT/gpu_pytest.log. Where one call
#                   is limited to 10 minutes, three calls by layer: tests/{core,kernels,nn}, then
#                   tests/optim, then tests/{integrations,train,benchmarks,notebooks};
#                   PYTEST_SECONDS=N stops pytest after N seconds with its summary printed. .whl/ carries datasets, trl and the notebooks'
#                   runner beside transformers: the GPU image has none of them
#   grid ARGS       run_grid.py             kernel ARGS   kernel_microbench.py
#   trainer ARGS    trainer_bench.py: the Trainer API's arms side by side
#   dp ARGS         dp_bench.py on every visible GPU (torch.distributed.run; NPROC to change)
#   memory ARGS     capture_memory.py       host ARGS     host_overhead.py
#   overlap ARGS    stream_overlap.py: the update's rule pass on a side stream, against the plain backward
#   convergence ARGS  convergence.py: held-out loss of each optimizer arm over a training run;
#                   curves, plot and loss table as $OUT/convergence_<time>.{json,png,md}
#   ncu ARGS        Nsight Compute on kernel_microbench.py --ncu ARGS (e.g. gate_proj/up_proj)
#   report [ARGS]   report.py over the committed table and $OUT's rows, into $OUT
#
# Rows go to $OUT/results.csv (a copy of the checkout on another machine does not come back); merge
# them with `python benchmarks/results_table.py merge <that file>`. Set FORGE_COMMIT to the commit
# measured: a copy of the working tree may carry the .git of an older commit, or none.
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/forge_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} FORGE_RESULTS_TABLE=${FORGE_RESULTS_TABLE:-$OUT/results.csv}
INSTALLED=/tmp/site/.forge_hf_installed

install() {
  mkdir -p /tmp/site
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . && touch $INSTALLED
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
              'transformers', transformers.__version__)"
}

gpus() { nvidia-smi --query-gpu=name --format=csv,noheader | wc -l; }

# $1: the log under $OUT; the rest: the command (its output also to the terminal)
logged() { local log=$OUT/$1; shift; echo "\$ $*" >> "$log"; "$@" 2>&1 | tee -a "$log"; return "${PIPESTATUS[0]}"; }

tests() {
  local rc workers=() skip=()
  python3 -c "import xdist" 2> /dev/null && workers=(-n "${WORKERS:-4}")
  : > "$OUT/gpu_pytest.log"  # this run's log only: the summary below greps it
  # the notebooks run on CPU in CI; a GPU machine without their runner leaves them out, said in the log
  if ! python3 -c "import nbformat, nbclient, ipykernel" 2> /dev/null; then
    skip=(--ignore=tests/notebooks/test_notebooks.py)  # the file: an ignored folder named as an argument is collected
    echo "tests/notebooks left out: nbformat, nbclient or ipykernel is not installed" >> "$OUT/gpu_pytest.log"
  fi
  # the Trainer refuses to run with two GPUs visible: the suite sees one. -v names a failure
  # when it happens, so a run cut short by a time limit still says which test failed;
  # PYTEST_SECONDS interrupts pytest itself after that long, so its summary is still printed
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} ${PYTEST_SECONDS:+timeout -s INT "$PYTEST_SECONDS"} \
    python3 -m pytest -v -p no:cacheprovider ${workers[@]+"${workers[@]}"} \
    ${skip[@]+"${skip[@]}"} "${@:-tests}" >> "$OUT/gpu_pytest.log" 2>&1
  rc=$?
  if [ $# -eq 0 ] && [ "$(gpus)" -ge 2 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/optim/test_distributed.py -k graphed >> "$OUT/gpu_pytest.log" 2>&1
    rc=$((rc | $?))
  fi
  echo "pytest rc=$rc" >> "$OUT/gpu_pytest.log"
  grep -E " (FAILED|ERROR) |^(FAILED|ERROR)|passed|failed|left out|rc=" "$OUT/gpu_pytest.log" | tail -25
  return $rc
}

ncu_kernel() {
  local report=$OUT/ncu_kernel
  ncu --clock-control none --kernel-name regex:update_kernel --launch-skip 3 --launch-count 1 --set full \
    --import-source no -f -o "$report" python3 benchmarks/kernel_microbench.py --ncu "$@" > "$OUT/ncu.log" 2>&1
  ncu -i "$report.ncu-rep" --page details > "$report.txt" 2>&1
  grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|Registers Per|Warp Cycles Per Issued" \
    "$report.txt"
}

report() {
  local tables=(--table benchmarks/results/results.csv)
  [ -f "$FORGE_RESULTS_TABLE" ] && tables+=(--table "$FORGE_RESULTS_TABLE")
  python3 benchmarks/report.py "${tables[@]}" --md "$OUT/step_time.md" --png "$OUT/step_time.png" "$@" \
    && cat "$OUT/step_time.md"
}

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { print substr($0, 3) }' "$SELF"; }
command=${1:-help}
shift $(($# > 0))
case $command in
  grid|trainer|kernel|dp|memory|host|overlap|ncu|tests|convergence) [ -f $INSTALLED ] || logged install.log install || exit $? ;;
esac
case $command in
  install) logged install.log install ;;
  tests) tests "$@" ;;
  grid) logged grid.log python3 benchmarks/run_grid.py "$@" ;;
  trainer) logged trainer.log python3 benchmarks/trainer_bench.py "$@" ;;
  kernel) logged kernel.log python3 benchmarks/kernel_microbench.py "$@" ;;
  dp) logged dp.log python3 -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-$(gpus)}" \
        benchmarks/dp_bench.py "$@" ;;
  memory) logged memory.log python3 benchmarks/capture_memory.py "$@" ;;
  host) logged host.log python3 benchmarks/host_overhead.py "$@" ;;
  overlap) logged overlap.log python3 benchmarks/stream_overlap.py "$@" ;;
  convergence) stamp=$OUT/convergence_$(date +%H%M%S)
    logged convergence.log python3 benchmarks/convergence.py --out "$stamp.json" --png "$stamp.png" --md "$stamp.md" \
      "$@" ;;
  ncu) ncu_kernel "$@" ;;
  report) report "$@" ;;
  help|-h|--help) usage ;;
  *) usage; echo "unknown sub-command: $command" >&2; exit 2 ;;
esac
