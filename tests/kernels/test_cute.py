"""forge_hf/kernels/cute/ (QuACK's Hopper GEMM with the fused step as its epilogue) is an optional
GPU dependency: CPU installs and CI import nothing of it, and asking for it without the packages
says how to install them."""

import subprocess
import sys

import pytest

from forge_hf.kernels import cute


def test_importing_forge_hf_imports_neither_quack_nor_the_cute_dsl():
    names = ("cutlass", "quack", "forge_hf.kernels.cute.wgrad_epilogue")
    code = ("import sys, forge_hf, forge_hf.kernels.cute, forge_hf.kernels.dispatch; "
            f"print(sorted(m for m in {names!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_packages_are_named_with_the_install_command(monkeypatch):
    monkeypatch.setattr(cute, "_REQUIRED", ("cutlass", "quack", "forge_hf_no_such_package"))
    assert "forge_hf_no_such_package" in cute.missing_packages()
    assert not cute.available()
    with pytest.raises(ImportError, match=r"pip install forge-hf\[hopper\]"):
        cute.load()


@pytest.mark.skipif(cute.available(), reason="QuACK and the CuTe DSL are installed here")
def test_without_the_packages_load_refuses():
    with pytest.raises(ImportError, match="forge_hf.kernels.cute needs"):
        cute.load()
