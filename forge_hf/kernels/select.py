"""Which kernel performs a layer's fused step, and which path forms its weight gradient: the
one place either is chosen, and the one reader of FORGE_HF_KERNEL and FORGE_HF_WGRAD
(docs/kernels.md). dispatch.py binds and launches what is chosen here, and times the two
paths where FORGE_HF_WGRAD=auto leaves the choice to a measurement.
"""

from __future__ import annotations

import os

import torch

from .launch.gluon_launch import device_unsupported

KERNEL_ENV = "FORGE_HF_KERNEL"
KERNEL_SETTINGS = ("auto", "persistent", "triton")
WGRAD_ENV = "FORGE_HF_WGRAD"
WGRAD_PATHS = ("auto", "fused", "two_pass")
TRITON, PERSISTENT, WIDE = "triton", "persistent", "wide"  # the kernels choose names

# From this many tokens a step the wide Gluon kernel takes the layers it applies to (below,
# the persistent one is the faster: kernel_microbench --kernel wide), and auto times the
# two-pass path against the fused one (below, the fused kernel is the faster, and the
# timing's copies of the layer would add to the step's peak: kernel_microbench --paths
# measures it ahead at 512 tokens). Both on Llama-3.1-8B's shapes.
MANY_TOKENS = 1024
# auto takes the two-pass path only where it is clearly faster: it costs a scratch buffer,
# and one launch's time varies by a few percent
TWO_PASS_MARGIN = 0.97
# auto times the two paths only where the timing's copies of the layer and its fp32 scratch
# take at most this share of the memory the process has left: a card nearly full (or a
# process capped below the card) keeps the fused path rather than run out later in the step
ROOM_SHARE = 0.5


def _setting(env: str, choices: tuple) -> str:
    """An environment switch's value: its first choice (``auto``) where unset or empty."""
    value = os.environ.get(env) or choices[0]
    if value not in choices:
        raise ValueError(f"{env}={value!r}: choose one of {list(choices)}")
    return value


def kernel_setting() -> str:
    """FORGE_HF_KERNEL: ``auto``, ``persistent`` (never the wide kernel) or ``triton`` (only
    triton/fused_update.py's kernel)."""
    return _setting(KERNEL_ENV, KERNEL_SETTINGS)


def wgrad_setting() -> str:
    """FORGE_HF_WGRAD: ``auto`` (timed per layer shape), ``fused`` or ``two_pass``."""
    return _setting(WGRAD_ENV, WGRAD_PATHS)


def choose(weight, slots, kinds: tuple, tokens: int) -> tuple[str, str]:
    """(kernel, why) for a fused step of ``tokens`` tokens of this layer on the GPU: a Gluon
    kernel where the device, the weight and its state slots (of storage ``kinds``,
    codecs.storage_kinds) suit one, the wide one from MANY_TOKENS tokens, else
    triton/fused_update.py's. A step whose tokens are not bf16 and TMA-aligned is launched
    on the Triton kernel all the same (the launch tells)."""
    setting = kernel_setting()
    if setting == "triton":
        return TRITON, f"{KERNEL_ENV}=triton"
    reason = device_unsupported(weight.device)
    if reason is not None:
        return TRITON, reason
    from .triton.fused_update import INTERPRETER  # Triton's import: a Hopper GPU's only

    if INTERPRETER:
        return TRITON, "TRITON_INTERPRET=1 runs no Gluon kernel"
    from .launch.persistent_launch import weight_unsupported
    from .launch.wide_launch import wide_layer_unsupported

    reason = weight_unsupported(weight, slots, kinds)
    if reason is not None:
        return TRITON, reason
    if tokens < MANY_TOKENS:
        return PERSISTENT, f"below {MANY_TOKENS} tokens"
    if setting == "persistent":
        return PERSISTENT, f"{KERNEL_ENV}=persistent"
    reason = wide_layer_unsupported(weight, slots, kinds)
    if reason is not None:
        return PERSISTENT, reason
    return WIDE, f"from {MANY_TOKENS} tokens"


def untimed_reason(x, dy, device: torch.device) -> str | None:
    """Why FORGE_HF_WGRAD=auto takes the fused path without timing the two (None: it times
    both)."""
    if device.type != "cuda":
        return f"auto on {device.type}: no GPU to time on"
    if x.shape[0] < MANY_TOKENS:
        return f"auto below {MANY_TOKENS} tokens: the fused kernel is the faster there"
    if x.dtype not in (torch.bfloat16, torch.float16) or dy.dtype != x.dtype:
        return "auto with fp32 tokens: the fused kernel keeps IEEE fp32 products where cuBLAS may use TF32"
    return None


def memory_room(device: torch.device) -> int:
    """Bytes this process may still allocate on ``device``: what the card has free plus what
    the allocator holds unused, within a per-process memory fraction."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cap = total * torch.cuda.get_per_process_memory_fraction(device)
    return int(min(free + torch.cuda.memory_reserved(device), cap) - allocated)


def room_reason(timing_bytes: int, room_bytes: int) -> str | None:
    """Why auto does not time the two paths for lack of memory (None: there is room)."""
    if timing_bytes <= ROOM_SHARE * room_bytes:
        return None
    return (f"auto with {room_bytes / 2**30:.2f} GiB left: timing the two-pass path takes "
            f"{timing_bytes / 2**30:.2f} GiB, more than {ROOM_SHARE:.0%} of it")


def faster_path(fused_ms: float, two_pass_ms: float) -> str:
    """auto's choice between measured costs (from MANY_TOKENS tokens; below, fused)."""
    return "two_pass" if two_pass_ms < TWO_PASS_MARGIN * fused_ms else "fused"
