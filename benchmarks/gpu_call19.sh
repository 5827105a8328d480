#!/usr/bin/env bash
# Fourth session, last call (one H200): GraphedStep's and the host-sync tests after the
# replay's check of captured addresses (a checkpoint loaded after a capture is refused).
source benchmarks/gpu_env.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1; timeout 140 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_host_sync.py 2>&1 | tail -15 | tee $OUT/gpu_pytest_graphs_final.txt
