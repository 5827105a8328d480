"""Triton: the rule's pass over many small 1-d tensors in one launch (ForgeOptimizer's norms
and biases), from an int64 table of their addresses and a work list of 64-element tiles; the
fused kernel's rule pass on a (1, n) view, with its bits (docs/kernels.md).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ...core import codecs
from ...core.codecs import storage_kinds
from ..runtime.compiled import launch_compiled
from ..runtime.pinned_ring import PinnedRing, StreamOrder
from .bf16_bits import decode_value, element_hash, store_value
from .fused_update import INTERPRETER, RULE_UPDATES, compile_options
from .state_tiles import FP32, NONE, decode_state, store_state
from .tile_step import load_step_args

TILE = 64  # elements a tile: a 1-d tensor's tile in the fused kernel's (1, n) view
TILES = 16  # tiles a program
FIELDS = 8  # int64 words a tensor's row: weight, gradient, three slots, arguments, length, unused
LENGTH = 6
MAX_ELEMENTS = 1 << 20  # larger tensors (an embedding) keep a launch of their own
# Tables an eager launch sets aside for the captures after it: ForgeTrainer captures a step per
# batch shape (its max_graphs), each with a table of its own, with no eager step between them
SPARE_TABLES = 32


@triton.jit
def _pointer(row_ptr, field: tl.constexpr, KIND: tl.constexpr):
    """The address in a tensor's row as a pointer to how that slot is stored."""
    address = tl.load(row_ptr + field)
    if KIND == FP32:
        ptr = address.to(tl.pointer_type(tl.float32))
    else:  # bf16 bit patterns; a missing slot's pointer is never read
        ptr = address.to(tl.pointer_type(tl.int16))
    return ptr


@triton.jit
def multi_tensor_rule_kernel(
    table_ptr, work_ptr, stats_ptr,
    RULE_UPDATE: tl.constexpr,
    W_KIND: tl.constexpr, G_BF16: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    STOCHASTIC: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    tensor = tl.load(work_ptr + 2 * pid)
    first = tl.load(work_ptr + 2 * pid + 1).to(tl.int32)  # tensors are below MAX_ELEMENTS
    row_ptr = table_ptr + tensor * 8  # FIELDS words a row
    n = tl.load(row_ptr + 6).to(tl.int32)  # its LENGTH word
    w_ptr = _pointer(row_ptr, 0, W_KIND)
    s0_ptr = _pointer(row_ptr, 2, S0)
    s1_ptr = _pointer(row_ptr, 3, S1)
    s2_ptr = _pointer(row_ptr, 4, S2)
    if G_BF16:
        g_ptr = tl.load(row_ptr + 1).to(tl.pointer_type(tl.bfloat16))
    else:
        g_ptr = tl.load(row_ptr + 1).to(tl.pointer_type(tl.float32))
    c, step, salt, row0 = load_step_args(tl.load(row_ptr + 5).to(tl.pointer_type(tl.int32)))

    offs = first + tl.arange(0, TILES)[:, None] * TILE + tl.arange(0, TILE)[None, :]
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sumsq = tl.sum(g * g, axis=1)
    ok = (sumsq == sumsq) & (sumsq < float("inf"))  # tile by tile, as tile_step.finite_sumsq
    tl.atomic_add(stats_ptr, tl.sum(tl.where(ok, sumsq, 0.0), axis=0), sem="relaxed")
    tl.atomic_add(stats_ptr + 1, tl.sum((ok == 0).to(tl.float32), axis=0), sem="relaxed")

    w = decode_value(tl.load(w_ptr + offs, mask=mask, other=0), W_KIND != FP32)
    zeros = tl.zeros((TILES, TILE), dtype=tl.float32)
    s0, s1, s2 = zeros, zeros, zeros
    if S0 != NONE:
        s0 = decode_state(tl.load(s0_ptr + offs, mask=mask, other=0), (0.0, 0.0), S0, TILES, TILE)
    if S1 != NONE:
        s1 = decode_state(tl.load(s1_ptr + offs, mask=mask, other=0), (0.0, 0.0), S1, TILES, TILE)
    if S2 != NONE:
        s2 = decode_state(tl.load(s2_ptr + offs, mask=mask, other=0), (0.0, 0.0), S2, TILES, TILE)
    w, s0, s1, s2 = RULE_UPDATE(w, g, s0, s1, s2, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9],
                                c[10], c[11])

    if STOCHASTIC:  # the element's index in the (1, n) view: row0 * n + column
        h = element_hash((row0 * n + offs).to(tl.uint32, bitcast=True), salt, step)
    else:
        h = 0
    keep = mask & ok[:, None]
    store_value(w_ptr, offs, w, keep, h, 0, W_KIND != FP32, STOCHASTIC)
    if S0 != NONE:
        store_state(s0_ptr, s0_ptr, offs, s0, mask, keep, 0, False, h, 1, S0, STOCHASTIC, TILES, TILE)
    if S1 != NONE:
        store_state(s1_ptr, s1_ptr, offs, s1, mask, keep, 0, False, h, 2, S1, STOCHASTIC, TILES, TILE)
    if S2 != NONE:
        store_state(s2_ptr, s2_ptr, offs, s2, mask, keep, 0, False, h, 3, S2, STOCHASTIC, TILES, TILE)


_W_KINDS = {torch.float32: codecs.FP32, torch.bfloat16: codecs.BF16}
_PLAIN_KINDS = {codecs.NONE, codecs.FP32, codecs.BF16}


