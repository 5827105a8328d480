"""The Triton kernel and the PyTorch reference agree on every rule and precision."""

import pytest
import torch

from forge_hf import ForgeLinear
from forge_hf.core.rules import RULES
from tests.helpers import assert_close_rel, bf16_ulps_apart, exact_inputs

PRECISIONS = [  # (weight dtype, state precision, rounding)
    (torch.float32, "fp32", "stochastic"),
    (torch.float32, "bf16", "stochastic"),
    (torch.bfloat16, "bf16", "stochastic"),
    (torch.bfloat16, "fp32", "nearest"),
]
EXTRA = {"rmsprop": dict(momentum=0.5, centered=True), "sgd": dict(momentum=0.9, nesterov=True)}
STEPS, LR = 3, 1e-2


def _run(rule, wdtype, sprec, rounding, backend, device, transposed=False):
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    lin = torch.nn.Linear(130, 70, bias=False, device=device, dtype=wdtype)
    layer = ForgeLinear.from_linear(lin, optimizer=rule, state_precision=sprec, rounding=rounding,
                                    seed=11, backend=backend, lr=LR, **EXTRA.get(rule, {}))
    for _ in range(STEPS):
        x, dy = exact_inputs((45, 130), 70, dtype=wdtype, device=device, generator=gen)
        layer(x).backward(dy)
    return layer


def _compare(a, b, what, rtol=1e-6, travel=0.0):
    """bf16: nearly all bit-identical, the rest one ulp apart - or, for a weight, one ulp of
    the largest magnitude it can have had during the run (its value plus ``travel``)."""
    if a.dtype == torch.bfloat16:
        ulps = bf16_ulps_apart(a, b)
        # The GPU's division and square root are not IEEE-rounded: an update an fp32 ulp
        # off may round the other way. A weight that then moves towards zero carries that
        # one-ulp difference, many ulps of its smaller final value (H200, NAdam: 6.1e-5 at
        # 7e-4, one ulp at 1e-2).
        carried = (a.float() - b.float()).abs() <= 2.0**-8 * (b.float().abs() + travel)
        assert bool(((ulps <= 1) | carried).all()), what
        assert (ulps == 0).float().mean() >= 0.999, what
    else:
        assert_close_rel(a, b, rtol=rtol, what=what)


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: f"{str(p[0])[6:]}-{p[1]}-{p[2]}")
@pytest.mark.parametrize("rule", sorted(RULES))
def test_triton_matches_reference(rule, precision, device):
    wdtype, sprec, rounding = precision
    ref = _run(rule, wdtype, sprec, rounding, "reference", device)
    tri = _run(rule, wdtype, sprec, rounding, "triton", device)
    # The GPU contracts a*b+c into one rounding (FMA), so an fp32 value may differ by an
    # ulp; stored as bf16 state that can become one bf16 step, which then moves the fp32
    # weight by up to ~lr * 2**-8 of an update.
    # Adam-family steps move a weight by up to ~2 lr
    _compare(tri.weight.detach(), ref.weight.detach(), f"{rule} weight", rtol=1e-6 if sprec == "fp32" else 1e-4,
             travel=2 * LR * STEPS)
    for i, (a, b) in enumerate(zip(tri.forge_state.slots, ref.forge_state.slots)):
        assert (a is None) == (b is None)
        if a is not None:
            _compare(a, b, f"{rule} slot {i}")
    torch.testing.assert_close(tri.forge_stats, ref.forge_stats, rtol=1e-5, atol=0)


def test_direct_launch_key_follows_what_triton_specialises_on():
    """After its first launch the compiled kernel is reused for arguments Triton would
    compile the same way (dtype, 16-byte alignment, integers equal to 1 or multiples of
    16), and only for those."""
    from forge_hf.kernels.runtime.compiled import _specialisation

    a = torch.zeros(64)
    key = _specialisation([a, 32, 5])
    assert key == _specialisation([torch.ones(8), 48, 7])
    assert key != _specialisation([a[1:], 32, 5])  # 4 bytes off a 16-byte boundary
    assert key != _specialisation([a.bfloat16(), 32, 5])
    assert key != _specialisation([a, 33, 5])
    assert key != _specialisation([a, 32, 1])
    # a TMA descriptor (the persistent kernel's): by its tensor's dtype, whatever the address
    from forge_hf.kernels.gluon.persistent_update import tensor_descriptor
    codes = torch.zeros(64, 64, dtype=torch.int8)
    described = _specialisation([tensor_descriptor(codes), 32])
    assert described == _specialisation([tensor_descriptor(torch.ones(128, 64, dtype=torch.int8)), 48])
    assert described != _specialisation([tensor_descriptor(codes.view(torch.int16)), 32])
