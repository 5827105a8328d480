"""When and how QuACK's Hopper GEMM engine (kernels/cute/) runs a layer's fused step: a bf16
row-major weight with fp32, bf16, int8, al8 or absent states, both sides multiples of 8 (in
features of 16 with 8-bit states), from MIN_TOKENS bf16 tokens a step, on a Hopper GPU where
forge-hf[hopper] is installed. Under ``auto`` dispatch times it beside the Gluon kernel per
layer shape and token bucket and keeps the faster; ``FORGE_HF_KERNEL=quack`` takes it wherever it applies.
"""

from __future__ import annotations

import torch

from ...core import codecs
from .. import cute
from .gluon_launch import (
    KERNEL_ENV,
    device_unsupported,
    kernel_choice,
    tokens_unsupported,
    weight_layout_unsupported,
)

# Below this many tokens a step the GEMM's mainloop is too short to hide the update under:
# the persistent Gluon kernel is the faster there (kernel_microbench, cute_probe)
MIN_TOKENS = 1024
KINDS = (codecs.NONE, codecs.FP32, codecs.BF16, codecs.ABSMAX8, codecs.ABSMAX8_FLOORED, codecs.AL8)


def quack_requested() -> bool:
    """FORGE_HF_KERNEL=quack; an unknown choice is refused by kernel_choice."""
    return kernel_choice() == "quack"


def check_quack_installed() -> None:
    """FORGE_HF_KERNEL=quack without the engine installed: refused before any step, naming the fix."""
    missing = cute.missing_packages()
    if quack_requested() and missing:
        raise ImportError(f"{KERNEL_ENV}=quack needs {', '.join(missing)} installed: {cute.INSTALL_HINT}; "
                          f"or unset {KERNEL_ENV}")


def quack_layer_unsupported(weight, slots) -> str | None:
    """Why the QuACK engine cannot step this layer, whatever its tokens (None: it can)."""
    choice = kernel_choice()
    if choice in ("persistent", "triton"):
        return f"{KERNEL_ENV}={choice}"
    missing = cute.missing_packages()
    if missing:
        return f"{', '.join(missing)} not installed ({cute.INSTALL_HINT})"
    return device_unsupported(weight.device) or quack_layout_unsupported(weight, slots)


def quack_layout_unsupported(weight, slots) -> str | None:
    """Why a weight and its states do not suit the engine's TMA loads and stores, rows of
    16 bytes (None: they do)."""
    if any(isinstance(slot, codecs.QuantisedSlot) for slot in slots) and weight.shape[-1] % 16:
        return f"in features ({weight.shape[-1]}) are not a multiple of 16: rows of 8-bit codes must be 16 bytes"
    return weight_layout_unsupported(weight, slots, 8, KINDS,
                                     "forge_hf 0.1.0's al8 codes are read by the Triton kernels only")


def quack_tokens_unsupported(x, dy) -> str | None:
    """Why a step's tokens do not suit the engine (None: they do)."""
    if x.shape[0] < MIN_TOKENS:
        return f"{x.shape[0]} tokens: the engine takes from {MIN_TOKENS}"
    if not (x.is_contiguous() and dy.is_contiguous()):
        return "x or dy is not contiguous"
    return tokens_unsupported(x, dy)


class QuackLaunch:
    """``launch(x, dy, args, stats)``: one layer's step on the QuACK engine, False (nothing
    launched) for tokens it does not take. A token count first met inside a CUDA-graph
    capture is left to the Gluon kernel: the engine compiles its kernel for a new shape on
    the host, which an eager step does first."""

    def __init__(self, weight, slots, rule_name: str, stochastic: bool):
        self.weight, self.slots = weight, list(slots)
        self.rule_name, self.stochastic = rule_name, stochastic
        self.kernels = cute.load()
        # the weight's and states' checks and the epilogue, once, not at every step
        self.layer = self.kernels.layer_call(weight, self.slots, rule_name, stochastic)
        self._eager_tokens: set[int] = set()

    def __call__(self, x, dy, args, stats) -> bool:
        if quack_tokens_unsupported(x, dy) is not None:
            return False
        tokens = x.shape[0]
        if tokens not in self._eager_tokens:
            if torch.cuda.is_current_stream_capturing():
                return False
            self._eager_tokens.add(tokens)
        self.kernels.fused_step(x, dy, self.weight, self.slots, args, rule=self.rule_name,
                                stochastic=self.stochastic, stats=stats, layer=self.layer)
        return True
