"""Which code performs a layer's fused step: the backend names, and on the GPU the choice
between the persistent Gluon kernel and the Triton kernel.

Every fused step goes through ``resolve_backend(backend, device)``, which returns a function
with the contract of ``launch_fused_update``: (x (T, K), dy (T, N), weight (N, K), three
state slots, the launch's argument tensor, stats, rule name, stochastic).

* ``reference``: kernels/reference.py, PyTorch tile by tile (CPU, and the tests' oracle);
* ``triton``: the GPU kernels (or Triton's interpreter on CPU tensors under
  TRITON_INTERPRET=1). On a Hopper GPU a layer the persistent kernel takes (bf16 weight,
  bf16 or int8 states, both dimensions multiples of 64: persistent_launch.py) runs there,
  being faster with the same bits; every other layer runs fused_update.py's kernel.
  ``FORGE_HF_KERNEL=triton`` in the environment keeps every layer on the latter;
* ``auto``: ``triton`` where it can run, else ``reference``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .reference import reference_fused_update

BACKENDS = ("auto", "triton", "reference")


def _kernels():
    """fused_update.py, imported at the first GPU step: Triton's import is slow, and absent
    on some platforms."""
    from . import fused_update

    return fused_update


def _triton_available() -> bool:
    try:
        _kernels()
    except ImportError:
        return False
    return True


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend={backend!r}: choose one of {list(BACKENDS)}")
    return backend


def resolve_backend(backend: str, device: torch.device):
    """The function that performs the fused step for a weight on ``device``."""
    if check_backend(backend) == "reference":
        return reference_fused_update
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and device.type == "cpu"
    if not ((device.type == "cuda" or interpreted) and _triton_available()):
        if backend == "triton":
            raise RuntimeError(
                f"backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                f"the weight is on {device}: use backend='auto' or 'reference'"
            )
        return reference_fused_update
    return launch_fused_update


def bind_fused_update(backend: str, weight, slots, stats, rule_name: str, stochastic: bool) -> Callable:
    """``launch(x, dy, args, stats)``: the fused step of one layer whose weight and state
    slots stay where they are, with what does not change between its steps prepared once
    (the backend's choice, and on the persistent kernel its descriptors). Rebind when a
    state is allocated or loaded."""
    run = resolve_backend(backend, weight.device)
    if run is launch_fused_update and not _kernels().INTERPRETER:
        from .persistent_launch import PersistentLaunch, device_unsupported, tokens_unsupported, weight_unsupported

        if device_unsupported(weight.device) is None and weight_unsupported(weight, slots) is None:
            persistent = PersistentLaunch(weight, slots, stats, _kernels().RULE_UPDATES[rule_name], stochastic)

            def launch(x, dy, args, stats):
                if tokens_unsupported(x, dy) is None:
                    persistent(x, dy, args, stats)
                else:
                    launch_fused_update(x, dy, weight, slots, args, stats, rule_name, stochastic)
            return launch

    def launch(x, dy, args, stats):
        run(x, dy, weight, slots, args, stats, rule_name, stochastic)
    return launch


def launch_fused_update(x, dy, weight, slots, args, stats, rule_name, stochastic, blocks=None,
                        **options) -> None:
    """One fused step of one layer on the GPU kernels (arguments as in
    fused_update.fused_launch_arguments). ``blocks`` or launch ``options`` (num_warps,
    num_stages, maxnreg) pin the Triton kernel with them; without either, the persistent
    kernel runs where it applies."""
    fused_update = _kernels()
    if blocks is None and not options and not fused_update.INTERPRETER:
        from .persistent_launch import launch_persistent, persistent_unsupported
        if persistent_unsupported(x, dy, weight, slots) is None:
            launch_persistent(x, dy, weight, slots, args, stats, fused_update.RULE_UPDATES[rule_name], stochastic)
            return
    config = fused_update.default_config(*weight.shape, x.shape[0])
    known = sorted(set(config) - {"blocks"})
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"unknown launch option(s) {unknown}: the fused kernel takes {known}")
    config = {**config, **options}
    grid, positional, constexprs = fused_update.fused_launch_arguments(
        x, dy, weight, slots, args, stats, rule_name, stochastic, blocks or config["blocks"])
    fused_update.launch_fused_kernel(grid, positional, constexprs, config)


def launch_rule_step(grad, weight, slots, args, stats, rule_name, stochastic) -> None:
    """The Triton kernel's rule and store for a tensor whose (N, K) gradient exists: one
    launch, no whole-tensor temporaries (ForgeOptimizer's non-fused parameters)."""
    fused_update = _kernels()
    config = fused_update.default_config(*weight.shape, 0)
    grid, positional, constexprs = fused_update.fused_launch_arguments(
        grad, grad, weight, slots, args, stats, rule_name, stochastic, config["blocks"], grad_given=True)
    fused_update.launch_fused_kernel(grid, positional, constexprs, config)
