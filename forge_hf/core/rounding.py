"""The random bits of stochastic rounding, written once for both backends (the FORGE paper, Appendix C).

A cheap integer hash of (element index, step, layer salt): one murmur3 finaliser per
element gives two stored tensors 16 bits each, a second mix the next two, so a seed always
gives the same bits whatever the tile shape, launch order or data-parallel band.

Like the rules, the functions use only arithmetic and the free name ``ops``: ``ops.mul32``
(a product modulo 2**32) and the hash's own functions, bound by ``bind_hash`` to Triton
jit functions (kernels/triton/bf16_bits.py) or to int64 tensor arithmetic (``TORCH_HASH`` here).
The hash's constants are the literals below (a bound function sees only ``ops``).
"""

from __future__ import annotations

import types

from .rules import bind_ops

M32 = 0xFFFFFFFF


def spread(i):
    """i * golden ratio modulo 2**32: a bijection, so no two elements share a hash input."""
    return ops.mul32(i, 0x9E3779B1)


def mix32(h):
    """murmur3's 32-bit finaliser: full avalanche in six integer operations."""
    h = h ^ (h >> 16)
    h = ops.mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = ops.mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def element_hash(elem, salt, step):
    """32 uniform bits for each element index (uint32) at one step of one layer."""
    return ops.mix32(ops.spread(elem) ^ (salt ^ ops.mul32(step, 0x85EBCA77)))


def slot_bits(h, slot):
    """16 random bits for stored tensor ``slot`` (0 the weight, 1-3 the states): the
    halves of the element hash, then of one more mix of it (computed once for slots 2, 3)."""
    if slot < 2:
        word = h
    else:
        word = ops.mix32(h ^ 0x27D4EB2F)
    if slot % 2 == 0:
        bits = word & 0xFFFF
    else:
        bits = word >> 16
    return bits


def bind_hash(ops_module, wrap=lambda fn: fn, **names):
    """``ops_module`` (which supplies ``mul32``) with the hash's functions bound to it and
    added to it, each passed through ``wrap`` (triton.jit for the kernels); ``names``: as
    for bind_ops."""
    for fn in (spread, mix32, element_hash, slot_bits):
        setattr(ops_module, fn.__name__, wrap(bind_ops(fn, ops_module, **names)))
    return ops_module


def _mul32(h, c: int):
    """(h * c) mod 2**32 for a Python int or an int64 tensor of 32-bit values, without
    overflowing int64: c is split into 16-bit halves."""
    if isinstance(h, int):
        return (h * c) & M32
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


TORCH_HASH = bind_hash(types.SimpleNamespace(mul32=_mul32))


def hash_word(elem, salt: int, step: int):
    """The 32 random bits of each element (int64 tensor of indices in the whole weight): al8
    codes round with all of them (core/codecs.py), other tensors with a slot's 16."""
    return TORCH_HASH.element_hash(elem, salt & M32, step & M32)


def random_bits(elem, salt: int, step: int, slot: int):
    """16 random bits per element (int64 tensor of indices in the whole weight)."""
    return TORCH_HASH.slot_bits(hash_word(elem, salt, step), slot)


def layer_salt(seed: int, layer_index: int) -> int:
    """32-bit key of a layer's stochastic-rounding stream."""
    return TORCH_HASH.mix32((int(seed) & M32) ^ TORCH_HASH.mix32((TORCH_HASH.spread(layer_index) + 1) & M32))


def held_salt(salt: int) -> int:
    """The key of a layer's held-gradient stream (a bf16 accumulation buffer's rounding), apart
    from its weight's and states' streams, which share ``salt`` (nn/held_buffer.py)."""
    return TORCH_HASH.mix32((int(salt) & M32) ^ 0x5BD1E995)
