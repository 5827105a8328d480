"""The kernels' per-step arguments, and their record for a step replayed as a CUDA graph.

Every stepped tensor's launch reads a small int32 tensor: the rule's fp32 constants (as
bit patterns), the step count, the layer's rounding salt and its first row. Eagerly each
stepped tensor has one device row on a CUDA device, refilled by one asynchronous copy from
a pinned host row (``ArgsRow``), elsewhere a fresh tensor (``pack_args``). A captured step
cannot run Python at replay, so while it is captured ``next_launch_args`` hands out rows of
one device table instead and records who owns each row; before every replay
``ArgsTable.refresh`` runs the rules' host work in the captured order (the step counts
advance exactly as in the eager step) and copies the whole table to the GPU at once.
"""

from __future__ import annotations

import struct
import weakref
from contextlib import contextmanager

import torch

from .rules import NUM_SCALARS

ARGS_LEN = NUM_SCALARS + 3  # constants, step, salt, first row
# A table row's stride: 64 bytes keeps every row 16-byte aligned, as a fresh tensor is
# (Triton compiles a variant per pointer alignment: a misaligned row would need another)
ROW_STRIDE = 16


def _int32(value: int) -> int:
    """The int32 holding ``value``'s low 32 bits."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def args_words(scalars: list[float], step: int, salt: int, row0: int = 0) -> list[int]:
    """The argument words: fp32 bit patterns of the constants, step, salt, and the first
    row's index in the whole weight (a data-parallel band: the rounding bits of an element
    depend on its place in the whole weight, not in the band)."""
    if len(scalars) != NUM_SCALARS:
        raise ValueError(f"a rule returned {len(scalars)} constants; the kernels take {NUM_SCALARS}")
    return [*struct.unpack(f"{NUM_SCALARS}i", struct.pack(f"{NUM_SCALARS}f", *scalars)),
            *(_int32(v) for v in (step, salt, row0))]


def pack_args(scalars: list[float], step: int, salt: int, device, row0: int = 0) -> torch.Tensor:
    """The kernel's argument tensor on ``device``: one host tensor, one copy."""
    return torch.tensor(args_words(scalars, step, salt, row0), dtype=torch.int32).to(device, non_blocking=True)


class ArgsRow:
    """One stepped tensor's arguments on a CUDA device, refilled for every launch: the
    words go into one of two pinned host rows, which one asynchronous copy moves to the
    device row. Launches of one stream read the device row in order, so one suffices; an
    event per host row keeps it from being overwritten before its copy has left."""

    def __init__(self, device: torch.device):
        self.device = device
        host = torch.zeros(2, ROW_STRIDE, dtype=torch.int32, pin_memory=True)
        self._host_rows = list(host)  # views made once: a view costs host time at every launch
        self._words = host.numpy()
        self._device = torch.zeros(ROW_STRIDE, dtype=torch.int32, device=device)
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._next = 0
        self.row = self._device[:ARGS_LEN]

    def write(self, words: list[int]) -> torch.Tensor:
        i, self._next = self._next, 1 - self._next
        self._copied[i].synchronize()  # the copy out of this host row, two launches ago, has left
        self._words[i, :ARGS_LEN] = words
        self._device.copy_(self._host_rows[i], non_blocking=True)
        self._copied[i].record(torch.cuda.current_stream(self._device.device))  # the copy's stream
        return self.row


_rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ForgeState -> its ArgsRow
_recording: ArgsTable | None = None


def next_launch_args(rule, group: dict, state, salt: int, device, row0: int = 0) -> torch.Tensor:
    """Advance ``state`` by one step of ``rule`` and return the launch's arguments; while a
    step is captured, a row of the capture's table (filled at each replay)."""
    if _recording is not None:
        return _recording.add(rule, group, state, salt, row0)
    device = torch.device(device)
    if device.type != "cuda":
        return pack_args(rule.prepare(group, state.host), state.step, salt, device, row0)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a fused step is being captured into a CUDA graph outside forge_hf's own capture: each replay "
            "would reuse this step's learning rate and step count. Capture with forge_hf.GraphedStep (or "
            "ForgeTrainer's optim_args cuda_graph=true), which refreshes them before every replay")
    scalars = rule.prepare(group, state.host)
    row = _rows.get(state)
    if row is None or row.device != device:
        row = _rows[state] = ArgsRow(device)
    return row.write(args_words(scalars, state.step, salt, row0))


class ArgsTable:
    """The arguments of every launch of one captured step: a device table the graph reads,
    a pinned host twin, and the (rule, group, state, salt, row) of each row."""

    def __init__(self, capacity: int, device):
        self._device = torch.zeros(capacity, ROW_STRIDE, dtype=torch.int32, device=device)
        pinned = torch.device(device).type == "cuda"
        self._host = torch.zeros(capacity, ROW_STRIDE, dtype=torch.int32, pin_memory=pinned)
        self.device_rows = self._device[:, :ARGS_LEN]  # what the kernels read
        self.entries: list[tuple] = []
        self._copied = None  # the event after the last copy out of the host table

    def add(self, rule, group, state, salt, row0) -> torch.Tensor:
        i = len(self.entries)
        if i == len(self.device_rows):
            raise RuntimeError(
                f"the captured step launched more than {i} rule steps, the table's capacity (one per "
                "trainable tensor): a tensor stepped twice in one step cannot be captured; run it eagerly")
        self.entries.append((rule, group, state, salt, row0))
        return self.device_rows[i]

    @contextmanager
    def recording(self):
        """Inside: ``next_launch_args`` gives out this table's rows and runs no host work (the
        capture runs the step's Python, but no step happens: counters stay put)."""
        global _recording
        if _recording is not None:
            raise RuntimeError("a step is already being captured: captures cannot be nested")
        _recording = self
        try:
            yield self
        finally:
            _recording = None

    def refresh(self) -> None:
        """One step's host work for every row, in captured order, then one copy to the device."""
        before = [dict(state.host) for _, _, state, _, _ in self.entries]
        words = []
        try:
            for rule, group, state, salt, row0 in self.entries:
                words.extend(args_words(rule.prepare(group, state.host), state.step, salt, row0))
        except Exception:  # a bad hyperparameter: no counter moves, the step is not run
            for (_, _, state, _, _), host in zip(self.entries, before):
                state.host = host
            raise
        n = len(self.entries)
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has left the host table: it may be overwritten
        self._host[:n, :ARGS_LEN] = torch.tensor(words, dtype=torch.int32).view(n, ARGS_LEN)
        self._device[:n].copy_(self._host[:n], non_blocking=True)  # whole rows: one contiguous copy
        if self.device_rows.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
