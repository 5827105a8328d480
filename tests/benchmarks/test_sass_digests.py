"""benchmarks/sass_digests.py: each fused-kernel variant's SASS for sm_90, digested on the CPU
and compared with an earlier run's."""

import json

import pytest

from tests.helpers import run_compiling_tool

pytestmark = pytest.mark.slow  # the compilers run in a child process

# AdamW and Lion, bf16 and log4_factored states (Lion keeps no second moment to factor), the
# Triton kernel given tokens and the persistent Gluon kernel: 5 compiles
FEW = ["--kernels", "triton,persistent", "--rules", "adamw,lion", "--weights", "bf16", "--precisions",
       "bf16,log4_factored", "--roundings", "nearest", "--inputs", "tokens", "--jobs", "2"]


def test_a_second_run_finds_the_same_code_and_names_what_differs(tmp_path):
    first = run_compiling_tool("sass_digests.py", *FEW, "--out", str(tmp_path / "first.json"))
    assert first.returncode == 0, first.stderr[-3000:]
    digests = json.loads((tmp_path / "first.json").read_text())
    assert len(digests) == 8 and "compiled 5, not taken 3, errors 0" in first.stdout
    assert digests["triton/lion/bf16/log4_factored/nearest/tokens"].startswith("not taken: state_precision=")
    assert "the Triton kernel" in digests["persistent/adamw/bf16/log4_factored/nearest/-"]  # where 4-bit runs
    compiled = [v for v in digests.values() if not v.startswith("not taken")]
    assert len(set(compiled)) == 5  # each variant's own code (digest, instructions)
    assert all(int(v.split()[1]) > 1000 for v in compiled)
    # an earlier run whose one variant had other code: the second run names it, and only it
    changed = "triton/adamw/bf16/bf16/nearest/tokens"
    digests[changed] = "0" * 20 + " 1"
    (tmp_path / "earlier.json").write_text(json.dumps(digests))
    second = run_compiling_tool("sass_digests.py", *FEW, "--against", str(tmp_path / "earlier.json"))
    assert second.returncode == 1, second.stderr[-3000:]
    assert ": 1 differ" in second.stdout
    differing = [line for line in second.stdout.splitlines() if " -> " in line]
    assert len(differing) == 1 and differing[0].startswith(changed + ": " + "0" * 20)


@pytest.mark.parametrize("arguments, message", [
    (["--rules", "adam"], "--rules adam: choose among adagrad,adamw"),
    (["--precisions", "auto"], "--precisions auto: choose among fp32,bf16"),
    (["--jobs", "0"], "--jobs 0: give at least 1"),
    (["--against", "missing.json"], "--against missing.json: no such file; write one with --out"),
])
def test_a_bad_argument_is_refused_naming_it(arguments, message):
    run = run_compiling_tool("sass_digests.py", *arguments)
    assert run.returncode == 2 and message in run.stderr
