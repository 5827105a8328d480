"""The words of a launch's argument row: the rule's fp32 constants as bit patterns, the step
count, the layer's rounding salt and its first row, as int32. Every row of launch_args.py
and step_rows.py holds these words; kernels/triton/tile_step.py reads them back."""

from __future__ import annotations

import operator
import struct

import torch

from ...core.rules import NUM_SCALARS

ARGS_LEN = NUM_SCALARS + 3  # constants, step, salt, first row
STEP_WORDS = NUM_SCALARS + 1  # the words a step changes: constants and step count
# A table row's stride: 64 bytes keeps every row 16-byte aligned, as a fresh tensor is
# (Triton compiles a variant per pointer alignment: a misaligned row would need another)
ROW_STRIDE = 16


def int32(value: int) -> int:
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
            *(int32(v) for v in (step, salt, row0))]


def pack_args(scalars: list[float], step: int, salt: int, device, row0: int = 0) -> torch.Tensor:
    """The kernel's argument tensor on ``device``: one host tensor, one copy."""
    return torch.tensor(args_words(scalars, step, salt, row0), dtype=torch.int32).to(device, non_blocking=True)


def prepare_step(rule, group: dict, host: dict) -> tuple[dict, list[int]]:
    """One step of ``rule`` from the counters ``host``, which are left as they are: the
    counters after it, and its STEP_WORDS words."""
    after = dict(host)
    scalars = rule.prepare(group, after)
    return after, args_words(scalars, after["step"], 0)[:STEP_WORDS]


_HYPERPARAMETERS: dict[str, operator.itemgetter] = {}


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value  # betas given as a list


def step_key(rule, group: dict, host: dict) -> tuple | None:
    """What a step's words depend on: the rule, the values of its hyperparameters in
    ``group`` and the counters ``host``. Equal keys give equal words. None where it cannot
    be formed (a hyperparameter missing or unhashable): then nothing is shared."""
    getter = _HYPERPARAMETERS.get(rule.name)
    if getter is None:  # every rule has several hyperparameters: the getter returns a tuple
        getter = _HYPERPARAMETERS[rule.name] = operator.itemgetter(*rule.defaults)
    try:
        values = getter(group)
    except KeyError:
        return None
    key = (id(rule), values, *host.items())
    try:
        hash(key)
        return key
    except TypeError:  # made only now: building it costs as much as the first
        key = (id(rule), tuple(map(_hashable, values)), *host.items())
    try:
        hash(key)
        return key
    except TypeError:
        return None
