"""The quantization report (forge_hf/optim/quantization.py): how faithful a state precision
is, as the reconstruction error of each state and the update-domain error E_upd of the
quantisation seed, checked against the same quantities computed directly."""

import pytest
import torch

from forge_hf.core.codecs import CODECS, decode, encode
from forge_hf.optim.quantization import (
    SPREADS,
    quantization_report,
    round_trip,
    synthetic_states,
    trajectory_error,
)

ABSMAX8 = CODECS["absmax8"]

pytestmark = pytest.mark.usefixtures("single_thread")


def test_update_error_al8_below_int8_on_wide_second_moments():
    """The seed's E_upd with only the second moment quantised (fp32 momentum)."""
    errors = {}
    for spread in SPREADS:
        for precision in ("int8", "al8"):
            report = quantization_report(precision=precision, spread=spread, shape=(64, 512))
            errors[spread, precision] = report.e_upd_slot["exp_avg_sq"]
            print(f"{spread:6s} {report}")
    for spread in SPREADS:
        assert errors[spread, "al8"] < errors[spread, "int8"]
    assert errors["wide", "al8"] < 0.05 < 0.5 < errors["wide", "int8"]


def test_quantization_report_on_given_states_and_fp32_is_exact():
    states, grad = synthetic_states("rmsprop", "medium", (8, 100), momentum=0.9)
    assert sorted(states) == ["momentum_buffer", "square_avg"]
    exact = quantization_report(states, grad, precision="fp32", rule="rmsprop", momentum=0.9)
    assert exact.e_upd == 0.0 and set(exact.relative_l2.values()) == {0.0}
    report = quantization_report(states, grad, precision="al8", rule="rmsprop", momentum=0.9)
    assert report.codecs == {"square_avg": "al8", "momentum_buffer": "absmax8"}
    assert 0 < report.e_upd < 1
    with pytest.raises(ValueError, match="needs the gradient"):
        quantization_report(states, precision="al8", rule="rmsprop")
    with pytest.raises(ValueError, match=r"are not slots of forge adamw"):
        quantization_report(states, grad, precision="al8")


def test_round_trip_matches_storage_precisions():
    x = torch.randn(4, 70)
    assert torch.equal(round_trip(x, "fp32", True), x)
    assert torch.equal(round_trip(x, "bf16", True), x.bfloat16().float())
    assert torch.equal(round_trip(x, "int8", True), decode(ABSMAX8, *encode(ABSMAX8, x)))


def adamw_update_float64(m, v, g, t=1000, lr=1.0, betas=(0.9, 0.999), eps=1e-8):
    """The AdamW update of a zero weight (no decay) at step t, in float64."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return -lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)


def test_reported_errors_are_the_direct_computation():
    """bf16 storage: each state's relative L2 error and E_upd (both states stored, and one
    at a time), recomputed from the states, the gradient and AdamW's formulas in float64."""
    states, grad = synthetic_states("adamw", "medium", (32, 200), seed=3)
    report = quantization_report(states, grad, precision="bf16", rule="adamw")
    m, v, g = (t.double() for t in (states["exp_avg"], states["exp_avg_sq"], grad))
    m_hat, v_hat = (states[k].bfloat16().double() for k in ("exp_avg", "exp_avg_sq"))
    for name, exact, stored in (("exp_avg", m, m_hat), ("exp_avg_sq", v, v_hat)):
        assert report.relative_l2[name] == pytest.approx(float((stored - exact).norm() / exact.norm()), rel=1e-4)
    u = adamw_update_float64(m, v, g)

    def e_upd(m_s, v_s):
        return float((adamw_update_float64(m_s, v_s, g) - u).norm() / u.norm())

    assert report.e_upd == pytest.approx(e_upd(m_hat, v_hat), rel=1e-4)
    assert report.e_upd_slot["exp_avg"] == pytest.approx(e_upd(m_hat, v), rel=1e-4)
    assert report.e_upd_slot["exp_avg_sq"] == pytest.approx(e_upd(m, v_hat), rel=1e-4)
    assert report.codecs == {"exp_avg": "bf16", "exp_avg_sq": "bf16"}
    assert 1e-4 < report.e_upd < 1e-2  # bf16's 8 bits: the test above compares numbers that are not zero


def test_the_report_reads_as_one_line_per_state():
    report = quantization_report(precision="int8", shape=(8, 128))
    lines = str(report).splitlines()
    assert lines[0] == f"adamw states in int8: E_upd {report.e_upd:.4%}"
    assert [line.split()[:2] for line in lines[1:]] == [["exp_avg", "absmax8"], ["exp_avg_sq", "absmax8_floored"]]


@pytest.mark.parametrize("spread", sorted(SPREADS))
def test_synthetic_states_follow_their_stated_distribution(spread):
    states, grad = synthetic_states("adamw", spread, (64, 256), seed=1)
    m, v = states["exp_avg"], states["exp_avg_sq"]
    scale = v.sqrt()  # second moments are scale**2
    assert m.shape == v.shape == grad.shape == (64, 256)
    assert bool((v > 0).all()) and bool((m.abs() < scale).all())  # momenta clipped below the scale
    log_scale = torch.log2(scale)
    assert float(log_scale.mean()) == pytest.approx(-10.0, abs=0.05 * SPREADS[spread] + 0.01)
    assert float(log_scale.std()) == pytest.approx(SPREADS[spread], rel=0.05)
    again, _ = synthetic_states("adamw", spread, (64, 256), seed=1)
    other, _ = synthetic_states("adamw", spread, (64, 256), seed=2)
    assert torch.equal(again["exp_avg"], m) and not torch.equal(other["exp_avg"], m)


