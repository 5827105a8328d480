"""The held gradient's bf16 buffer (nn/held_buffer.py, kernels/rounded_sum.py): each backward's
sum formed in fp32 a band of rows at a time and added rounded stochastically. Unbiased (the mean
over seeds is the fp32 sum), reproducible (a seed gives the same bits), the same bits from the
Triton kernel (interpreted on CPU) and its PyTorch twin."""

import pytest
import torch

from forge_hf.kernels import add_rounded
from forge_hf.nn.held_buffer import AddCounts, RoundedSums
from forge_hf.nn.held_gradient import HeldGradient
from tests.helpers import DEVICE

IN, OUT = 71, 37  # no multiple of the kernel's block, nor of a band


def pairs(n=3, tokens=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, IN, generator=gen).to(DEVICE, torch.bfloat16),
             torch.randn(tokens, OUT, generator=gen).to(DEVICE, torch.bfloat16)) for _ in range(n)]


def bf16_buffer(salt, kernel, held_pairs):
    held = HeldGradient("bf16_buffer", torch.bfloat16, RoundedSums(salt, kernel))
    for x, dy in held_pairs:
        held.add(x, dy)
    return held


def test_the_kernel_rounds_with_the_reference_bits():
    gen = torch.Generator().manual_seed(1)
    rows = (torch.randn(OUT, IN, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    band = torch.randn(OUT, IN, generator=gen).to(DEVICE) * torch.logspace(-6, 2, IN).to(DEVICE)
    band[0, :5] = 0.0
    for count in (0, 7):
        out = [rows.clone() for _ in range(2)]
        for kernel, r in zip((False, True), out):
            add_rounded(r, band, 5 * IN, 0xDEADBEEF, torch.tensor(count, device=DEVICE), kernel)
        assert torch.equal(out[0].view(torch.int16), out[1].view(torch.int16)), count
        assert not torch.equal(out[0], rows)


@pytest.mark.parametrize("kernel", [False, True])
def test_a_fresh_add_stores_what_an_add_to_zeros_stores(kernel):
    """A window's first add writes its new buffer without reading it: whatever the buffer held
    (torch.empty), the bits of adding the band to zeros."""
    gen = torch.Generator().manual_seed(2)
    band = torch.randn(OUT, IN, generator=gen).to(DEVICE) * torch.logspace(-6, 2, IN).to(DEVICE)
    zeros, garbage = torch.zeros(OUT, IN, dtype=torch.bfloat16, device=DEVICE), torch.full(
        (OUT, IN), 3.0, dtype=torch.bfloat16, device=DEVICE)
    count = torch.tensor(5, device=DEVICE)
    add_rounded(zeros, band, 0, 0xBEEF, count, kernel)
    add_rounded(garbage, band, 0, 0xBEEF, count, kernel, fresh=True)
    assert torch.equal(zeros.view(torch.int16), garbage.view(torch.int16))


def test_one_count_a_backward_and_never_one_count_twice_for_a_layer():
    """The optimizer's layers share one device count: advanced by a backward's first add (and by
    the first add ever), not by each layer's; a layer that adds twice in one backward advances it."""
    counts = AddCounts()
    taken = [counts.take(key, DEVICE).item() for key in (1, 2, 3, 1, 2, 3)]
    assert taken == [1, 1, 1, 2, 2, 2]
    assert [counts.take(key, DEVICE).item() for key in (1, 1, 2)] == [3, 4, 4]


def test_a_bf16_buffer_is_reproducible_and_alike_on_both_backends(monkeypatch):
    """Bands of 4 rows (one sum rounded a band); the same seed gives the same bits on either
    backend, another seed other bits; each add of a layer of its own advances its device count."""
    monkeypatch.setattr("forge_hf.nn.held_buffer.ROUND_CHUNK", 4 * IN)
    held_pairs = pairs()
    runs = {(salt, kernel): bf16_buffer(salt, kernel, held_pairs) for salt in (3, 4) for kernel in (False, True)}
    bits = {key: held.buffer.view(torch.int16) for key, held in runs.items()}
    assert torch.equal(bits[3, False], bits[3, True]) and torch.equal(bits[4, False], bits[4, True])
    assert torch.equal(bits[3, False], bf16_buffer(3, False, held_pairs).buffer.view(torch.int16))
    assert not torch.equal(bits[3, False], bits[4, False])
    for held in runs.values():
        assert [c.item() for c in held.rounded.counts.counts.values()] == [3] and held.nbytes() == OUT * IN * 2


def test_a_bf16_buffer_is_unbiased():
    """1 then eight adds of 2**-10 each: under half a bf16 step of 1 (2**-7), so rounding to
    nearest would keep 1 for good; the mean over seeds and elements is the exact sum."""
    ones_x, ones_dy = torch.ones(1, IN, device=DEVICE), torch.ones(1, OUT, device=DEVICE)
    adds = [(ones_x.bfloat16(), ones_dy.bfloat16())] + [(ones_x.bfloat16(), (ones_dy * 2.0**-10).bfloat16())] * 8
    means = torch.stack([bf16_buffer(salt, False, adds).buffer.double() for salt in range(32)]).mean()
    assert means.item() == pytest.approx(1 + 8 * 2.0**-10, abs=2e-4)
    assert 1 + 8 * 2.0**-10 - 1 > 30 * 2e-4  # what nearest rounding would lose: far outside


def test_the_mean_over_seeds_is_the_fp32_sum():
    """Random products: the mean over 64 seeds errs several times less than one seed's sum."""
    held_pairs = pairs(n=4)
    exact = sum(dy.double().t() @ x.double() for x, dy in held_pairs)
    runs = torch.stack([bf16_buffer(salt, False, held_pairs).buffer.double() for salt in range(64)])
    one, mean = (runs[0] - exact).abs().mean(), (runs.mean(0) - exact).abs().mean()
    assert mean < one / 4, (mean, one)


def test_a_bf16_buffers_norm_is_its_values_norm(monkeypatch):
    """The clip's squared norm of a bf16 buffer, read in fp32 in bands of 100 entries."""
    monkeypatch.setattr("forge_hf.nn.held_buffer.ROUND_CHUNK", 100)
    held = bf16_buffer(1, False, pairs())
    values = held.buffer.double()
    torch.testing.assert_close(held.squared_norm().double(), values.square().sum(), rtol=1e-6, atol=0)
