"""What both Gluon kernels (gluon/persistent_update.py, gluon/wide_update.py) need of a
device, a weight and its tokens (select.py chooses between them), and one layer's
launches of either (LayerLaunch): the weight's and states' arguments bound once, the tokens'
descriptors kept by address (docs/kernels.md). ``weight`` and ``slots`` must stay where they
are (the caller rebinds when a state is allocated or loaded).
"""

from __future__ import annotations

import functools

import torch

from ...core import codecs
from ...core.codecs import QuantisedSlot, storage_kinds
from ..runtime.compiled import int_spec, launch_compiled, tensor_spec
from ..runtime.direct_launch import DirectLauncher

KINDS = (codecs.NONE, codecs.BF16, codecs.ABSMAX8, codecs.ABSMAX8_FLOORED, codecs.AL8)  # fp32 states: not here
_TOKEN_PLACES = 16  # token descriptors a layer keeps encoded (a few places a step; eval and train differ)


def aligned(t: torch.Tensor) -> bool:
    """What a TMA descriptor needs: unit last stride, 16-byte base and row stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def tokens_unsupported(x, dy) -> str | None:
    """Why a step's tokens (x, dy) do not suit the Gluon kernels (None: they do)."""
    if x.dtype != torch.bfloat16 or dy.dtype != torch.bfloat16:
        return "x and dy must be bf16"
    if not (aligned(x) and aligned(dy)):
        return "x or dy has a non-unit last stride or is not 16-byte aligned"
    return None


def device_unsupported(device: torch.device) -> str | None:
    """Why the Gluon kernels cannot run on ``device`` (None: they can)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "not a Hopper GPU (wgmma and TMA as compiled for sm_90)"
    return None


def weight_layout_unsupported(weight, slots, kinds, multiple: int) -> str | None:
    """Why a weight and its state slots (of storage ``kinds``) do not suit a Gluon kernel whose
    tiles are ``multiple`` wide (None: they do)."""
    if weight.dtype != torch.bfloat16:
        return "the weight must be bf16"
    n, k = weight.shape
    if n % multiple or k % multiple:
        return (f"weight shape {tuple(weight.shape)} is not a multiple of {multiple}: both sides must be "
                f"multiples of {multiple}")
    if weight.stride() != (k, 1) or not aligned(weight):
        return "weight is not row-major and 16-byte aligned"
    for slot, kind in zip(slots, kinds):
        if kind not in KINDS:
            return ("a state slot is neither bf16, int8, al8 nor absent (4-bit codes, factored second moments: the "
                    "Triton kernel)")
        codes = slot.codes if isinstance(slot, QuantisedSlot) else slot
        if codes is not None and (codes.stride() != weight.stride() or not aligned(codes)):
            return "a state slot is not laid out as the weight"
        if isinstance(slot, QuantisedSlot) and \
                (tuple(slot.meta.shape), slot.meta.stride()) != codecs.meta_layout(n, k, slot.codec):
            return "8-bit metadata is not laid out as QuantisedSlot.empty_like allocates it"
    return None


def stored_tensors(weight, slots, stats) -> tuple[list, list, list]:
    """What both kernels read and write of a layer: (the weight's and each slot's stored
    tensor, the slots' metadata, the slots' storage kinds). bf16 as bits; 8-bit codes as int8
    (al8's uint8 ones too: the kernels only move their bits); an absent slot's stand-ins are
    the weight's bits and ``stats``, never read."""
    bits = weight.view(torch.int16)
    stored = [bits] + [bits if s is None else s.codes.view(torch.int8) if isinstance(s, QuantisedSlot)
                       else s.view(torch.int16) for s in slots]
    metas = [s.meta if isinstance(s, QuantisedSlot) else stats for s in slots]
    return stored, metas, storage_kinds(slots)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class LayerLaunch:
    """``launch(x, dy, args, stats)``: the step, False (nothing launched) where the kernel
    cannot take the tokens. A subclass names its kernel and how it is launched: ``kernel``,
    ``launch_arguments`` (as persistent_launch.persistent_launch_arguments: positional
    arguments, constexprs, options, the weight's and states' seven arguments after the
    tokens' descriptors), ``grid_for`` (the grid for a weight), ``describe_tokens`` (a checked
    TMA descriptor of a (tokens, features) tensor) and ``fixed_descriptors`` (how many of the
    seven are TMA descriptors, first)."""

    kernel = None
    launch_arguments = None
    grid_for = None
    describe_tokens = None
    fixed_descriptors = 0

    def __init__(self, weight, slots, stats, rule_update, stochastic):
        positional, self.constexprs, self.options = self.launch_arguments(
            weight, weight, weight, slots, stats, stats, rule_update, stochastic)  # tokens and args: per step
        self.fixed = positional[2:9]
        self.grid = self.grid_for(weight)
        self.n, self.k = weight.shape
        self._again: dict = {}  # what Triton specialises on that may change: token count, args' alignment
        self._token_templates: dict = {}  # dtype -> a checked descriptor of tokens, reused for others
        self._expanded: dict = {}  # token_key -> a token descriptor, encoded (None: not the kernel's)

    def _token_descriptor(self, t: torch.Tensor):
        """A descriptor of ``t`` (bf16, TMA-aligned: tokens_unsupported checked it) made from
        a checked one of the same dtype without Triton's checks again: they were most of the
        host time of building it, twice a launch."""
        template = self._token_templates.get(t.dtype)
        if template is None:
            checked = self.describe_tokens(t)
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
        launch = launch_compiled(self.kernel, self.grid, positional, self.constexprs, self.options)
        fixed = None
        if isinstance(launch, DirectLauncher):  # the weight's and states' descriptors encoded once
            descriptors, rest = self.fixed[:self.fixed_descriptors], self.fixed[self.fixed_descriptors:]
            fixed = [a for i, d in enumerate(descriptors) for a in launch.expand(2 + i, d)] + list(rest)
        self._again[spec] = (launch, fixed)
        return True
