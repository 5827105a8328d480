"""The stochastic-rounding hash (forge_hf/core/rounding.py): the torch binding against an
independent pure-Python murmur3 finaliser, the ranges and statistics of its bits, the
per-layer salts, and the Triton binding (kernels/triton/bf16_bits.py) giving the same bits."""

import math
import random
import struct

import pytest
import torch
import triton
import triton.language as tl

from forge_hf.core.rounding import M32, TORCH_HASH, layer_salt, random_bits
from forge_hf.core.rules import NUM_SCALARS
from forge_hf.kernels.reference import round_to_bf16
from forge_hf.kernels.runtime.launch_args import args_words
from forge_hf.kernels.triton.bf16_bits import element_hash, slot_bits

# ------------------------------------------- the hash written out again, in plain Python


def fmix32(h: int) -> int:
    """murmur3's 32-bit finaliser (SMHasher, MurmurHash3.cpp) on a Python int."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def py_element_hash(elem: int, salt: int, step: int) -> int:
    return fmix32(((elem * 0x9E3779B1) & M32) ^ salt ^ ((step * 0x85EBCA77) & M32))


def py_slot_bits(h: int, slot: int) -> int:
    word = h if slot < 2 else fmix32(h ^ 0x27D4EB2F)
    return word & 0xFFFF if slot % 2 == 0 else word >> 16


def _signed(words):
    """32-bit words as the int32 values holding them."""
    return [w - 2**32 if w >= 2**31 else w for w in words]


def random_words(n, seed=0):
    rng = random.Random(seed)
    # the edges of the 32-bit range, where an int64 product or a sign would show first
    return [0, 1, 2**31 - 1, 2**31, M32 - 1, M32] + [rng.getrandbits(32) for _ in range(n)]


def test_fmix32_gives_murmur3s_published_values():
    # MurmurHash3_x86_32 of the empty key is fmix32(seed): SMHasher's vectors for seeds 1 and 2**32 - 1
    assert fmix32(0) == 0
    assert fmix32(1) == 0x514E28B7
    assert fmix32(M32) == 0x81F16F39


def test_torch_mix32_is_the_murmur3_finaliser():
    words = random_words(5000)
    got = TORCH_HASH.mix32(torch.tensor(words, dtype=torch.int64))
    assert got.dtype == torch.int64
    assert got.tolist() == [fmix32(w) for w in words]
    assert [TORCH_HASH.mix32(w) for w in words[:50]] == [fmix32(w) for w in words[:50]]  # Python ints too


def test_element_hash_and_slot_bits_match_plain_python():
    rng = random.Random(1)
    elem = torch.tensor(random_words(2000, seed=2), dtype=torch.int64)
    for salt, step in [(0, 0), (M32, 1), (rng.getrandbits(32), rng.getrandbits(32)), (12345, 2**31)]:
        h = TORCH_HASH.element_hash(elem, salt, step)
        expected = [py_element_hash(e, salt, step) for e in elem.tolist()]
        assert h.tolist() == expected, (salt, step)
        for slot in range(4):
            assert TORCH_HASH.slot_bits(h, slot).tolist() == [py_slot_bits(e, slot) for e in expected]
            assert random_bits(elem, salt, step, slot).tolist() == [py_slot_bits(e, slot) for e in expected]


def test_random_bits_are_16_bits_and_uniform():
    elem = torch.arange(1 << 16, dtype=torch.int64)
    for slot in range(4):
        bits = random_bits(elem, salt=0x1234ABCD, step=7, slot=slot)
        assert int(bits.min()) >= 0 and int(bits.max()) < 1 << 16
        # 16 equal buckets of 4096 expected draws: a uniform source exceeds chi-square 44
        # (15 degrees of freedom) with probability 1e-4
        counts = torch.bincount(bits >> 12, minlength=16).double()
        chi2 = float(((counts - 4096) ** 2 / 4096).sum())
        assert chi2 < 44, f"slot {slot}: chi-square {chi2:.1f}"
    # the four slots are not copies of one another
    slots = [random_bits(elem, 0x1234ABCD, 7, s) for s in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert (slots[a] == slots[b]).float().mean() < 0.001


def test_step_and_salt_are_taken_modulo_2_to_the_32():
    """The kernels read step and salt as the uint32 of an int32 argument word."""
    elem = torch.arange(300, dtype=torch.int64)
    assert torch.equal(random_bits(elem, -1, 5, 0), random_bits(elem, M32, 5, 0))
    assert torch.equal(random_bits(elem, 3, 2**32 + 5, 1), random_bits(elem, 3, 5, 1))


def test_bits_are_deterministic_for_a_seed_and_change_with_step_salt_and_element():
    elem = torch.arange(4096, dtype=torch.int64)
    base = random_bits(elem, 99, 3, 0)
    assert torch.equal(base, random_bits(elem.clone(), 99, 3, 0))
    for other in (random_bits(elem, 99, 4, 0), random_bits(elem, 100, 3, 0), random_bits(elem + 1, 99, 3, 0)):
        assert (other == base).float().mean() < 0.001  # a chance match is 1 in 65536


@pytest.mark.parametrize("value", [1.0 + 0.3 * 2**-7, -3.0 - 0.9 * 2**-6, 1e-3, -7.123456e5])
def test_stochastic_rounding_is_unbiased(value):
    """Rounded away from zero with probability (discarded fraction) (paper Prop. 5): every
    draw is one of the two bf16 neighbours, and the mean of many draws is the value within
    4 standard deviations of that two-point distribution."""
    n = 1 << 14
    x = torch.full((n,), value, dtype=torch.float32)
    bits = struct.unpack("I", struct.pack("f", value))[0] & 0xFFFF0000
    near, far = (struct.unpack("f", struct.pack("I", b))[0] for b in (bits, bits + 0x10000))  # |far| > |near|
    p = (float(x[0]) - near) / (far - near)
    assert 0.01 < p < 0.99
    rounded = round_to_bf16(x, torch.arange(n), salt=0xC0FFEE, step=11, slot=0, stochastic=True).double()
    assert set(rounded.unique().tolist()) == {near, far}
    sigma = abs(far - near) * math.sqrt(p * (1 - p) / n)
    bias = rounded.mean().item() - float(x[0])
    assert abs(bias) <= 4 * sigma, f"bias {bias:.3e} exceeds 4 sigma {4 * sigma:.3e}"


def test_stochastic_rounding_keeps_representable_values():
    x = torch.tensor([1.0, -2.5, 0.0, 3.0e38, 1e-40], dtype=torch.float32).bfloat16().float()
    rounded = round_to_bf16(x, torch.arange(5), salt=1, step=1, slot=2, stochastic=True)
    assert torch.equal(rounded.float(), x)


def test_layer_salts_are_distinct_and_plain_python():
    salts = {(seed, i): layer_salt(seed, i) for seed in range(8) for i in range(-200, 200)}
    assert len(set(salts.values())) == len(salts)  # negative indices: ForgeOptimizer's other tensors
    assert all(0 <= s <= M32 for s in salts.values())
    for (seed, i), salt in list(salts.items())[::97]:
        assert salt == fmix32(seed ^ fmix32((((i * 0x9E3779B1) & M32) + 1) & M32))
    assert layer_salt(2**32 + 3, 5) == layer_salt(3, 5)  # the seed's low 32 bits


# ----------------------------------------------------------- the Triton binding


@triton.jit
def hash_kernel(elem_ptr, args_ptr, out_ptr, N: tl.constexpr):
    """element_hash and the four slot_bits of N element indices (int32 words), with step
    and salt read as the fused kernels read them (uint32 from int32 argument words)."""
    offs = tl.arange(0, N)
    e = tl.load(elem_ptr + offs).to(tl.uint32, bitcast=True)
    step = tl.load(args_ptr).to(tl.uint32, bitcast=True)
    salt = tl.load(args_ptr + 1).to(tl.uint32, bitcast=True)
    h = element_hash(e, salt, step)
    tl.store(out_ptr + offs, h.to(tl.int32, bitcast=True))
    tl.store(out_ptr + N + offs, slot_bits(h, 0).to(tl.int32, bitcast=True))
    tl.store(out_ptr + 2 * N + offs, slot_bits(h, 1).to(tl.int32, bitcast=True))
    tl.store(out_ptr + 3 * N + offs, slot_bits(h, 2).to(tl.int32, bitcast=True))
    tl.store(out_ptr + 4 * N + offs, slot_bits(h, 3).to(tl.int32, bitcast=True))


def _triton_hash(elem, salt, step):
    """(5, n) int64: element_hash of ``elem`` (int32 words), then its four slot_bits."""
    words = args_words([0.0] * NUM_SCALARS, step, salt)[NUM_SCALARS:NUM_SCALARS + 2]  # step, salt
    out = torch.zeros(5, elem.numel(), dtype=torch.int32, device=elem.device)
    hash_kernel[(1,)](elem, torch.tensor(words, dtype=torch.int32, device=elem.device), out, N=elem.numel())
    return (out.to(torch.int64) & M32).cpu()


def test_triton_binding_gives_the_torch_bindings_bits(device):
    n = 1024
    elem = torch.tensor(random_words(n - 6, seed=3), dtype=torch.int64)
    for salt, step in [(0x9E3779B9, 1), (layer_salt(0, 3), 2**31 + 17), (M32, M32)]:
        got = _triton_hash(torch.tensor(_signed(elem.tolist()), dtype=torch.int32, device=device), salt, step)
        h = TORCH_HASH.element_hash(elem, salt, step)
        assert torch.equal(got[0], h), (salt, step)
        for slot in range(4):
            assert torch.equal(got[1 + slot], TORCH_HASH.slot_bits(h, slot)), (salt, step, slot)
