"""When and how the persistent Gluon kernel (persistent_update.py) runs a layer's step.

It runs where it applies (bf16 weights; bf16, int8 or al8 states): on Llama-3.1-8B's linears at
512 tokens it takes about 12% less time than fused_update.py's kernel, with the same bits
(docs/performance.md). ``FORGE_HF_KERNEL=triton`` in the environment keeps every layer on
fused_update.py's.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from ..core import codecs
from ..core.codecs import QuantisedSlot, storage_kind
from .compiled import int_spec, launch_compiled, tensor_spec
from .direct_launch import DirectLauncher
from .persistent_update import BLOCK_SIZE, persistent_update_kernel, tensor_descriptor

NUM_BUF = 5  # ring slots a lane: 4 -> 5 was 49.3 -> 48.1 ms; 6 does not fit shared memory
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 232, 40, 168  # 12 warps: 8 consumers, 2 producers (a warpgroup)
_TOKEN_PLACES = 16  # token descriptors a layer keeps encoded (a few places a step; eval and train differ)
KINDS = (codecs.NONE, codecs.BF16, codecs.ABSMAX8, codecs.ABSMAX8_FLOORED, codecs.AL8)  # fp32 states: not here


def _aligned(t: torch.Tensor) -> bool:
    """What a TMA descriptor needs: unit last stride, 16-byte base and row stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def persistent_unsupported(x, dy, weight, slots) -> str | None:
    """Why the persistent kernel cannot take this step (None: it can)."""
    return device_unsupported(weight.device) or layout_unsupported(x, dy, weight, slots)


def device_unsupported(device: torch.device) -> str | None:
    """Why the persistent kernel cannot run on ``device`` (None: it can)."""
    if os.environ.get("FORGE_HF_KERNEL", "auto") == "triton":
        return "FORGE_HF_KERNEL=triton"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "not a Hopper GPU (wgmma and TMA as compiled for sm_90)"
    return None


def tokens_unsupported(x, dy) -> str | None:
    """Why a step's tokens (x, dy) do not suit the kernel (None: they do)."""
    if x.dtype != torch.bfloat16 or dy.dtype != torch.bfloat16:
        return "x and dy must be bf16"
    if not (_aligned(x) and _aligned(dy)):
        return "x or dy has a non-unit last stride or is not 16-byte aligned"
    return None


def layout_unsupported(x, dy, weight, slots) -> str | None:
    """Why these tensors' dtypes and layouts do not suit the kernel (None: they do)."""
    return weight_unsupported(weight, slots) or tokens_unsupported(x, dy)


def weight_unsupported(weight, slots, multiple: int = BLOCK_SIZE, kinds: tuple = KINDS,
                       kind_names: str = "bf16, int8, al8") -> str | None:
    """Why a weight and its state slots do not suit the kernel (None: they do); ``multiple``,
    ``kinds`` (named ``kind_names``): the block size and state storages of a kernel."""
    if weight.dtype != torch.bfloat16:
        return "the weight must be bf16"
    n, k = weight.shape
    if n % multiple or k % multiple:
        return f"weight shape {tuple(weight.shape)} is not a multiple of {multiple}"
    if weight.stride() != (k, 1) or not _aligned(weight):
        return "weight is not row-major and 16-byte aligned"
    for slot in slots:
        if storage_kind(slot) not in kinds:
            return f"a state slot is neither {kind_names} nor absent"
        codes = slot.codes if isinstance(slot, QuantisedSlot) else slot
        if codes is not None and (codes.stride() != weight.stride() or not _aligned(codes)):
            return "a state slot is not laid out as the weight"
        if isinstance(slot, QuantisedSlot) and \
                (tuple(slot.meta.shape), slot.meta.stride()) != codecs.meta_layout(n, k, slot.codec):
            return "8-bit metadata is not laid out as QuantisedSlot.empty_like allocates it"
    return None


