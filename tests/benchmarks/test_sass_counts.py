"""benchmarks/sass_counts.py: the Triton kernel's SASS for sm_90, counted on the CPU."""

import pytest

from tests.helpers import run_compiling_tool

pytestmark = pytest.mark.slow  # the compilers run in a child process


def _counted(*arguments) -> list[list[str]]:
    """The table's rows of one run of the tool, compiled as on a GPU (no interpreter)."""
    run = run_compiling_tool("sass_counts.py", "--shape", "200x300", "--opcodes", "40", *arguments)
    assert run.returncode == 0, run.stderr[-3000:]
    return [line.strip("| ").split(" | ") for line in run.stdout.splitlines() if line.startswith("| adamw")]


def test_the_rule_pass_is_counted_by_opcode_and_an_element():
    rows = _counted("--precisions", "bf16,log4_factored")
    assert [r[1] for r in rows] == ["bf16", "log4_factored"]
    for _, _, tokens, total, per_element, spilled, top in rows:
        counts = {op: int(n) for op, n in (pair.split() for pair in top.split(", "))}
        assert tokens == "0" and int(total) >= sum(counts.values()) > 0
        assert float(per_element) == pytest.approx(int(total) / 32, abs=0.051)  # 64 x 64 tiles, 128 threads
        assert int(spilled) == counts.get("LDL", 0) + counts.get("STL", 0)
        assert counts.get("LDG", 0) > 0 and counts.get("STG", 0) > 0  # the gradient read, the weight written
    # the 4-bit codecs' arithmetic (group scales, codes, packing) on top of bf16's
    assert int(rows[1][3]) > int(rows[0][3])


def test_an_ablation_counts_the_kernel_without_that_stage():
    whole, = _counted("--precisions", "log4_factored")
    without, = _counted("--precisions", "log4_factored", "--ablate", "no_state_stores")
    assert 0 < int(without[3]) < int(whole[3])  # m's codes, group scales and packing left out
