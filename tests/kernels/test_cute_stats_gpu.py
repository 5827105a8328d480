"""The QuACK epilogue's tile statistics and non-finite skip (kernels/cute/tile_stats.py) on a
Hopper GPU, against the Triton kernel: a finite step gives its bits and the gradient's squared
sum; a 128 x 128 CTA tile holding a non-finite gradient is left as it was and counted, every
other tile is the Triton kernel's. Exact inputs (tests/helpers.py) make the gradient
independent of summation order, so the tensors are compared bit for bit."""

import pytest
import torch

from forge_hf.core.launch_args import pack_args
from forge_hf.core.rules import get_rule, make_group
from forge_hf.kernels import cute
from tests.helpers import exact_gradient, exact_inputs, quack_on_hopper

BF16 = torch.bfloat16
N, K, T = 1000, 1496, 777  # out, in, tokens: no multiple of the tile
TILE = 128  # the CTA tile of wgrad_epilogue.DEFAULT_CONFIG: the skip's granularity


pytestmark = quack_on_hopper()


@pytest.fixture(scope="module")
def kernels():
    return cute.load()


def _layer(seed=0):
    """x, dy, the weight, its moments (bf16, on the GPU) and the argument row of a third step."""
    g = torch.Generator().manual_seed(seed)
    x, dy = exact_inputs((T, K), N, dtype=BF16, generator=g)
    w = (torch.randn(N, K, generator=g) * 0.02).to(BF16)
    m = (torch.randn(N, K, generator=g) * 1e-4).to(BF16)
    v = (torch.rand(N, K, generator=g) * 1e-6).to(BF16)
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-3, weight_decay=0.01))
    host = rule.host_init()
    for _ in range(3):
        scalars = rule.prepare(group, host)
    return [t.cuda() for t in (x, dy, w, m, v)], pack_args(scalars, host["step"], 1234, "cuda")


def _cute_step(kernels, x, dy, w, m, v, args, stochastic, with_stats=True):
    w, m, v = w.clone(), m.clone(), v.clone()
    stats = torch.zeros(2, device="cuda") if with_stats else None
    kernels.fused_step(x, dy, w, [m, v], args, "adamw", stochastic=stochastic, stats=stats)
    torch.cuda.synchronize()
    return (w, m, v), stats


def _triton_step(x, dy, w, m, v, args, stochastic):
    from forge_hf.kernels.dispatch import launch_fused_update

    w, m, v = w.clone(), m.clone(), v.clone()
    launch_fused_update(x, dy, w, [m, v, None], args, torch.zeros(2, device="cuda"), "adamw", stochastic,
                        blocks=(64, 64, 64))  # blocks: the Triton kernel, not a Gluon one
    torch.cuda.synchronize()
    return w, m, v


def _bits(t):
    return t.view(torch.int16)


