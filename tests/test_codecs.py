"""The 8-bit codecs on their own (torch binding of forge_hf/core/codecs.py): exact-zero
invariants, round-trip bounds and a 1000-step EMA against fp32 (paper Appendix B). The
update-domain error of the quantisation seed is tested in test_quantization.py."""

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from forge_hf.core.codecs import BLOCK, CODECS, MIN_LOG_WIDTH, decode, encode
from forge_hf.optim.quantization import SPREADS

AL8, ABSMAX8, FLOORED = CODECS["al8"], CODECS["absmax8"], CODECS["absmax8_floored"]

pytestmark = pytest.mark.usefixtures("single_thread")


def per_element(meta_column, cols):
    """A (rows, blocks) metadata column spread over its blocks' (rows, cols) elements."""
    return meta_column.repeat_interleave(BLOCK, dim=1)[:, :cols]


def al8_bound(meta, cols, stochastic=False):
    """Stated al8 bound, relative to the value: half a grid step (a whole one when
    rounding stochastically) plus fp32 log2/exp2 round-off."""
    step = torch.exp2(per_element(meta[..., 1], cols) / 254) - 1
    return (step if stochastic else step / 2) + 2.0**-14


def lognormal(rows, cols, sigma_bits, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.exp2(-20 + sigma_bits * torch.randn(rows, cols, generator=gen))


matrices = st.integers(1, 3).flatmap(lambda rows: st.integers(1, 150).flatmap(lambda cols: arrays(
    "float32", (rows, cols), elements=st.floats(-2.0**100, 2.0**100, width=32, allow_subnormal=True))))


@settings(max_examples=150, deadline=None)
@given(matrices, st.booleans())
def test_al8_keeps_zero_exact_and_nonzero_nonzero(x, stochastic):
    x = torch.from_numpy(x).abs()
    x[:, ::3] = 0.0  # plenty of exact zeros among the values
    u = torch.rand(x.shape) if stochastic else 0.5
    codes, meta = encode(AL8, x, u)
    back = decode(AL8, codes, meta)
    assert torch.equal(codes == 0, x == 0)
    assert torch.equal(back == 0, x == 0)
    assert bool(torch.isfinite(back).all())


@pytest.mark.parametrize("spread", sorted(SPREADS))
def test_al8_round_trip_within_stated_bound(spread):
    x = lognormal(40, 300, SPREADS[spread])
    codes, meta = encode(AL8, x)
    rel = (decode(AL8, codes, meta) - x).abs() / x
    assert bool((rel <= al8_bound(meta, x.shape[1])).all())
    # the bound follows each block's own log range (narrow blocks are precise)
    span = torch.log2(x[:, :BLOCK]).amax(1) - torch.log2(x[:, :BLOCK]).amin(1)
    torch.testing.assert_close(meta[:, 0, 1], span.clamp_min(MIN_LOG_WIDTH), rtol=1e-5, atol=1e-5)
    print(f"{spread}: median block width {meta[..., 1].median():.2f} bits, max rel. error {rel.max():.3%}")


def test_al8_stochastic_rounding_is_unbiased_and_within_one_step():
    x = lognormal(1, 2 * BLOCK, 4.0).expand(4000, -1).contiguous()  # one row, 4000 draws
    codes, meta = encode(AL8, x, torch.rand(x.shape, generator=torch.Generator().manual_seed(1)))
    back = decode(AL8, codes, meta)
    assert bool(((back - x).abs() / x <= al8_bound(meta, x.shape[1], stochastic=True)).all())
    step = al8_bound(meta, x.shape[1], stochastic=True)[0]
    bias = (back.mean(0) - x[0]) / x[0]
    assert bool((bias.abs() <= 4 * step / (2 * math.sqrt(4000)) + 1e-6).all())  # 4 sigma


def test_al8_degenerate_blocks():
    x = torch.zeros(3, 100)
    x[1] = 0.37  # one value repeated: stored exactly (to fp32 round-off)
    x[2, 7] = 1e-40  # subnormal: floored at 2**-126, never zero
    back = decode(AL8, *encode(AL8, x))
    assert torch.equal(back[0], x[0])
    torch.testing.assert_close(back[1], x[1], rtol=1e-6, atol=0)
    assert back[2, 7] > 0 and int((back[2] != 0).sum()) == 1


@settings(max_examples=150, deadline=None)
@given(matrices)
def test_absmax_error_within_half_a_step(x):
    x = torch.from_numpy(x)
    codes, meta = encode(ABSMAX8, x)
    scale = per_element(meta[..., 0], x.shape[1]).double()
    err = (decode(ABSMAX8, codes, meta).double() - x.double()).abs()
    assert bool((err <= scale * (0.5 + 2.0**-16)).all())
    assert int(codes.abs().max()) <= 127


@settings(max_examples=100, deadline=None)
@given(matrices)
def test_floored_absmax_keeps_positive_values_positive(x):
    x = torch.from_numpy(x).abs()
    codes, meta = encode(FLOORED, x)
    back = decode(FLOORED, codes, meta)
    scale = per_element(meta[..., 0], x.shape[1]).double()
    assert torch.equal(back > 0, x > 0) and torch.equal(back == 0, x == 0)
    err = (back.double() - x.double()).abs()
    # half a step, except a positive value under half a step, stored as one step
    bound = torch.where(x.double() < scale / 2, scale, scale / 2) * (1 + 2.0**-16)
    assert bool((err <= bound).all())


@functools.cache
def _ema_drift(codec_name, beta, signed, steps=1000, shape=(16, 256)):
    """Run the same EMA of synthetic gradients in fp32 and through a codec (requantised
    every step, rounded as the kernels round); the drift in units of the local step."""
    codec = CODECS[codec_name]
    gen = torch.Generator().manual_seed(0)
    sigma = torch.exp(torch.randn(shape, generator=gen))  # per-element gradient scale
    exact = torch.zeros(shape)
    stored = (torch.zeros(shape, dtype=codec.code_dtype), torch.zeros(shape[0], shape[1] // BLOCK, codec.meta_width))
    for _ in range(steps):
        g = torch.randn(shape, generator=gen) * sigma
        inc = g if signed else g * g
        exact = beta * exact + (1 - beta) * inc
        u = torch.rand(shape, generator=gen) if codec.stochastic else 0.5
        stored = encode(codec, beta * decode(codec, *stored) + (1 - beta) * inc, u)
    value, meta = decode(codec, *stored), stored[1]
    if codec is AL8:
        step = exact * (torch.exp2(per_element(meta[..., 1], shape[1]) / 254) - 1)
    else:
        step = per_element(meta[..., 0], shape[1])
    drift = (value - exact) / step
    return dict(rms_steps=drift.pow(2).mean().sqrt().item(), rel_l2=((value - exact).norm() / exact.norm()).item(),
                bias=((value - exact).sum() / exact.abs().sum()).item())


@pytest.mark.parametrize("precision,codecs", [("int8", ("absmax8", "absmax8_floored")), ("al8", ("absmax8", "al8"))])
def test_ema_stays_within_a_quantisation_step(precision, codecs):
    """Appendix B, Prop. 4: the error is a damped sum of per-step round-offs, RMS about
    s / sqrt(12 (1 - beta**2)): 0.66 steps at beta1 = 0.9, 6.5 at beta2 = 0.999."""
    m = _ema_drift(codecs[0], 0.9, signed=True)
    v = _ema_drift(codecs[1], 0.999, signed=False)
    print(f"{precision}: m {m}\n{precision}: v {v}")
    assert m["rms_steps"] <= 1.0
    assert v["rms_steps"] <= 1 / math.sqrt(12 * (1 - 0.999**2))
    if precision == "al8":
        assert abs(v["bias"]) < 0.005  # stochastic codes: no ratchet
        assert v["rel_l2"] < 0.05


def test_ema_al8_second_moment_beats_int8():
    al8 = _ema_drift("al8", 0.999, signed=False)
    int8 = _ema_drift("absmax8_floored", 0.999, signed=False)
    assert al8["rel_l2"] < int8["rel_l2"] and abs(al8["bias"]) < abs(int8["bias"])
