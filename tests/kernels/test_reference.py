"""The PyTorch reference backend (forge_hf/kernels/reference.py) on its own: the fused AdamW
step against the same step written out in float64, tiles that are cut by the weight's edge,
non-finite tiles skipped and counted, bf16 rounding, and the row step of the optimizer's
non-fused tensors."""

import pytest
import torch

from forge_hf.core.rules import get_rule, make_group
from forge_hf.kernels.reference import reference_fused_update, reference_rule_rows, round_to_bf16
from forge_hf.kernels.runtime.launch_args import pack_args
from tests.helpers import assert_close_rel, exact_gradient, exact_inputs

HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def adamw_float64(w, m, v, g, t, lr, betas, eps, weight_decay):
    """One AdamW step as torch.optim.AdamW's documentation writes it, in float64."""
    b1, b2 = betas
    w = w * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    return w - lr * m_hat / (v_hat.sqrt() + eps), m, v


def _fp32_adamw(n, k):
    w = torch.linspace(-0.5, 0.5, n * k).view(n, k)
    return w, [torch.zeros(n, k), torch.zeros(n, k), None], torch.zeros(2)


@pytest.mark.parametrize("n,k,tokens", [(70, 130, 33), (64, 64, 1), (5, 200, 7), (129, 65, 64)])
def test_adamw_steps_match_a_float64_adamw_on_shapes_cut_by_the_tile(n, k, tokens):
    rule = get_rule("adamw")
    group, host = make_group(rule, HP), rule.host_init()
    w, slots, stats = _fp32_adamw(n, k)
    w64, m64, v64 = w.double(), torch.zeros(n, k, dtype=torch.float64), torch.zeros(n, k, dtype=torch.float64)
    gen = torch.Generator().manual_seed(n + k)
    sumsq = 0.0
    for t in range(1, 4):
        x, dy = exact_inputs((tokens, k), n, generator=gen)
        args = pack_args(rule.prepare(group, host), host["step"], 5, "cpu")
        reference_fused_update(x, dy, w, slots, args, stats, "adamw", stochastic=True)
        g = exact_gradient(x, dy)
        sumsq += float((g * g).sum())
        w64, m64, v64 = adamw_float64(w64, m64, v64, g, t, **HP)
        assert_close_rel(w, w64.float(), what=f"weight, step {t}")
        assert_close_rel(slots[0], m64.float(), what=f"exp_avg, step {t}")
        assert_close_rel(slots[1], v64.float(), what=f"exp_avg_sq, step {t}")
    assert stats[1].item() == 0
    assert stats[0].item() == pytest.approx(sumsq, rel=1e-6)  # the squared gradient, summed over steps


@pytest.mark.parametrize("blocks", [(32, 128, 64), (16, 16, 16), (128, 32, 64)])
def test_the_tile_shape_does_not_change_the_result(blocks):
    """Tiles only partition the work: fp32 values and stochastic bf16 bits are the default
    64 x 64 tiles'."""
    rule = get_rule("adamw")
    group = make_group(rule, HP)
    x, dy = exact_inputs((33, 130), 70, generator=torch.Generator().manual_seed(0))
    results = []
    for tiles in ((64, 64, 64), blocks):
        w = torch.linspace(-0.5, 0.5, 70 * 130).view(70, 130).bfloat16()
        slots = [torch.zeros(70, 130, dtype=torch.bfloat16), torch.zeros(70, 130), None]
        args = pack_args(rule.prepare(group, rule.host_init()), 1, 123, "cpu")
        stats = torch.zeros(2)
        reference_fused_update(x, dy, w, slots, args, stats, "adamw", True, blocks=tiles)
        results.append((w, slots[:2], stats))
    (w0, s0, st0), (w1, s1, st1) = results
    assert torch.equal(w0, w1) and torch.equal(s0[0], s1[0]) and torch.equal(s0[1], s1[1])
    assert st0[0].item() == pytest.approx(st1[0].item(), rel=1e-6)


def _one_step(x, dy):
    rule = get_rule("adamw")
    group = make_group(rule, HP)
    w, slots, stats = _fp32_adamw(*dy.shape[-1:], x.shape[-1])
    before = [w.clone(), slots[0].clone(), slots[1].clone()]
    args = pack_args(rule.prepare(group, rule.host_init()), 1, 5, "cpu")
    reference_fused_update(x, dy, w, slots, args, stats, "adamw", True)
    return [w, *slots[:2]], before, stats


@pytest.mark.parametrize("poison,skipped", [
    ("dy", (slice(0, 64), slice(None))),  # a NaN in output row 5: tile row 0 (3 tiles)
    ("x", (slice(None), slice(64, 128))),  # an inf in input column 100: tile column 1 (2 tiles)
    ("overflow", (slice(64, 70), slice(None))),  # finite, but its square overflows fp32 (3 tiles)
])
def test_non_finite_tiles_are_skipped_and_counted(poison, skipped):
    x, dy = exact_inputs((33, 130), 70, generator=torch.Generator().manual_seed(1))
    if poison == "dy":
        dy[3, 5] = float("nan")
    elif poison == "x":
        x[4, 100] = float("inf")
    else:
        dy[2, 66], x[2, :] = 1e20, 1.0
    after, before, stats = _one_step(x, dy)
    mask = torch.zeros(70, 130, dtype=torch.bool)
    mask[skipped] = True
    for a, b in zip(after, before):
        assert torch.equal(a[mask], b[mask])  # nothing written in a skipped tile
        assert bool((a[~mask] != b[~mask]).any())  # the other tiles stepped
    g = exact_gradient(x, dy)
    assert stats[1].item() == {"dy": 3, "x": 2, "overflow": 3}[poison]
    assert stats[0].item() == pytest.approx(float((g[~mask] ** 2).sum()), rel=1e-6)  # finite tiles only


