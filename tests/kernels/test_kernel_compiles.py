"""Compile the fused kernels for Hopper (sm_90) without a GPU.

The interpreter runs Triton kernels as Python (and cannot run the Gluon one), so errors
that only the compiler sees (types of branches, constexpr folding, global lookups) would
wait for a GPU run. Triton's wheel carries ptxas, so the whole pipeline down to the cubin
runs here; each variant is what launch_fused_update would launch for those tensors. The compiles run in one
child process without TRITON_INTERPRET (conftest sets it for this one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"  # the child imports this file alone

pytestmark = pytest.mark.slow  # the compilers run in child processes

WEIGHT_STATE = ["fp32-fp32", "bf16-bf16", "fp32-bf16", "bf16-int8", "bf16-al8", "bf16-log4", "bf16-log4_factored",
                "bf16-bf16-grad", "bf16-int8-grad",  # -grad: ForgeOptimizer's non-fused step
                "bf16-bf16-even"]  # -even: a weight of whole tiles, whose loads and stores need no mask
RULE_NAMES = ["adagrad", "adamw", "lion", "nadam", "radam", "rmsprop", "sgd"]
# what ForgeState refuses (core/precision_checks.py; rmsprop runs here centered): nothing to compile
REFUSED = {("lion", "log4_factored"), ("sgd", "log4_factored"), ("rmsprop", "log4"), ("rmsprop", "log4_factored")}


def compile_all() -> dict:
    """Run in the child: {"rule/weight-state": "ok" or the error}."""
    import torch
    from sm90_compile import compile_fused  # benchmarks/: what a launch compiles, for sm_90

    extra = {"rmsprop": dict(momentum=0.9, centered=True), "sgd": dict(momentum=0.9)}
    results = {}
    for rule_name in RULE_NAMES:
        for variant in WEIGHT_STATE:
            wname, precision, *kind = variant.split("-")
            if (rule_name, precision) in REFUSED:
                continue
            grad, (n, k, t) = kind == ["grad"], (256, 512, 128) if kind == ["even"] else (200, 300, 77)
            try:
                compiled, _ = compile_fused(rule_name, precision, (n, k), 0 if grad else t, extra=extra.get(rule_name),
                                            weight_dtype=torch.float32 if wname == "fp32" else torch.bfloat16,
                                            grad_dtype=torch.bfloat16)
                results[f"{rule_name}/{variant}"] = "ok" if compiled.asm.get("cubin") else "no cubin"
            except Exception as e:  # reported per variant by the tests below
                results[f"{rule_name}/{variant}"] = f"{type(e).__name__}: {str(e)[-1500:]}"
    return results


PERSISTENT_VARIANTS = [("bf16", True), ("bf16", False), ("int8", True), ("al8", True), ("al8", False)]
PERSISTENT_RULES = {"adagrad": {}, "adamw": {}, "lion": {}, "nadam": {}, "radam": {},
                    "rmsprop": dict(momentum=0.9, centered=True), "sgd": {}, "sgd-momentum": dict(momentum=0.9)}


SHARED_LIMIT = 232448  # a Hopper multiprocessor gives a program at most 227 KB of shared memory


def _problems(compiled, spills: bool = False) -> str:
    """"ok", or what is wrong with a compiled Gluon kernel: no cubin, more shared memory than
    a multiprocessor has, and with ``spills`` registers spilled to the stack."""
    from sm90_compile import stack_bytes  # benchmarks/

    if not compiled.asm.get("cubin"):
        return "no cubin"
    problems = [f"shared memory {compiled.metadata.shared}"] * (compiled.metadata.shared > SHARED_LIMIT)
    stack = stack_bytes(compiled.asm["cubin"]) if spills else 0
    problems += [f"{stack} bytes of registers spilled to the stack"] * bool(stack)
    return "; ".join(problems) or "ok"


def compile_persistent() -> dict:
    """Run in the child: the persistent Gluon kernel as launch_persistent would launch it,
    bf16, int8 and al8 state, each rule (its own slots), stochastic and nearest rounding."""
    from sm90_compile import compile_gluon  # benchmarks/

    results = {}
    for key, hp in PERSISTENT_RULES.items():
        for precision, stochastic in PERSISTENT_VARIANTS:
            try:
                compiled = compile_gluon("persistent", key.split("-")[0], precision, stochastic, hp)
                results[f"{key}/{precision}/{stochastic}"] = _problems(compiled)
            except Exception as e:
                results[f"{key}/{precision}/{stochastic}"] = f"{type(e).__name__}: {str(e)[-1500:]}"
    return results


WIDE_VARIANTS = [(key, precision, True) for key in PERSISTENT_RULES for precision in ("bf16", "int8", "al8")] + \
    [("adamw", "bf16", False), ("adamw", "al8", False)]


def compile_wide() -> dict:
    """Run in the child: the wide Gluon kernel as launch_wide would launch it, bf16, int8 and
    al8 state, each rule, stochastic rounding (and AdamW's nearest); no registers spilled."""
    from sm90_compile import compile_gluon  # benchmarks/

    results = {}
    for key, precision, stochastic in WIDE_VARIANTS:
        name = f"{key}/{precision}/{stochastic}"
        try:
            compiled = compile_gluon("wide", key.split("-")[0], precision, stochastic, PERSISTENT_RULES[key])
            results[name] = _problems(compiled, spills=True)
        except Exception as e:
            results[name] = f"{type(e).__name__}: {str(e)[-1500:]}"
    return results


def _in_child(function: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_kernel_compiles as t; "
            f"print('RESULTS' + json.dumps(t.{function}()))")
    run = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], cwd=os.path.dirname(__file__), env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULTS")]
    assert lines, run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS"):])


@pytest.fixture(scope="module")
def compiled():
    return _in_child("compile_all")


@pytest.fixture(scope="module")
def compiled_persistent():
    return _in_child("compile_persistent")


@pytest.mark.parametrize("rule_name, variant", [(r, v) for r in RULE_NAMES for v in WEIGHT_STATE
                                                 if (r, v.split("-")[1]) not in REFUSED])
def test_kernel_compiles_for_sm90(compiled, rule_name, variant):
    assert compiled[f"{rule_name}/{variant}"] == "ok", compiled[f"{rule_name}/{variant}"]


@pytest.mark.parametrize("variant", [f"{precision}/{stochastic}" for precision, stochastic in PERSISTENT_VARIANTS])
@pytest.mark.parametrize("rule_key", sorted(PERSISTENT_RULES))
def test_persistent_kernel_compiles_for_sm90(compiled_persistent, rule_key, variant):
    assert compiled_persistent[f"{rule_key}/{variant}"] == "ok", compiled_persistent[f"{rule_key}/{variant}"]


@pytest.fixture(scope="module")
def compiled_wide():
    return _in_child("compile_wide")


@pytest.mark.parametrize("variant", ["/".join(map(str, variant)) for variant in WIDE_VARIANTS])
def test_wide_kernel_compiles_for_sm90(compiled_wide, variant):
    assert compiled_wide[variant] == "ok", compiled_wide[variant]
