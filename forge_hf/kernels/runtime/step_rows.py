"""Eager launch arguments: one table of argument rows per device, a row per stepped
tensor, written to the device by one copy a step rather than one a launch.

A launch whose row already holds its step's words uses it as it is: its state's counters
move on and nothing is copied. Otherwise (the first launch of a step, a changed learning
rate, a new tensor) the launch predicts the next step of every row, from its state's
counters and its group's hyperparameters as they are now, and copies the whole table at
once; the other tensors' launches in that step then find their rows ready. Rows of one rule,
hyperparameter values and counters share one ``prepare``.

Kernels launched before a copy on the same stream read the table before it changes
(stream order); a launch from another stream first makes its stream wait for the previous
one. A host buffer is written again only after its last copy has left it.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from .arg_words import ARGS_LEN, ROW_STRIDE, STEP_WORDS, int32, prepare_step, step_key
from .pinned_ring import PinnedRing, StreamOrder

_NO_WORDS = [0] * STEP_WORDS  # a row whose next step is not known: its own launch writes it


class _Row:
    __slots__ = ("state", "rule", "group", "statics", "key", "after", "words", "held", "_free", "_index")

    def __init__(self, state, rule, group, statics, free: set[int], index: int):
        self.state = weakref.ref(state, self._gone)
        self.rule, self.group, self.statics = rule, group, statics  # statics: (salt, first row)
        self.key = None  # the step_key whose words the device row holds (None: none known)
        self.after = None  # the counters after that step
        self.words = _NO_WORDS  # the step words the device row holds
        self.held = False  # handed out to a launch not yet queued: its words must stay
        self._free, self._index = free, index

    def _gone(self, _) -> None:
        """Its state is gone: the row is free, and lets go of the group (an optimizer's param
        group holds its parameters)."""
        self.rule = self.group = None
        self._free.add(self._index)


class StepRows:
    """The eager argument rows of one device (``rows_for(device)``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # state -> row
        self._rows: list[_Row] = []
        self._free: set[int] = set()  # rows whose states are gone
        self._capacity = 0
        self._statics = np.zeros((0, 2), dtype=np.int32)
        self._views: list[torch.Tensor] = []
        self._retired: list[torch.Tensor] = []  # earlier tables: kernels in flight may still read them
        self._streams = StreamOrder(device) if self._cuda else None
        self._held: list[_Row] = []

    def args(self, rule, group: dict, state, salt: int, row0: int, hold: bool = False) -> torch.Tensor:
        """Advance ``state`` by one step of ``rule`` and return its row, holding that step's
        words on the device by the time a kernel launched next on this stream reads it.
        ``hold``: the kernel is launched later, after other launches (a multi-tensor launch):
        the row keeps its words until ``release``."""
        i = self._index.get(state)
        if i is None:
            i = self._add(state, rule, group, (salt, row0))
        row = self._rows[i]
        row.rule, row.group = rule, group
        if row.statics != (salt, row0):
            row.statics, row.key = (salt, row0), None
            self._statics[i] = (int32(salt), int32(row0))
        if self._cuda:
            self._streams.follow()
        key = step_key(rule, group, state.host)
        if key is None or row.key != key:
            self._write(i, key)
        state.host = dict(row.after)
        if hold:
            row.held = True
            self._held.append(row)
        return self._views[i]

    def release(self) -> None:
        """The held rows' launches are queued: their rows may be written again."""
        for row in self._held:
            row.held = False
        self._held.clear()

    def _add(self, state, rule, group, statics) -> int:
        if self._free:
            i = self._free.pop()
            self._rows[i] = _Row(state, rule, group, statics, self._free, i)
        else:
            i = len(self._rows)
            self._rows.append(_Row(state, rule, group, statics, self._free, i))
            if i == self._capacity:
                self._grow()
        self._index[state] = i
        self._statics[i] = [int32(v) for v in statics]
        return i

    def _grow(self) -> None:
        capacity = max(64, 2 * self._capacity)
        table = torch.zeros(capacity, ROW_STRIDE, dtype=torch.int32, device=self.device)
        if self._views:
            self._retired.append(self._table)
        self._table = table
        self._views = [r[:ARGS_LEN] for r in table]  # views made once: a view costs host time
        statics = np.zeros((capacity, 2), dtype=np.int32)  # each row's salt and first row
        statics[:self._capacity] = self._statics
        self._statics = statics
        self._ring = PinnedRing(capacity, ROW_STRIDE, torch.int32, self.device)
        self._capacity = capacity
        for row in self._rows:
            row.key = None  # the new table holds nothing yet

    def _write(self, i: int, key) -> None:
        """Row ``i``'s next step from its state's counters (an error in it moves nothing),
        every other row's predicted, then one copy of the table. Without a key for row ``i``
        (nothing can be shared with it) row ``i`` alone."""
        launching = self._rows[i]
        launching.after, words = prepare_step(launching.rule, launching.group, launching.state().host)
        launching.key, launching.words = key, words
        if key is None:
            self._copy([words], slice(i, i + 1))
            return
        shared = {key: (launching.after, words)}
        step_words = []
        for j, row in enumerate(self._rows):
            if j == i or row.held:
                step_words.append(row.words)
                continue
            state = row.state()
            row_key = None if state is None else step_key(row.rule, row.group, state.host)
            hit = None
            if row_key is not None:
                hit = shared.get(row_key)
                if hit is None:
                    try:
                        hit = shared[row_key] = prepare_step(row.rule, row.group, state.host)
                    except Exception:  # its own launch raises it, before anything of that tensor moves
                        pass
            if hit is None:
                row.key, row.words = None, _NO_WORDS
            else:
                row.key, row.after, row.words = row_key, hit[0], hit[1]
            step_words.append(row.words)
        self._copy(step_words, slice(0, len(self._rows)))

    def _copy(self, step_words: list, rows: slice) -> None:
        """The table's ``rows`` = their ``step_words`` and statics, by one copy from the
        next host buffer."""
        table_words = self._ring.take(rows)
        table_words[:, :STEP_WORDS] = step_words
        table_words[:, STEP_WORDS:ARGS_LEN] = self._statics[rows]
        self._ring.send(self._table[rows])


_TABLES: dict[tuple[str, int | None], StepRows] = {}


def rows_for(device: torch.device) -> StepRows:
    """The eager rows of ``device`` (a CUDA device with its index)."""
    key = (device.type, device.index)
    rows = _TABLES.get(key)
    if rows is None:
        rows = _TABLES[key] = StepRows(device)
    return rows