def test_the_first_row_of_a_band_moves_the_rounding_bits():
    """A data-parallel band steps rows row0.. of the whole weight: its stochastic bits are
    those of those rows in the whole weight, not of rows 0.. of the band."""
    rule = get_rule("adamw")
    group = make_group(rule, HP)
    x, dy = exact_inputs((33, 130), 70, generator=torch.Generator().manual_seed(2))
    whole = torch.linspace(-0.5, 0.5, 70 * 130).view(70, 130).bfloat16()
    band = whole[30:].clone()
    for w, d, row0 in ((whole, dy, 0), (band, dy[:, 30:], 30)):
        args = pack_args(rule.prepare(group, rule.host_init()), 1, 77, "cpu", row0)
        reference_fused_update(x, d, w, [torch.zeros(w.shape), torch.zeros(w.shape), None], args, torch.zeros(2),
                               "adamw", True)
    assert torch.equal(band, whole[30:])
    shifted = whole[30:].clone()
    args = pack_args(rule.prepare(group, rule.host_init()), 1, 77, "cpu", 0)
    reference_fused_update(x, dy[:, 30:], shifted, [torch.zeros(40, 130), torch.zeros(40, 130), None], args,
                           torch.zeros(2), "adamw", True)
    assert not torch.equal(shifted, band)


def test_round_to_nearest_is_torchs_rounding():
    x = torch.randn(4096) * torch.exp2(torch.randint(-60, 60, (4096,)).float())
    x[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.4e38])  # ties to even; near the top
    got = round_to_bf16(x, torch.arange(4096), salt=0, step=0, slot=0, stochastic=False)
    assert got.dtype == torch.bfloat16 and torch.equal(got, x.bfloat16())


def test_an_unsplittable_codec_block_is_refused():
    from forge_hf.core.codecs import CODECS, QuantisedSlot

    w = torch.zeros(8, 128)
    slot = QuantisedSlot.empty_like(w, CODECS["absmax8"], False)
    args = pack_args(get_rule("adamw").prepare(make_group(get_rule("adamw"), {}), {"step": 0}), 1, 0, "cpu")
    with pytest.raises(ValueError, match=r"BLOCK_K=32 splits 64-element codec blocks: use a multiple of 64"):
        reference_fused_update(torch.zeros(2, 128), torch.zeros(2, 8), w, [slot, None, None], args, torch.zeros(2),
                               "adamw", True, blocks=(64, 32, 64))


# ------------------------------------------------------------ the optimizer's row step


def _rows_setup(dtype=torch.float32):
    rule = get_rule("adamw")
    consts = torch.tensor(rule.prepare(make_group(rule, HP), rule.host_init()), dtype=torch.float32).unbind()
    w = torch.linspace(-0.5, 0.5, 70 * 130).view(70, 130).to(dtype)
    slots = [torch.zeros(70, 130, dtype=dtype), torch.zeros(70, 130, dtype=dtype), None]
    return w, slots, consts


def test_rule_rows_give_the_fused_steps_bits():
    """A chunk of rows stepped from its gradient gives the bits the fused step gives those
    rows from x and dy: the same rule code, the same element indices for the rounding."""
    x, dy = exact_inputs((33, 130), 70, generator=torch.Generator().manual_seed(3))
    g = exact_gradient(x, dy).float()
    w, slots, consts = _rows_setup(torch.bfloat16)
    fused_w, fused_slots = w.clone(), [s.clone() for s in slots[:2]] + [None]
    args = pack_args(list(map(float, consts)), 1, 9, "cpu")
    reference_fused_update(x, dy, fused_w, fused_slots, args, torch.zeros(2), "adamw", True)
    total = 0.0
    for r0 in range(0, 70, 16):
        rows = slice(r0, min(r0 + 16, 70))
        total += float(reference_rule_rows("adamw", w, g[rows], slots, rows, consts, torch.tensor(True),
                                           salt=9, step=1, stochastic=True))
    assert torch.equal(w, fused_w)
    assert torch.equal(slots[0], fused_slots[0]) and torch.equal(slots[1], fused_slots[1])
    assert total == pytest.approx(float((g.double() ** 2).sum()), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rule_rows_write_nothing_where_not_ok(dtype):
    w, slots, consts = _rows_setup(dtype)
    g = torch.randn(70, 130)
    g[3, 7] = float("nan")
    before = [w.clone(), slots[0].clone(), slots[1].clone()]
    rows = slice(10, 40)
    reference_rule_rows("adamw", w, g[rows], slots, rows, consts, torch.tensor(False), salt=1, step=1,
                        stochastic=True)
    for a, b in zip([w, *slots[:2]], before):
        assert torch.equal(a, b)
    reference_rule_rows("adamw", w, g[rows], slots, rows, consts, torch.tensor(True), salt=1, step=1,
                        stochastic=True)
    for a, b in zip([w, *slots[:2]], before):
        assert torch.equal(a[:10], b[:10]) and torch.equal(a[40:], b[40:])  # only the given rows
        assert not torch.equal(a[rows], b[rows])