def persistent_launch_arguments(x, dy, weight, slots, args, stats, rule_update, stochastic, ablate: int = 0):
    """(positional arguments, constexpr arguments, compile options) of the launch for these
    tensors; tests compile exactly this for the GPU without one (tests/test_kernel_compiles.py).
    Arguments as fused_update.fused_launch_arguments', ``rule_update`` the rule's jitted update;
    ``ablate``: benchmarks only (persistent_update.MAINLOOP_ONLY / EPILOGUE_ONLY)."""
    n, k = weight.shape
    # bf16 as bits; 8-bit codes as int8 (al8's uint8 ones too: the slots share one ring of one
    # dtype, and the kernel only moves their bits); absent: any
    stored = [weight.view(torch.int16)]
    stored += [stored[0] if s is None else s.codes.view(torch.int8) if isinstance(s, QuantisedSlot)
               else s.view(torch.int16) for s in slots]
    descs = [tensor_descriptor(x), tensor_descriptor(dy)] + [tensor_descriptor(t) for t in stored]
    metas = [s.meta if isinstance(s, QuantisedSlot) else stats for s in slots]
    kinds = [storage_kind(s) for s in slots]
    constexprs = dict(RULE_UPDATE=rule_update, S0=kinds[0], S1=kinds[1], S2=kinds[2], STOCHASTIC=stochastic,
                      NUM_BUF=NUM_BUF, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, ABLATE=ablate)
    options = dict(num_warps=4, maxnreg=MAXNREG, enable_fp_fusion=False)  # no FMA contraction, as the other kernel
    return descs + metas + [args, stats, n, k, x.shape[0]], constexprs, options


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _grid(weight: torch.Tensor) -> tuple[int]:
    n, k = weight.shape
    return (min(multiprocessors(weight.device), triton.cdiv((n // BLOCK_SIZE) * (k // BLOCK_SIZE), 2)),)  # two lanes


def launch_persistent(x, dy, weight, slots, args, stats, rule_update, stochastic, ablate: int = 0) -> None:
    """One fused step of one layer by the persistent kernel (arguments as persistent_launch_arguments')."""
    positional, constexprs, options = persistent_launch_arguments(x, dy, weight, slots, args, stats, rule_update,
                                                                  stochastic, ablate)
    launch_compiled(persistent_update_kernel, _grid(weight), positional, constexprs, options)


class PersistentLaunch:
    """One layer's launches of the persistent kernel, with what stays the same from step to
    step built once: the TMA descriptors of its weight and states (encoded once where the
    kernel is launched directly, direct_launch.py), the constexprs, the grid. A step then
    finds or encodes the descriptors of its tokens and launches (``launch(x, dy, args,
    stats)``, False where the tokens do not suit the kernel); ``weight`` and ``slots`` must
    stay where they are (the caller rebinds when a state is allocated or loaded)."""

    def __init__(self, weight, slots, stats, rule_update, stochastic):
        positional, self.constexprs, self.options = persistent_launch_arguments(
            weight, weight, weight, slots, stats, stats, rule_update, stochastic)  # tokens and args: per step
        self.fixed = positional[2:9]  # the weight's and states' descriptors, the states' metadata
        self.n, self.k = weight.shape
        self.grid = _grid(weight)
        self._again: dict = {}  # what Triton specialises on that may change: token count, args' alignment
        self._token_templates: dict = {}  # dtype -> a checked descriptor of tokens, reused for others
        self._expanded: dict = {}  # token_key -> a token descriptor, encoded (None: not the kernel's)

    def _token_descriptor(self, t: torch.Tensor):
        """A descriptor of ``t`` (bf16, TMA-aligned: tokens_unsupported checked it) made from
        a checked one of the same dtype without Triton's checks again: they were most of the
        host time of building it, twice a launch."""
        template = self._token_templates.get(t.dtype)
        if template is None:
            checked = tensor_descriptor(t)
            # its fields without the tensor, which the template must not keep alive
            self._token_templates[t.dtype] = (type(checked), {**checked.__dict__, "base": None})
            return checked
        cls, fields = template
        descriptor = object.__new__(cls)
        descriptor.__dict__.update(fields, base=t, shape=t.shape, strides=t.stride())
        return descriptor

    @staticmethod
    def token_key(position: int, t: torch.Tensor) -> tuple:
        """What the encoding of ``t``'s descriptor at kernel argument ``position`` depends on,
        and all that tokens_unsupported reads."""
        return (position, t.data_ptr(), t.shape, t.stride(), t.dtype)

    def _expanded_tokens(self, direct, position: int, t: torch.Tensor) -> list | None:
        """``t``'s descriptor as the C launcher takes it (None: the kernel cannot take ``t``),
        encoded once for each place the tensor is at (token_key): an eager step's tokens come
        back to the same addresses step after step."""
        key = self.token_key(position, t)
        expanded = self._expanded.get(key, False)
        if expanded is False:
            if len(self._expanded) >= _TOKEN_PLACES:
                self._expanded.clear()
            expanded = None if tokens_unsupported(t, t) else direct.expand(position, self._token_descriptor(t))
            self._expanded[key] = expanded
        return expanded

    def __call__(self, x, dy, args, stats) -> bool:
        """Launch the step; False (nothing launched) where the kernel cannot take ``x`` or ``dy``."""
        t = x.shape[0]
        spec = (int_spec(t), tensor_spec(args), tensor_spec(stats))
        again = self._again.get(spec)
        if again is not None and again[1] is not None and not again[0].hooked():
            direct, fixed = again
            x_desc, dy_desc = self._expanded_tokens(direct, 0, x), self._expanded_tokens(direct, 1, dy)
            if x_desc is None or dy_desc is None:
                return False
            direct.launch_expanded(self.grid, [*x_desc, *dy_desc, *fixed, args, stats, self.n, self.k, t])
            return True
        if tokens_unsupported(x, dy):
            return False
        positional = [self._token_descriptor(x), self._token_descriptor(dy), *self.fixed, args, stats,
                      self.n, self.k, t]
        if again is not None:
            again[0](self.grid, positional)
            return True
        launch = launch_compiled(persistent_update_kernel, self.grid, positional, self.constexprs, self.options)
        fixed = None
        if isinstance(launch, DirectLauncher):  # the weight's and states' descriptors encoded once
            descriptors, metas = self.fixed[:4], self.fixed[4:]
            fixed = [a for i, d in enumerate(descriptors) for a in launch.expand(2 + i, d)] + list(metas)
        self._again[spec] = (launch, fixed)
        return True
