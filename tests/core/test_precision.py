"""bf16 weights and states: round-to-nearest matches an fp32 update rounded once;
stochastic rounding is unbiased (paper Appendix C) and deterministic for a seed."""

import pytest
import torch

from forge_hf import ForgeLinear
from tests.helpers import bf16_ulps_apart, exact_gradient, exact_inputs


@pytest.mark.parametrize("rule,cls,hp", [
    ("adamw", torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
    ("sgd", torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    # RMSprop's first steps are ~lr / sqrt(1 - alpha): a small lr keeps weights from
    # crossing zero, where an fp32 round-off is many bf16 steps
    ("rmsprop", torch.optim.RMSprop, dict(lr=1e-5)),
])
def test_bf16_nearest_equals_fp32_update_rounded_once(rule, cls, hp, backend, device):
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    lin = torch.nn.Linear(300, 200, bias=False, device=device, dtype=torch.bfloat16)
    layer = ForgeLinear.from_linear(lin, optimizer=rule, state_precision="fp32", rounding="nearest", backend=backend,
                                    **hp)
    shadow = torch.nn.Parameter(lin.weight.detach().float())
    opt = cls([shadow], foreach=False, **hp)
    identical, total = 0, 0
    for _ in range(5):
        with torch.no_grad():
            shadow.copy_(layer.weight.float())  # the oracle starts from forge's bf16 weight
        x, dy = exact_inputs((7, 11, 300), 200, dtype=torch.bfloat16, device=device, generator=gen)
        layer(x).backward(dy)
        shadow.grad = exact_gradient(x, dy).float()
        opt.step()
        expected = shadow.detach().bfloat16()  # torch's fp32 -> bf16 cast: round to nearest even
        ulps = bf16_ulps_apart(layer.weight.detach(), expected)
        assert int(ulps.max()) <= 1
        identical += int((ulps == 0).sum())
        total += ulps.numel()
    assert identical / total >= 0.999, f"only {identical / total:.5f} bit-identical"


def _quarter_ulp_run(rounding, steps=100, seed=0, backend="reference", device="cpu"):
    """Appendix C: w = 0.75 (bf16 ulp 2**-8), a true SGD update of -2**-10 (a quarter
    ulp) for ``steps`` steps. Returns the final bf16 weights."""
    lin = torch.nn.Linear(64, 64, bias=False, device=device, dtype=torch.bfloat16)
    torch.nn.init.constant_(lin.weight, 0.75)
    layer = ForgeLinear.from_linear(lin, optimizer="sgd", lr=1.0, rounding=rounding, seed=seed,
                                    backend=backend)
    x = torch.ones(1, 64, device=device, dtype=torch.bfloat16)
    dy = torch.full((1, 64), 2.0**-10, device=device, dtype=torch.bfloat16)
    for _ in range(steps):
        layer(x).backward(dy)
    return layer.weight.detach()


def test_stochastic_rounding_accumulates_sub_ulp_updates(backend, device):
    steps = 40 if backend == "triton" else 100
    w = _quarter_ulp_run("stochastic", steps=steps, backend=backend, device=device).float()
    expected_change = -steps * 2.0**-10
    change = w.mean().item() - 0.75
    # per-element std after n steps is sqrt(n * p(1-p)) ulp; over 4096 entries the mean's
    # std is ~0.07 ulp at n=100: half an ulp is a >5-sigma bound
    assert abs(change - expected_change) < 0.5 * 2.0**-8, (change, expected_change)


def test_round_to_nearest_loses_sub_ulp_updates(backend, device):
    w = _quarter_ulp_run("nearest", steps=20, backend=backend, device=device)
    assert torch.equal(w, torch.full_like(w, 0.75)), "round-to-nearest should discard quarter-ulp updates"


def test_same_seed_same_bits_other_seed_other_bits(device):
    a = _quarter_ulp_run("stochastic", steps=10, seed=7, device=device)
    b = _quarter_ulp_run("stochastic", steps=10, seed=7, device=device)
    c = _quarter_ulp_run("stochastic", steps=10, seed=8, device=device)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a.view(torch.int16), c.view(torch.int16))


def test_bf16_state_tracks_fp32_state(backend, device):
    """bf16 moments stay within bf16 resolution of fp32 moments over several steps."""
    gen = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(96, 80, bias=False, device=device)
    twin = torch.nn.Linear(96, 80, bias=False, device=device)
    twin.load_state_dict(lin.state_dict())
    a = ForgeLinear.from_linear(lin, state_precision="bf16", rounding="nearest", backend=backend, lr=1e-3)
    b = ForgeLinear.from_linear(twin, state_precision="fp32", backend=backend, lr=1e-3)
    for _ in range(4):
        x, dy = exact_inputs((40, 96), 80, device=device, generator=gen)
        a(x).backward(dy)
        b(x).backward(dy)
    assert a.forge_state.slots[0].dtype == torch.bfloat16
    for sa, sb in zip(a.forge_state.slots[:2], b.forge_state.slots[:2]):
        # each step rounds to bf16 (relative 2**-9); an EMA may cancel to near zero, so
        # the error is judged on the tensor's scale
        assert (sa.float() - sb).abs().max() / sb.abs().max() < 2**-7
    # Adam's step is ~lr; a 2**-8 relative state error moves it by ~lr * 2**-7 per step
    assert (a.weight - b.weight).abs().max() <= 4 * 1e-3 * 2**-6


def test_a_row_band_rounds_like_the_same_rows_of_the_whole_weight(backend, device):
    """Data-parallel ranks step bands of a weight's rows; given the band's first row, the
    stochastic-rounding bits are those of the whole-weight step, so sharded runs can match a
    single process bit for bit. Without it the band would draw other bits."""
    from forge_hf.core.rules import get_rule, make_group
    from forge_hf.core.state import ForgeState
    from forge_hf.kernels.dispatch import resolve_backend
    from forge_hf.kernels.runtime.launch_args import pack_args

    gen = torch.Generator().manual_seed(9)
    x, dy = exact_inputs((40, 96), 150, dtype=torch.bfloat16, device=device, generator=gen)
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-2))
    run = resolve_backend(backend, torch.device(device))

    def step(rows: slice, row0: int) -> torch.Tensor:
        weight = (torch.arange(150 * 96, device=device).reshape(150, 96) % 251 / 251.0).bfloat16()[rows]
        state = ForgeState(rule, "bf16", transposed=False)
        state.allocate(weight, group)
        args = pack_args(rule.prepare(group, state.host), 1, 12345, device, row0)
        run(x, dy[:, rows], weight, state.kernel_slots(), args, torch.zeros(2, device=device), "adamw", True)
        return torch.stack([weight, *state.slots[:2]]).view(torch.int16)

    whole = step(slice(0, 150), 0)
    band = step(slice(72, 150), 72)
    assert torch.equal(band, whole[:, 72:150])
    assert not torch.equal(step(slice(72, 150), 0), whole[:, 72:150])