def batch_kind(weight: torch.Tensor, grad: torch.Tensor, slots: list) -> tuple | None:
    """The constexprs a batch shares, or None where the tensor needs a launch of its own: not
    1-d and contiguous, too large, an unsupported dtype, or 8-bit state."""
    if (weight.dim() != 1 or weight.stride(0) != 1 or grad.dim() != 1 or grad.stride(0) != 1
            or weight.numel() > MAX_ELEMENTS or weight.dtype not in _W_KINDS
            or grad.dtype not in (torch.float32, torch.bfloat16)):
        return None
    kinds = storage_kinds(slots)
    if any(k not in _PLAIN_KINDS for k in kinds):
        return None
    return (weight.device, _W_KINDS[weight.dtype], grad.dtype == torch.bfloat16, kinds)


class MultiTensorRulePass:
    """One launch stepping every tensor added since the last ``launch``: ``add(weight, grad,
    slots, args)`` for each (all of one ``batch_kind``), then ``launch(stats)``, within the
    step that holds those gradients. The table goes to the device through a PinnedRing.

    A CUDA graph captures the table's copy from pinned memory, which each replay reads again:
    a capture takes a pinned buffer and device table of its own (one of SPARE_TABLES made at an
    eager launch, since a capture cannot allocate pinned memory safely), kept as long as this
    object. Its work list and compiled kernel come from an eager launch of the same tensors too."""

    def __init__(self, kind: tuple, rule_name: str, stochastic: bool):
        self.device, w_kind, g_bf16, kinds = kind
        self._cuda = self.device.type == "cuda"
        self._constexprs = dict(RULE_UPDATE=RULE_UPDATES[rule_name], W_KIND=w_kind, G_BF16=g_bf16,
                                S0=kinds[0], S1=kinds[1], S2=kinds[2], STOCHASTIC=stochastic,
                                TILE=TILE, TILES=TILES)
        self._options = compile_options(dict(num_warps=4, num_stages=1))
        self._rows: list[list[int]] = []
        self._work: dict[tuple, torch.Tensor] = {}  # tensor lengths -> device work list
        self._table = None
        self._ring = None
        self._again = None
        self._streams = StreamOrder(self.device) if self._cuda else None
        self._spare = None  # (pinned rows, device tables), SPARE_TABLES of each, for the next captures
        self._spare_used = 0
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] = []  # what captured graphs copy and read

    def add(self, weight, grad, slots, args) -> None:
        pointers = [s.data_ptr() if s is not None else 0 for s in slots]
        self._rows.append([weight.data_ptr(), grad.data_ptr(), *pointers, args.data_ptr(), weight.numel(), 0])

    def launch(self, stats: torch.Tensor) -> None:
        rows, self._rows = self._rows, []
        if not rows:
            return
        lengths = tuple(r[LENGTH] for r in rows)
        work = self._work.get(lengths)
        if self._cuda and torch.cuda.is_current_stream_capturing():
            table = self._captured_table(rows, work)
        else:
            if work is None:
                work = self._work[lengths] = self._work_list(lengths)
            if self._cuda:
                self._streams.follow()
            table = self._table_for(rows)
            if self._cuda and (self._spare is None or self._spare_used == SPARE_TABLES
                               or self._spare[0].shape[1] < len(rows)):
                shape = (SPARE_TABLES, len(rows), FIELDS)
                self._spare = (torch.zeros(shape, dtype=torch.int64, pin_memory=True),
                               torch.zeros(shape, dtype=torch.int64, device=self.device))
                self._spare_used = 0
        grid = (work.shape[0],)
        positional = [table, work, stats]
        if INTERPRETER or not self._cuda:
            multi_tensor_rule_kernel[grid](*positional, **self._constexprs, **self._options)
        elif self._again is None:
            self._again = launch_compiled(multi_tensor_rule_kernel, grid, positional, self._constexprs,
                                          self._options)
        else:
            self._again(grid, positional)

    def _captured_table(self, rows: list, work) -> torch.Tensor:
        """The table of a step being captured: the spare buffers, the graph's from now on."""
        if work is None or self._again is None or self._spare is None or self._spare_used == SPARE_TABLES \
                or self._spare[0].shape[1] < len(rows):
            raise RuntimeError(
                f"the one launch of {len(rows)} small tensors' rule steps is first needed while a CUDA graph is "
                f"captured (or after {SPARE_TABLES} captures since the last eager step), where its table and kernel "
                "cannot be made: run an eager step with the same model and optimizer before capturing "
                "(GraphedStep's warmup_steps)")
        host, table = self._spare[0][self._spare_used], self._spare[1][self._spare_used]
        self._spare_used += 1
        self._captured.append((host, table))
        host.numpy()[:len(rows)] = np.asarray(rows, dtype=np.int64)
        table = table[:len(rows)]
        table.copy_(host[:len(rows)], non_blocking=True)
        return table

    def _work_list(self, lengths: tuple) -> torch.Tensor:
        """(tensor, first element) of every program."""
        span = TILE * TILES
        work = [(t, first) for t, n in enumerate(lengths) for first in range(0, n, span)]
        return torch.tensor(work, dtype=torch.int64).to(self.device)

    def _table_for(self, rows: list) -> torch.Tensor:
        """The device table holding ``rows``, by one copy from a pinned host buffer."""
        if self._table is None or self._table.shape[0] < len(rows):
            capacity = max(64, 2 * len(rows))
            self._table = torch.zeros(capacity, FIELDS, dtype=torch.int64, device=self.device)
            self._ring = PinnedRing(capacity, FIELDS, torch.int64, self.device)
        self._ring.take(slice(0, len(rows)))[:] = np.asarray(rows, dtype=np.int64)
        table = self._table[:len(rows)]
        self._ring.send(table)
        return table
