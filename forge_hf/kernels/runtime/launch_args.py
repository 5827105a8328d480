"""The kernels' per-step arguments, and their record for a step replayed as a CUDA graph.

Every stepped tensor's launch reads a small int32 row (arg_words.py): the rule's fp32
constants, the step count, the layer's rounding salt and its first row. Eagerly each
stepped tensor has a row in its device's table (step_rows.py), copied to the device once a
step for every tensor. A captured step cannot run Python at replay, so while it is captured
``next_launch_args`` hands out rows of one table instead and records who owns each row;
before every replay ``ArgsTable.refresh`` runs the rules' host work in the captured order
(the step counts advance exactly as in the eager step) and copies the whole table at once.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .arg_words import ARGS_LEN, ROW_STRIDE, STEP_WORDS, args_words, int32, pack_args, prepare_step
from .step_rows import rows_for

__all__ = ["ARGS_LEN", "ArgsTable", "args_words", "next_launch_args", "pack_args", "release_held_args"]

_recording: ArgsTable | None = None


def next_launch_args(rule, group: dict, state, salt: int, device, row0: int = 0, hold: bool = False) -> torch.Tensor:
    """Advance ``state`` by one step of ``rule`` and return the launch's arguments; while a
    step is captured, a row of the capture's table (filled at each replay). ``hold``: the
    kernel is queued later, after other launches: call ``release_held_args(device)`` then."""
    if _recording is not None:
        return _recording.add(rule, group, state, salt, row0)
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:  # a tensor's device has its index; "cuda" alone means the current one
            device = torch.device("cuda", torch.cuda.current_device())
        if torch._C._cuda_isCurrentStreamCapturing():
            raise RuntimeError(
                "a fused step is being captured into a CUDA graph outside forge_hf's own capture: each replay "
                "would reuse this step's learning rate and step count. Capture with forge_hf.GraphedStep (or "
                "ForgeTrainer's optim_args cuda_graph=true), which refreshes them before every replay")
    return rows_for(device).args(rule, group, state, salt, row0, hold)


def release_held_args(device: torch.device) -> None:
    """The kernels that read the rows ``next_launch_args(..., hold=True)`` gave out on
    ``device`` are queued."""
    rows_for(device).release()


def step_is_captured() -> bool:
    """Whether the launches being made belong to a step forge is capturing (ArgsTable.recording)."""
    return _recording is not None


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
                    hit = prepared[key] = (*prepare_step(rule, group, state.host), [])
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
            self._words[:n, STEP_WORDS:ARGS_LEN] = [(int32(salt), int32(row0))
                                                    for _, _, _, salt, row0 in self.entries]
            self._static_rows = n
        for _, words, rows in prepared.values():
            self._words[rows, :STEP_WORDS] = words  # the constants and the step count
        self._device[:n].copy_(self._host[:n], non_blocking=True)  # whole rows: one contiguous copy
        if self.device_rows.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
