"""A fused layer's one route for what it held until the optimizer step
(FusedWeightMixin.forge_step_held, nn/held_gradient.py), without an optimizer: a stash is
stepped by the kernel a backward runs, over the same tokens (data parallel: gathered once, by
forge_gather, in either route); a buffer by the whole-gradient step it is handed."""

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from forge_hf.nn.conv1d import ForgeConv1D
from forge_hf.nn.held_gradient import HeldGradient
from forge_hf.nn.linear import ForgeLinear

IN, OUT, TOKENS = 24, 40, 6


class TwoRanks:
    """The data-parallel seam of rank 0 of two ranks that see the same batch: every token
    twice (the output gradient averaged), the first half of the rows stepped here."""

    mode, group = "sharded", None

    def __init__(self):
        self.gathers = 0

    def announce_tokens(self, n_tokens):
        pass

    def gather_tokens(self, x2, dy2):
        self.gathers += 1
        return torch.cat([x2, x2]), torch.cat([dy2, dy2]) / 2

    def rows(self, n_rows):
        return 0, (n_rows + 1) // 2

    def share_rows(self, weight):
        pass

    def wait(self):
        pass


def layer_pair(seed=0):
    """Two fused twins of one linear (the reference backend: the same arithmetic on any device)."""
    torch.manual_seed(seed)
    plain = torch.nn.Linear(IN, OUT)
    return [ForgeLinear.from_linear(_copy(plain), backend="reference", lr=1e-2) for _ in range(2)]


def _copy(linear):
    twin = torch.nn.Linear(linear.in_features, linear.out_features)
    twin.load_state_dict(linear.state_dict())
    return twin


def backward(layer, x, dy):
    layer(x.clone().requires_grad_(True)).backward(dy)


@pytest.mark.parametrize("data_parallel", [False, True])
def test_a_held_stash_steps_as_the_backward_would(data_parallel):
    """Held (the stash), then stepped by forge_step_held: the weight, state and statistics of
    the layer whose backward stepped, bit for bit; data parallel, each route gathers once."""
    held, stepped = layer_pair()
    seams = [TwoRanks(), TwoRanks()] if data_parallel else [None, None]
    for layer, seam in zip((held, stepped), seams):
        layer.__dict__["forge_dp"] = seam
        layer.__dict__["_forge_one_process"] = True  # no process group here
    held.forge_held = HeldGradient("stash")
    x, dy = torch.randn(TOKENS, IN), torch.randn(TOKENS, OUT)
    before = held.weight.detach().clone()
    backward(held, x, dy)
    assert torch.equal(held.weight, before) and not held.forge_held.empty
    with torch.no_grad():  # as ForgeOptimizer.step runs it
        held.forge_step_held(step_gradient=None)  # a stash never asks for the whole-gradient step
    backward(stepped, x, dy)
    assert held.forge_held.empty and not torch.equal(held.weight, before)
    assert torch.equal(held.weight, stepped.weight)
    assert torch.equal(held.forge_stats, stepped.forge_stats)
    for a, b in zip(held.forge_state.slots, stepped.forge_state.slots):
        assert (a is None and b is None) or torch.equal(a, b)
    if data_parallel:
        assert [s.gathers for s in seams] == [1, 1]
        rows = seams[0].rows(OUT)[1]
        assert torch.equal(held.weight[rows:], before[rows:])  # another rank's rows: not stepped here


@pytest.mark.parametrize("transposed", [False, True])
def test_a_held_buffer_is_stepped_through_the_given_step_scaled(transposed):
    """The buffer (two backwards summed in fp32), scaled by the clip's factor, reaches the
    whole-gradient step in the weight's own layout (a Conv1D's (in, out)); what that step
    returns joins the layer's statistics; nothing is held after."""
    torch.manual_seed(1)
    if transposed:
        layer = ForgeConv1D.from_conv1d(Conv1D(OUT, IN), backend="reference")
    else:
        layer = ForgeLinear.from_linear(torch.nn.Linear(IN, OUT), backend="reference")
    layer.forge_held = HeldGradient("buffer")
    xs, dys = [torch.randn(TOKENS, IN) for _ in range(2)], [torch.randn(TOKENS, OUT) for _ in range(2)]
    for x, dy in zip(xs, dys):
        backward(layer, x, dy)
    expected = sum(dy.t() @ x for x, dy in zip(xs, dys)) * 0.5  # (out, in)
    given = []

    def step_gradient(g):
        given.append(g)
        return torch.tensor(3.0), torch.tensor(1.0)

    with torch.no_grad():
        layer.forge_step_held(step_gradient, scale=torch.tensor(0.5))
    (g,) = given
    assert g.shape == tuple(layer.weight.shape)
    torch.testing.assert_close(g.t() if transposed else g, expected, rtol=1e-5, atol=1e-5)
    assert layer.forge_stats.tolist() == [3.0, 1.0]
    assert layer.forge_held.empty


def test_a_scaled_stash_scales_the_narrower_side_once():
    """Clipping a stash: the narrower of the tokens and the output gradient times the factor,
    so that their product is the scaled gradient."""
    hold = HeldGradient("stash")
    x, dy = torch.randn(TOKENS, IN), torch.randn(TOKENS, OUT)
    hold.add(x, dy)
    sx, sdy = hold.tokens_and_gradients(scale=torch.tensor(0.25))
    assert torch.equal(sdy, dy) and torch.equal(sx, x * 0.25)  # IN < OUT: the inputs
    torch.testing.assert_close(sdy.t() @ sx, 0.25 * (dy.t() @ x))