def test_synthetic_states_are_the_slots_the_rule_uses():
    assert sorted(synthetic_states("rmsprop", shape=(2, 64))[0]) == ["square_avg"]
    assert sorted(synthetic_states("rmsprop", shape=(2, 64), centered=True)[0]) == ["grad_avg", "square_avg"]
    assert synthetic_states("sgd", shape=(2, 64))[0] == {}
    with pytest.raises(ValueError, match=r"states \[\] are not slots of forge sgd: give some of \('momentum_buffer',"):
        quantization_report(precision="int8", rule="sgd", shape=(2, 64))


def test_stochastic_codes_are_reported_with_their_larger_error():
    """al8 second moments round stochastically when asked (up to a whole step, RMS
    s / sqrt(6) against s / sqrt(12) to nearest); absmax8 momenta always to nearest."""
    nearest = quantization_report(precision="al8", spread="narrow", shape=(32, 256))
    stochastic = quantization_report(precision="al8", spread="narrow", shape=(32, 256), rounding="stochastic")
    assert stochastic.relative_l2["exp_avg"] == nearest.relative_l2["exp_avg"]
    # sqrt(2) where no few values dominate the norm (a narrow spread)
    ratio = stochastic.relative_l2["exp_avg_sq"] / nearest.relative_l2["exp_avg_sq"]
    assert 1.3 < ratio < 1.55
    again = quantization_report(precision="al8", spread="narrow", shape=(32, 256), rounding="stochastic")
    assert again.relative_l2 == stochastic.relative_l2  # the seed fixes the draws


@pytest.mark.parametrize("kwargs,match", [
    (dict(precision="fp8"),
     r"unknown state_precision='fp8': choose one of "
     r"\['auto', 'fp32', 'bf16', 'int8', 'al8', 'log4', 'log4_factored'\]"),
    (dict(precision="auto"), r"measures one storage precision, and 'auto' picks one by the weights' dtype: give "),
    (dict(spread="huge"), r"unknown spread='huge': choose one of \['narrow', 'medium', 'wide'\]"),
    (dict(rule="adam"), r"unknown optimizer 'adam' for forge"),
    (dict(betas=(0.9, 1.5)), r"invalid betas=\(0.9, 1.5\)"),
])
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantization_report(shape=(2, 64), **kwargs)


def test_trajectory_error_ranks_the_state_formats():
    """Along a run of structured gradients, fp32 states give no error, bf16 little, and the
    4-bit maps the study chose no more than the ones it rejected (docs/architecture.md)."""
    from forge_hf.optim import four_bit_maps

    def stored(precision):
        return {name: (lambda x, s=signed: round_trip(x, precision, s, "stochastic", gen))
                for name, signed in (("exp_avg", True), ("exp_avg_sq", False))}

    gen = torch.Generator().manual_seed(0)
    small = dict(shape=(16, 256), steps=40)
    assert trajectory_error({}, **small) == {"mean": 0.0, "last": 0.0}
    bf16, log4 = trajectory_error(stored("bf16"), **small), trajectory_error(stored("log4"), **small)
    assert 0 < bf16["mean"] < log4["mean"]
    linear = trajectory_error({"exp_avg_sq": lambda x: four_bit_maps.store(x, "lin0", False)}, **small)
    chosen = trajectory_error({"exp_avg_sq": lambda x: four_bit_maps.store(x, "log2", False)}, **small)
    assert chosen["mean"] < 0.01 * linear["mean"]  # a zero code for v: the zero point blows the update up


def test_weyl_dither_spreads_each_elements_thresholds_evenly_over_its_stores():
    """Each store's thresholds are uniform over the elements (an unbiased rounding); one
    element's thresholds over 100 stores leave no gap in [0, 1) wider than ~2/100, where 100
    independent draws leave gaps of ~ln(100)/100."""
    from forge_hf.optim.four_bit_maps import WeylDither, store

    dither = WeylDither(seed=3)
    draws = torch.stack([dither((64, 4, 64)) for _ in range(100)])  # (stores, rows, groups, group)
    assert draws.min() >= 0 and draws.max() < 1
    assert abs(draws[0].mean().item() - 0.5) < 0.01  # uniform over the elements
    ordered = torch.sort(draws, dim=0).values
    gaps = torch.diff(torch.cat([ordered, ordered[:1] + 1]), dim=0)  # around the circle
    assert gaps.max() < 2.2 / 100
    independent = torch.rand(101, 4096, generator=torch.Generator().manual_seed(3))
    assert torch.diff(torch.sort(independent, dim=0).values, dim=0).max() > 4 / 100
    x = torch.randn(8, 100)
    assert store(x, "log2", True, dither=WeylDither(1)).shape == x.shape
    with pytest.raises(ValueError, match="a generator .* or a dither .*, not both"):
        store(x, "log2", True, generator=torch.Generator(), dither=WeylDither(1))
