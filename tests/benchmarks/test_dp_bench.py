"""benchmarks/dp_bench.py's speed arms on two gloo ranks on CPU (--tiny, forge's reference
backend; a dry run writes no table rows): forge inside FSDP2 trains through the tool."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_forge_inside_fsdp2_is_an_arm_of_the_speed_mode(tmp_path):
    out = tmp_path / "dp.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "dp_bench.py", "--mode", "speed", "--device", "cpu", "--tiny", "--models", "qwen3-0.6b",
               "--arms", "forge_fsdp2", "--state", "int8", "--steps", "2", "--warmup", "1", "--seq", "16",
               "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["arm"] == "forge_fsdp2" and result["status"] == "ok", result
    assert [r["status"] for r in result["per_rank"]] == ["ok", "ok"] and result["step_ms"] > 0
