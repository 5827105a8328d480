"""A range of rows of a weight's state slots as the kernels take a weight of those rows alone
(optim/embedding_step.py's chunks): fp32/bf16 slots and a QuantisedSlot's codes (8-bit, or
4-bit packed along the row) are views of the rows; its metadata is staged.

Why staged: the kernels index metadata block column by block column of the weight they are
given (codecs.meta_layout: a block column's rows are one contiguous run of that weight's
row count), so the rows of a whole slot's metadata, a run of the whole weight's row count
apart, are not a layout they take. The chunk's metadata (a value a block of 64 elements) is
copied into a buffer of the chunk's own layout before its launch and back after it,
which leaves the kernels and the codecs as they are and works for any codec whose metadata
is (rows, blocks, width) in logical coordinates.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .codecs import QuantisedSlot, meta_layout


class RowSlots:
    """``slots`` (kernel-ready) for rows ``rows`` of (n_rows, n_cols) logical slots;
    ``load()`` before the launch, ``store()`` after it. ``staging(index, numel, like)``
    gives slot ``index``'s reused flat buffer of ``numel`` elements (a Staging)."""

    def __init__(self, slots: list, rows: slice, n_cols: int, staging):
        self.slots, self._pairs = [], []  # pairs: (the slot's metadata rows, their staged copy)
        m = rows.stop - rows.start
        for i, s in enumerate(slots):
            if not isinstance(s, QuantisedSlot):
                self.slots.append(None if s is None else s[rows])
                continue
            shape, strides = meta_layout(m, n_cols, s.codec)
            numel = 1 + sum((sh - 1) * st for sh, st in zip(shape, strides))  # the layout's extent
            staged = staging(i, numel, s.meta).as_strided(shape, strides)
            self._pairs.append((s.meta[rows], staged))
            self.slots.append(replace(s, codes=s.codes[rows], meta=staged))

    def load(self) -> None:
        for rows, staged in self._pairs:
            staged.copy_(rows)

    def store(self) -> None:
        for rows, staged in self._pairs:
            rows.copy_(staged)


class Staging:
    """Flat buffers by (slot index, size, device, dtype): each slot of a launch has its own,
    reused by the next launch of that size. Never regrown, so a launch bound to one stays
    valid (a vocabulary's chunks come in two sizes at most: the whole ones and the last)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def __call__(self, index: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (index, numel, like.device, like.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer
