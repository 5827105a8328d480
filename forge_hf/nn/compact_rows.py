"""The gradient of an embedding as the rows a batch touched: ``CompactRows`` (their ids, their
gradient rows), built in backward, summed over backwards, and laid out a chunk of rows at a
time for the step (nn/embedding.py, optim/embedding_step.py).

Every size is known on the host before any kernel runs (a batch's token count, capped by
the vocabulary), with no ``torch.unique``: nothing waits for the GPU, and a step so built
can be captured as a CUDA graph. Slots the batch leaves over (fewer distinct ids than
tokens) and padding tokens carry the id ``n_rows``, one past the last row, and a zero row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompactRows:
    """``ids`` (S,) int64, each row index once, or ``n_rows`` for an unused slot; ``rows``
    (S, K): the gradient of each id's row (zero for unused slots)."""

    ids: torch.Tensor
    rows: torch.Tensor
    n_rows: int


def _sum_by_id(ids: torch.Tensor, values: torch.Tensor, n_rows: int) -> CompactRows:
    """Each distinct id once, with the sum of its ``values`` rows in ``values``' dtype.

    fp32 rows (a backward's tokens) are summed as torch's dense embedding backward sums them:
    in the order the ids come on the CPU, and on CUDA by sorted segments with no atomics, so a
    step's bits do not change from run to run. Lower-precision rows come two to an id at most
    (``add_rows``), which adds in any order to the same bits."""
    sorted_ids, order = torch.sort(ids, stable=True)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot_sorted = first.cumsum(0) - 1
    size = min(ids.numel(), n_rows + 1)  # distinct ids, the padding id among them, at most
    slot = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
    # one slot's ids are all equal: which write lands does not matter
    out_ids = torch.full((size,), n_rows, dtype=torch.int64, device=ids.device).scatter_(0, slot_sorted, sorted_ids)
    if values.dtype == torch.float32:
        rows = torch.ops.aten.embedding_dense_backward(values, slot, size, -1, False)
    else:
        rows = values.new_zeros(size, values.shape[1]).index_add_(0, slot, values)
    rows.masked_fill_((out_ids == n_rows)[:, None], 0)  # padding tokens give no gradient, as in torch
    return CompactRows(out_ids, rows, n_rows)


def compact_rows(ids: torch.Tensor, dy: torch.Tensor, n_rows: int, padding_idx: int | None,
                 dtype: torch.dtype) -> CompactRows:
    """The gradient of an (n_rows, K) embedding looked up at ``ids``, whose output gradient
    is ``dy``: summed in fp32, stored in ``dtype`` (the weight's, as a dense gradient is)."""
    ids = ids.reshape(-1).to(torch.int64)
    dy = dy.reshape(ids.numel(), -1)
    if padding_idx is not None:
        ids = ids.masked_fill(ids == padding_idx, n_rows)
    rows = _sum_by_id(ids, dy.float(), n_rows)
    rows.rows = rows.rows.to(dtype)
    return rows


def add_rows(held: CompactRows | None, new: CompactRows) -> CompactRows:
    """``held`` + ``new``: each row's two parts added once in their dtype, as a dense
    gradient accumulates (``grad += new``)."""
    if held is None:
        return new
    return _sum_by_id(torch.cat([held.ids, new.ids]), torch.cat([held.rows, new.rows]), new.n_rows)


def chunk_gradient(held: CompactRows, r0: int, buffer: torch.Tensor) -> torch.Tensor:
    """The dense gradient of rows [r0, r0 + len(buffer) - 1) written into ``buffer`` (its last
    row takes every id outside the chunk and is not part of the result)."""
    n = buffer.shape[0] - 1
    local = held.ids - r0
    local = torch.where((local >= 0) & (local < n), local, n)
    buffer.zero_()
    buffer.index_copy_(0, local, held.rows)  # distinct ids: copies, no additions
    return buffer[:n]


def add_into_dense(held: CompactRows, grad: torch.Tensor) -> None:
    """Add ``held`` to the dense gradient ``grad`` (the weight was also read elsewhere)."""
    ids = held.ids.clamp(max=held.n_rows - 1)  # unused slots are zero rows
    grad.index_add_(0, ids, held.rows.to(grad.dtype))
