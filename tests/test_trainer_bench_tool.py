"""benchmarks/trainer_bench.py's row names: an arm's options are part of its name, so the
report (one row per model, batch and arm) keeps configurations apart."""

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trainer_bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("trainer_bench")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_an_arm_is_named_by_its_options(trainer_bench):
    label = trainer_bench.arm_label
    assert label("forge", "", False) == "trainer_forge"
    assert label("forge_compile_int8", "lean_loss=true, recompute_swiglu=true", False) == \
        "trainer_forge_compile_int8+lean_loss+recompute_swiglu"
    assert label("forge", "recompute_swiglu=true", True) == "trainer_forge+liger+recompute_swiglu"
    # forge options do not reach the fused-AdamW arms; Liger does
    assert label("adamw_fused", "recompute_swiglu=true", True) == "trainer_adamw_fused+liger"
    assert label("adamw_fused_compile", "lean_loss=true", False) == "trainer_adamw_fused_compile"
