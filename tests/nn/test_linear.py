"""ForgeLinear as a module: parameters kept, no weight gradient, plain under no_grad,
fused in eval mode as in train mode, autocast, non-finite tiles, grad-norm sums, bad arguments."""

import copy
import math
import warnings

import pytest
import torch

from forge_hf import ForgeFallbackWarning, ForgeLinear
from forge_hf.kernels.triton.fused_update import default_blocks
from tests.helpers import exact_gradient, exact_inputs


def test_from_linear_reuses_parameters_and_to_linear_restores_them():
    lin = torch.nn.Linear(20, 10)
    layer = ForgeLinear.from_linear(lin)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert list(layer.state_dict()) == list(lin.state_dict())
    back = layer.to_linear()
    assert type(back) is torch.nn.Linear and back.weight is lin.weight and back.bias is lin.bias


def test_backward_gives_input_and_bias_grads_but_no_weight_grad(backend, device):
    torch.manual_seed(0)
    lin = torch.nn.Linear(33, 17, device=device)
    ref = torch.nn.Linear(33, 17, device=device)
    ref.load_state_dict(lin.state_dict())
    layer = ForgeLinear.from_linear(lin, optimizer="sgd", lr=0.1, backend=backend)
    x = torch.randn(2, 5, 33, device=device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer(xa).sum().backward()
    ref(xb).sum().backward()
    assert lin.weight.grad is None
    torch.testing.assert_close(xa.grad, xb.grad)  # formed from the weight before the update
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)
    torch.testing.assert_close(lin.weight, ref.weight - 0.1 * ref.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_no_grad_and_inference_mode_are_plain_linear(mode):
    lin = torch.nn.Linear(8, 4)
    layer = ForgeLinear.from_linear(lin, backend="reference").train(mode == "train")
    before = lin.weight.detach().clone()
    x = torch.randn(3, 8)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            out = layer(x)
        assert out.grad_fn is None
        torch.testing.assert_close(out, torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert torch.equal(lin.weight, before) and layer.forge_state.step == 0


def test_eval_mode_backward_steps_the_weight_as_train_mode_does():
    """Fusion does not depend on module.training: a backward in eval mode steps the weight
    with the bits of a train-mode twin, and nothing falls back."""
    lin = torch.nn.Linear(24, 16)
    layers = {mode: ForgeLinear.from_linear(copy.deepcopy(lin), optimizer="adamw", lr=1e-2, weight_decay=0.1,
                                            backend="reference") for mode in ("train", "eval")}
    layers["eval"].eval()
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForgeFallbackWarning)
        for _ in range(3):
            x, dy = torch.randn(5, 24, generator=gen), torch.randn(5, 16, generator=gen)
            for layer in layers.values():
                layer(x).backward(dy)
    train, eval_ = layers["train"], layers["eval"]
    assert not eval_.training and eval_.forge_enabled and eval_.forge_fallback() is None
    assert eval_.weight.grad is None and eval_.forge_state.step == train.forge_state.step == 3
    assert torch.equal(eval_.weight, train.weight) and torch.equal(eval_.bias.grad, train.bias.grad)
    for key, value in train.forge_state.state_dict().items():
        other = eval_.forge_state.state_dict()[key]
        assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key


def test_fallback_returns_ordinary_gradient():
    lin = torch.nn.Linear(12, 6, bias=False)
    layer = ForgeLinear.from_linear(lin, backend="reference")
    layer.forge_enabled = False
    x, dy = exact_inputs((9, 12), 6)
    before = lin.weight.detach().clone()
    layer(x).backward(dy)
    torch.testing.assert_close(lin.weight.grad, exact_gradient(x, dy).float())
    assert torch.equal(lin.weight, before)


def test_autocast_bf16_with_fp32_weights(backend, device):
    lin = torch.nn.Linear(64, 48, bias=False, device=device)
    layer = ForgeLinear.from_linear(lin, optimizer="sgd", lr=1.0, backend=backend)
    x, dy = exact_inputs((20, 64), 48, device=device)
    before = lin.weight.detach().clone()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and lin.weight.dtype == torch.float32
    y.backward(dy.bfloat16())
    # exact inputs are bf16-representable, so the fp32 update is exact
    torch.testing.assert_close(lin.weight, before - exact_gradient(x, dy).float().to(device), rtol=0, atol=0)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_autocast_is_left_on_only_where_it_would_cast_nothing(backend, device, weight_dtype, monkeypatch):
    """bf16 tokens, weight and bias under bf16 autocast: the fused forward runs without
    switching autocast off (no cast to make), with the bits of a step without autocast;
    fp32 weights still get autocast's casts."""
    x, dy = exact_inputs((20, 64), 48, dtype=torch.bfloat16, device=device)
    runs = {}
    for autocast in (False, True):
        lin = torch.nn.Linear(64, 48, device=device).to(weight_dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.linspace(-0.5, 0.5, 48 * 64).view(48, 64))
            lin.bias.copy_(torch.linspace(-0.1, 0.1, 48))
        layer = ForgeLinear.from_linear(lin, optimizer="adamw", lr=1e-2, backend=backend)
        entered = []
        real = torch.autocast

        def recording(*args, entered=entered, real=real, **kwargs):
            entered.append(kwargs.get("enabled"))
            return real(*args, **kwargs)

        with real(device.type, dtype=torch.bfloat16, enabled=autocast):
            monkeypatch.setattr(torch, "autocast", recording)
            y = layer(x)
            monkeypatch.setattr(torch, "autocast", real)
        y.backward(dy)
        assert entered == ([False] if autocast and weight_dtype == torch.float32 else [])
        runs[autocast] = (y.detach(), lin.weight.detach(), lin.bias.grad)
    if weight_dtype == torch.bfloat16:
        for a, b in zip(runs[False], runs[True]):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_nonfinite_tile_is_skipped_and_counted(backend, device):
    lin = torch.nn.Linear(100, 80, bias=False, device=device)
    layer = ForgeLinear.from_linear(lin, optimizer="sgd", lr=0.1, backend=backend)
    x, dy = exact_inputs((10, 100), 80, device=device)
    dy[3, 5] = float("nan")  # poisons gradient row 5: every tile of the first tile row
    before = lin.weight.detach().clone()
    layer(x).backward(dy)
    block_k = 64 if backend == "reference" else default_blocks(80, 100, 10)[1]
    assert default_blocks(80, 100, 10)[0] == 64 or backend == "reference"
    assert layer.forge_stats[1].item() == -(-100 // block_k)
    assert torch.equal(lin.weight[:64], before[:64]), "non-finite tiles must not be written"
    g = exact_gradient(x, dy)[64:].float().to(device)
    torch.testing.assert_close(lin.weight[64:], before[64:] - 0.1 * g, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(layer.forge_stats[0], (g.double() ** 2).sum().float(), rtol=1e-6, atol=0)


def test_gradient_square_sum_matches_true_norm(backend, device):
    lin = torch.nn.Linear(150, 70, bias=False, device=device)
    layer = ForgeLinear.from_linear(lin, backend=backend)
    x, dy = exact_inputs((4, 30, 150), 70, device=device)
    layer(x).backward(dy)
    true = exact_gradient(x, dy).norm()
    assert math.isclose(layer.forge_stats[0].sqrt().item(), true.item(), rel_tol=1e-6)


def test_lr_is_read_at_each_backward():
    lin = torch.nn.Linear(6, 5, bias=False)
    layer = ForgeLinear.from_linear(lin, optimizer="sgd", lr=0.5, backend="reference")
    x, dy = exact_inputs((4, 6), 5)
    g = exact_gradient(x, dy).float()
    w0 = lin.weight.detach().clone()
    layer.forge_group["lr"] = 0.25
    layer(x).backward(dy)
    torch.testing.assert_close(lin.weight, w0 - 0.25 * g)


@pytest.mark.parametrize("kwargs,match", [
    (dict(optimizer="adamx"), "unknown optimizer 'adamx'"),
    (dict(state_precision="fp8"), "unknown state_precision='fp8'"),
    (dict(rounding="up"), "unknown rounding='up'"),
    (dict(backend="cuda"), "unknown backend='cuda'"),
    (dict(lr=-1.0), "invalid learning rate lr=-1.0"),
    (dict(betas=(0.9, 1.5)), r"invalid betas=\(0.9, 1.5\)"),
    (dict(optimizer="sgd", betas=(0.9, 0.99)), r"unknown hyperparameter\(s\) \['betas'\] for forge sgd"),
    (dict(optimizer="adamw", momentum=0.9), r"unknown hyperparameter\(s\) \['momentum'\]"),
])
def test_bad_arguments_name_the_value(kwargs, match):
    lin = torch.nn.Linear(4, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        ForgeLinear.from_linear(lin, **kwargs)
    assert type(lin) is torch.nn.Linear and lin.weight.grad is None  # nothing was changed


def test_fp16_weight_is_refused():
    with pytest.raises(ValueError, match="float16 is not supported"):
        ForgeLinear.from_linear(torch.nn.Linear(4, 4).half())


def test_low_beta_is_refused_at_step():
    layer = ForgeLinear.from_linear(torch.nn.Linear(4, 4), betas=(0.3, 0.999), backend="reference")
    with pytest.raises(ValueError, match="use a beta above 0.5"):
        layer(torch.randn(2, 4)).sum().backward()


def test_nesterov_without_momentum_is_refused():
    layer = ForgeLinear.from_linear(torch.nn.Linear(4, 4), optimizer="sgd", nesterov=True, backend="reference")
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        layer(torch.randn(2, 4)).sum().backward()


@pytest.mark.gpu
def test_changing_lr_never_recompiles():
    from forge_hf.kernels.triton.fused_update import fused_update_kernel

    lin = torch.nn.Linear(256, 192, device="cuda", dtype=torch.bfloat16)
    layer = ForgeLinear.from_linear(lin, backend="triton", state_precision="bf16")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def compiled():  # Triton keeps one compiled binary per specialisation, per device
        return len(fused_update_kernel.device_caches[torch.cuda.current_device()][0])

    layer(x).sum().backward()
    n = compiled()
    for step in range(5):
        layer.forge_group["lr"] = 1e-3 * (step + 2)
        layer(x).sum().backward()
    torch.cuda.synchronize()
    assert compiled() == n
