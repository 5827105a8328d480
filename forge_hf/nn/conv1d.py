"""ForgeConv1D: transformers' Conv1D (GPT-2 family, weight stored (in, out)) with the FORGE
fused backward-and-optimizer step. Same machinery as ForgeLinear; the kernel reads the
weight and its states through a transposed view, so nothing is copied."""

from __future__ import annotations

import torch
from transformers.pytorch_utils import Conv1D

from ..core.config import ForgeConfig, resolve_config
from .linear import FusedWeightMixin


class ForgeConv1D(FusedWeightMixin, Conv1D):
    """Conv1D with the FORGE fused backward-and-optimizer step."""

    forge_transposed = True

    def __init__(self, nf: int, nx: int, config: ForgeConfig | None = None, **options):
        config = resolve_config(config, options)
        Conv1D.__init__(self, nf, nx)
        self.forge_setup(config)

    @classmethod
    def from_conv1d(cls, conv: Conv1D, config: ForgeConfig | None = None, **options) -> ForgeConv1D:
        """A ForgeConv1D that shares ``conv``'s Parameter objects (no copy) and hooks; the
        arguments are ForgeLinear.from_linear's."""
        if not isinstance(conv, Conv1D):
            raise TypeError(f"from_conv1d needs a transformers Conv1D, got {type(conv).__name__}")
        return cls.forge_adopt(conv, resolve_config(config, options))

    def to_conv1d(self) -> Conv1D:
        """A plain Conv1D with the same Parameter objects and hooks."""
        return self.forge_release(Conv1D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # compiled: the fused op notes the call when it runs
            self.forge_note_call()
        if not self.forge_active():
            return Conv1D.forward(self, x)
        return self.forge_forward(x)

    def __repr__(self) -> str:
        return f"ForgeConv1D(nf={self.nf}, nx={self.nx}, {self.forge_extra_repr()})"
