"""Weight-gradient kernels on QuACK's Hopper GEMM engine (CuTe DSL): the fused step as a
GEMM epilogue, a third fused kernel beside the Gluon ones (launch/quack_launch.py says which
layers the dispatch gives it).

QuACK (`quack-kernels`) and the CuTe DSL (`nvidia-cutlass-dsl`) are optional GPU
dependencies (`pip install forge-hf[hopper]`): nothing here imports them until
``load()`` is called, so `import forge_hf` and CPU CI never need them.
"""

from __future__ import annotations

import importlib
import importlib.util

INSTALL_HINT = "pip install forge-hf[hopper]  (quack-kernels and nvidia-cutlass-dsl[cu13])"
_REQUIRED = ("cutlass", "quack")


def missing_packages() -> list[str]:
    """The optional packages this folder needs that are not installed (found without importing them)."""
    return [name for name in _REQUIRED if importlib.util.find_spec(name) is None]


def available() -> bool:
    return not missing_packages()


def load():
    """The kernels' module (forge_hf.kernels.cute.wgrad_epilogue), importing QuACK and the CuTe DSL;
    a clear ImportError when they are missing."""
    missing = missing_packages()
    if missing:
        raise ImportError(f"forge_hf.kernels.cute needs {', '.join(missing)}, which is not installed: "
                          f"{INSTALL_HINT}")
    return importlib.import_module(".wgrad_epilogue", __name__)
