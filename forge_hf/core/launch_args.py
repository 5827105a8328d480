"""The kernels' per-step arguments, and their record for a step replayed as a CUDA graph.

Every stepped tensor's launch reads a small int32 tensor: the rule's fp32 constants (as
bit patterns), the step count, the layer's rounding salt and its first row. Eagerly each
stepped tensor has one device row on a CUDA device (``ArgsRow``), refilled by one
asynchronous copy from a row of the device's pinned ``HostRing``, elsewhere a fresh tensor
(``pack_args``). A captured step
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


class HostRing:
    """Pinned host rows for one CUDA device's eager launch arguments, written in turn: an
    asynchronous copy moves each to its tensor's device row, so a host row may be written
    again only once its copy has left. One event per half of the ring, recorded after the
    half's last copy and waited on before the half is written again (a ring's length of
    launches later), rather than two event calls per launch."""

    ROWS = 256

    def __init__(self, device: torch.device):
        self.device = device
        host = torch.zeros(self.ROWS, ROW_STRIDE, dtype=torch.int32, pin_memory=True)
        self._host_rows = list(host)  # views made once: a view costs host time at every launch
        self._words = host.numpy()
        self._next = 0
        self._left = [torch.cuda.Event(), torch.cuda.Event()]  # each half's copies have left
        self._stream: torch.cuda.Stream | None = None  # where this half's copies went
        self._raw_stream = None

    def copy(self, words: list[int], device_row: torch.Tensor) -> None:
        """``device_row`` (ROW_STRIDE int32 on this device) = ``words``, asynchronously on the
        current stream."""
        i = self._next
        half = i * 2 // self.ROWS
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        if i % (self.ROWS // 2) == 0:  # a half begins: its previous copies must have left
            self._left[half].synchronize()
            self._stream, self._raw_stream = torch.cuda.current_stream(self.device), raw
        elif raw != self._raw_stream:  # another stream: what this half sent on the last one must leave first
            self._left[half].record(self._stream)
            self._left[half].synchronize()
            self._stream, self._raw_stream = torch.cuda.current_stream(self.device), raw
        self._words[i, :len(words)] = words
        device_row.copy_(self._host_rows[i], non_blocking=True)
        self._next = (i + 1) % self.ROWS
        if self._next % (self.ROWS // 2) == 0:
            self._left[half].record(self._stream)


_rings: dict[int, HostRing] = {}  # CUDA device index -> its ring


class ArgsRow:
    """One stepped tensor's arguments on a CUDA device, refilled for every launch by a copy
    out of the device's HostRing. Launches of one stream read the device row in order, so
    one suffices."""

    def __init__(self, device: torch.device):  # a CUDA device with its index
        self.device = device
        self._device = torch.zeros(ROW_STRIDE, dtype=torch.int32, device=device)
        ring = _rings.get(device.index)
        if ring is None:
            ring = _rings[device.index] = HostRing(device)
        self._ring = ring
        self.row = self._device[:ARGS_LEN]

    def write(self, words: list[int]) -> torch.Tensor:
        self._ring.copy(words, self._device)
        return self.row


_rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ForgeState -> its ArgsRow
_recording: ArgsTable | None = None


def next_launch_args(rule, group: dict, state, salt: int, device, row0: int = 0) -> torch.Tensor:
    """Advance ``state`` by one step of ``rule`` and return the launch's arguments; while a
    step is captured, a row of the capture's table (filled at each replay)."""
    if _recording is not None:
        return _recording.add(rule, group, state, salt, row0)
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return pack_args(rule.prepare(group, state.host), state.step, salt, device, row0)
    if device.index is None:  # a tensor's device has its index; "cuda" alone means the current one
        device = torch.device("cuda", torch.cuda.current_device())
    if torch._C._cuda_isCurrentStreamCapturing():
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
        self._words = self._host.numpy()
        self.entries: list[tuple] = []
        self._static_rows = 0  # rows whose salt and first-row words are written
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
        """One step's host work for every row, in captured order, then one copy to the device.
        Rows of one rule, param group and host state (a step count shared by most tensors)
        get one ``prepare`` between them, and each state a copy of its result; the salt and
        first-row words never change and are written at the first refresh."""
        before = [state.host for _, _, state, _, _ in self.entries]  # replaced below, never mutated
        prepared: dict[tuple, tuple[dict, list[int], list[int]]] = {}  # key -> (host, words, rows)
        try:
            for i, (rule, group, state, _, _) in enumerate(self.entries):
                key = (id(rule), id(group), *state.host.items())
                hit = prepared.get(key)
                if hit is None:
                    host = dict(state.host)
                    scalars = rule.prepare(group, host)
                    hit = prepared[key] = (host, args_words(scalars, host["step"], 0)[:NUM_SCALARS + 1], [])
                state.host = dict(hit[0])
                hit[2].append(i)
        except Exception:  # a bad hyperparameter: no counter moves, the step is not run
            for (_, _, state, _, _), host in zip(self.entries, before):
                state.host = host
            raise
        n = len(self.entries)
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has left the host table: it may be overwritten
        if self._static_rows < n:
            self._words[:n, NUM_SCALARS + 1:ARGS_LEN] = [(_int32(salt), _int32(row0))
                                                         for _, _, _, salt, row0 in self.entries]
            self._static_rows = n
        for _, words, rows in prepared.values():
            self._words[rows, :NUM_SCALARS + 1] = words  # the constants and the step count
        self._device[:n].copy_(self._host[:n], non_blocking=True)  # whole rows: one contiguous copy
        if self.device_rows.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