def _tile_sumsq(grad):
    """Each TILE x TILE tile's squared gradient sum in float64, (tiles down, tiles across)."""
    rows, cols = -(-grad.shape[0] // TILE), -(-grad.shape[1] // TILE)
    padded = grad.new_zeros(rows * TILE, cols * TILE)
    padded[:grad.shape[0], :grad.shape[1]] = grad
    return padded.square().reshape(rows, TILE, cols, TILE).sum((1, 3))


def _assert_rel(got, want, rtol=1e-5):
    assert abs(got - want) <= rtol * abs(want), f"{got} against {want}"


@pytest.mark.parametrize("stochastic", [True, False])
def test_a_finite_step_gives_the_triton_kernels_bits_and_the_squared_sum(kernels, stochastic):
    (x, dy, w, m, v), args = _layer()
    got, stats = _cute_step(kernels, x, dy, w, m, v, args, stochastic)
    want = _triton_step(x, dy, w, m, v, args, stochastic)
    assert not torch.equal(_bits(got[0]), _bits(w))
    for a, b in zip(got, want):
        assert torch.equal(_bits(a), _bits(b))
    assert stats[1].item() == 0
    _assert_rel(stats[0].item(), exact_gradient(x, dy).square().sum().item())


@pytest.mark.parametrize("with_stats", [True, False])
def test_a_tile_with_a_non_finite_gradient_is_left_as_it_was_and_counted(kernels, with_stats):
    (x, dy, w, m, v), args = _layer()
    dy[5, 300] = float("nan")  # gradient row 300: the tiles of rows 256-383
    x[7, 1400] = float("inf")  # column 1400: the tiles of columns 1280-1407
    dy[9, 900] = 2.0**100  # row 900: finite, but the tiles' squared sums overflow fp32
    sums = _tile_sumsq(exact_gradient(x, dy))
    skipped = ~(sums < 2.0**128)  # NaN compares false
    assert 0 < skipped.sum() < skipped.numel()
    inside = skipped.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:N, :K]

    got, stats = _cute_step(kernels, x, dy, w, m, v, args, True, with_stats)
    want = _triton_step(x, dy, w, m, v, args, True)
    for after, before, triton in zip(got, (w, m, v), want):
        assert torch.equal(_bits(after)[inside], _bits(before)[inside])
        assert torch.equal(_bits(after)[~inside], _bits(triton)[~inside])
    if with_stats:
        assert stats[1].item() == skipped.sum().item()
        _assert_rel(stats[0].item(), sums[~skipped].sum().item())


def test_8bit_states_of_a_skipped_tile_keep_their_codes_and_metadata(kernels):
    """al8 and absmax8 moments: a tile whose gradient is not finite keeps its codes and its
    blocks' metadata; every other tile is the Triton kernel's, codes and metadata alike."""
    from forge_hf.core.state import ForgeState
    from forge_hf.kernels.dispatch import launch_fused_update

    k8 = 1504  # rows of codes: a multiple of 16 bytes
    g = torch.Generator().manual_seed(1)
    x, dy = (t.cuda() for t in exact_inputs((T, k8), N, dtype=BF16, generator=g))
    w0 = (torch.randn(N, k8, generator=g) * 0.02).to(BF16).cuda()
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-3, weight_decay=0.01))

    def two_steps(engine):
        """The weight, codes and metadata after a finite step, and after one with a NaN."""
        w = w0.clone()
        state = ForgeState(rule, "al8", transposed=False)
        state.allocate(w, group)
        slots = state.kernel_slots()
        after = []
        for nan in (False, True):
            grad_dy = dy.clone()
            if nan:
                grad_dy[5, 300] = float("nan")  # gradient row 300: here the tiles of rows 256-383
            args = pack_args(rule.prepare(group, state.host), state.host["step"], 1234, "cuda")
            if engine == "cute":
                kernels.fused_step(x, grad_dy, w, slots, args, "adamw", stochastic=True,
                                   stats=torch.zeros(2, device="cuda"))
            else:
                launch_fused_update(x, grad_dy, w, slots, args, torch.zeros(2, device="cuda"), "adamw", True,
                                    blocks=(64, 64, 64))
            torch.cuda.synchronize()
            after.append([t.clone() for t in (w, slots[0].codes, slots[0].meta, slots[1].codes, slots[1].meta)])
        return after

    cute_first, cute_second = two_steps("cute")
    triton_first, triton_second = two_steps("triton")
    raw = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    for a, b in zip(cute_first, triton_first):
        assert torch.equal(raw(a), raw(b))
    band = torch.zeros(N, dtype=torch.bool, device="cuda")
    band[256:384] = True
    # the finite tiles' weight moves (a moment's codes may not: the same gradient twice scales
    # an absmax block as a whole, which only its metadata records)
    assert not torch.equal(raw(cute_second[0][~band]), raw(cute_first[0][~band]))
    for before, after, triton in zip(cute_first, cute_second, triton_second):
        assert torch.equal(raw(after[band]), raw(before[band]))
        assert torch.equal(raw(after[~band]), raw(triton[~band]))
