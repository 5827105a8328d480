"""ForgeConv1D (forge_hf/nn/conv1d.py): transformers' Conv1D, whose weight is stored (in,
out), trains as ForgeLinear trains the transposed weight, bit for bit; it adopts and
releases a Conv1D's own Parameter objects and hooks."""

import warnings

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from forge_hf.core.codecs import QuantisedSlot
from forge_hf.nn.conv1d import ForgeConv1D
from forge_hf.nn.linear import ForgeFallbackWarning, ForgeLinear
from tests.helpers import exact_inputs

N_IN, N_OUT, STEPS = 130, 70, 2
PRECISIONS = [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float32, "al8")]

pytestmark = pytest.mark.usefixtures("single_thread")


def _pair(dtype, precision, backend, device):
    """A ForgeConv1D and a ForgeLinear holding the same weight, (in, out) and (out, in)."""
    torch.manual_seed(0)
    conv = Conv1D(N_OUT, N_IN).to(device=device, dtype=dtype)
    conv.bias.data.uniform_(-0.1, 0.1)
    linear = torch.nn.Linear(N_IN, N_OUT, device=device, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    options = dict(optimizer="adamw", state_precision=precision, rounding="stochastic", seed=3, backend=backend,
                   lr=1e-2, weight_decay=0.1)
    return ForgeConv1D.from_conv1d(conv, **options), ForgeLinear.from_linear(linear, **options)


def _logical_slots(layer):
    return [s.read() if isinstance(s, QuantisedSlot) else s for s in layer.forge_state.kernel_slots()
            if s is not None]


@pytest.mark.parametrize("dtype,precision", PRECISIONS, ids=lambda p: str(p))
def test_conv1d_trains_as_linear_on_the_transposed_weight(dtype, precision, backend, device):
    conv, linear = _pair(dtype, precision, backend, device)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x, dy = exact_inputs((3, 11, N_IN), N_OUT, dtype=dtype, device=device, generator=gen)
        x_conv, x_linear = x.clone().requires_grad_(), x.clone().requires_grad_()
        conv(x_conv).backward(dy)
        linear(x_linear).backward(dy)
        assert torch.equal(conv.weight.t(), linear.weight), f"weight after step {step + 1}"
        torch.testing.assert_close(x_conv.grad, x_linear.grad)  # a matmul of either layout: dtype's tolerance
    assert conv.weight.shape == (N_IN, N_OUT) and conv.weight.grad is None
    assert torch.equal(conv.bias.grad, linear.bias.grad)
    # the states are stored in each parameter's own layout, equal as (out, in)
    stored = conv.forge_state.slots[0]
    assert (stored.codes if isinstance(stored, QuantisedSlot) else stored).shape == conv.weight.shape
    for a, b in zip(_logical_slots(conv), _logical_slots(linear)):
        assert torch.equal(a, b)
    # each tile's squared sum is added to the statistics atomically, in the order the GPU runs
    # the tiles: the totals agree to fp32 round-off, not bit for bit (the states above do)
    torch.testing.assert_close(conv.forge_stats, linear.forge_stats, rtol=1e-6, atol=0)
    assert conv.forge_state.step == linear.forge_state.step == STEPS


def test_from_conv1d_shares_the_parameters_and_hooks_and_to_conv1d_gives_them_back():
    conv = Conv1D(6, 4)
    weight, bias = conv.weight, conv.bias
    calls = []
    conv.register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    layer = ForgeConv1D.from_conv1d(conv, optimizer="sgd", lr=0.5, backend="reference")
    assert layer.weight is weight and layer.bias is bias
    assert list(layer.state_dict()) == ["weight", "bias"]  # checkpoints keep their keys
    x = torch.randn(2, 3, 4)
    expected = Conv1D.forward(conv, x)
    before = weight.detach().clone()
    y = layer(x)  # the fused path: F.linear on the transposed view
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    assert calls == ["ForgeConv1D"]
    assert weight.grad is None and not torch.equal(weight, before)  # stepped inside backward
    plain = layer.to_conv1d()
    assert type(plain) is Conv1D and plain.weight is weight and plain.bias is bias
    assert not any(k.lstrip("_").startswith("forge_") for k in vars(plain))
    stepped = weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForgeFallbackWarning)  # the fused layer's gradient hook is gone
        plain(x).sum().backward()
    assert calls[-1] == "Conv1D"
    assert weight.grad is not None and torch.equal(weight, stepped)  # an ordinary optimizer's job now


def test_a_fused_conv1d_built_from_sizes_stores_its_weight_in_out():
    layer = ForgeConv1D(12, 5, optimizer="lion", state_precision="bf16", backend="reference")
    assert layer.weight.shape == (5, 12) and layer.nf == 12 and layer.nx == 5
    assert layer.forge_weight_view().shape == (12, 5) and layer.forge_state.transposed is True
    assert repr(layer) == "ForgeConv1D(nf=12, nx=5, optimizer=lion, state_precision=bf16, rounding=stochastic)"
    layer(torch.randn(7, 5)).sum().backward()
    assert layer.forge_state.slots[0].shape == (5, 12)  # the parameter's layout, read transposed


def test_from_conv1d_refuses_another_module():
    linear = torch.nn.Linear(4, 6)
    with pytest.raises(TypeError, match="from_conv1d needs a transformers Conv1D, got Linear"):
        ForgeConv1D.from_conv1d(linear)
