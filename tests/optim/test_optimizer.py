"""ForgeOptimizer on tiny Llama models: torch.optim semantics for the non-fused parameters,
schedulers driving the fused layers, harmless step()/zero_grad(), exact checkpoints,
non-finite tiles, and the README's plain-PyTorch loop."""

import copy
import io
import warnings

import pytest
import torch
import transformers
from torch import nn
from transformers import LlamaForCausalLM

from forge_hf import ForgeLinear
from forge_hf.nn.linear import ForgeFallbackWarning
from forge_hf.optim.optimizer import ForgeOptimizer, default_decay_parameter_names
from forge_hf.optim.patch import patch_model
from tests.helpers import DEVICE, RTOL_FP32, assert_close_rel, exact_inputs
from tests.helpers import tiny_llama as small_llama

VOCAB, SEQ = 128, 16


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    return small_llama(VOCAB, seed=seed)


def batches(n: int, batch_size: int = 4, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen) for _ in range(n)]


def patched(optimizer: str = "adamw", seed: int = 0, **options) -> LlamaForCausalLM:
    """Every linear fused (min_params=0: the layers are tiny), on the PyTorch backend."""
    model = tiny_llama(seed)
    patch_model(model, optimizer=optimizer, **{"backend": "reference", "min_params": 0, **options})
    return model


def torch_twin(model: nn.Module, cls, **hyperparameters) -> torch.optim.Optimizer:
    """torch.optim over Hugging Face's decay / no-decay groups, single-tensor path."""
    decay = set(default_decay_parameter_names(model))
    named = list(model.named_parameters())
    wd = hyperparameters.pop("weight_decay")
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": wd},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return cls(groups, foreach=False, **hyperparameters)


def train_step(model, optimizer, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def assert_models_close(a: nn.Module, b: nn.Module, rtol=RTOL_FP32):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert_close_rel(pa.detach(), pb.detach(), rtol, what=name)


def fused_weights(model) -> dict[str, torch.Tensor]:
    return {n: m.weight for n, m in model.named_modules() if isinstance(m, ForgeLinear)}


# ------------------------------------------------------------ torch.optim semantics

TWINS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))),
    "nadam": (torch.optim.NAdam, dict(lr=1e-3, weight_decay=0.05)),
    "radam": (torch.optim.RAdam, dict(lr=1e-3, weight_decay=0.05)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-4, weight_decay=0.01, momentum=0.9)),  # step 1 is sign-like
    "adagrad": (torch.optim.Adagrad,
                dict(lr=1e-2, weight_decay=0.01, lr_decay=0.01, initial_accumulator_value=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=1e-1, weight_decay=0.01, momentum=0.9, nesterov=True)),
}


@pytest.mark.parametrize("rule", sorted(TWINS))
def test_matches_torch_optim_on_a_model(rule):
    cls, hp = TWINS[rule]
    model, reference = patched(rule), tiny_llama()
    optimizer = ForgeOptimizer(model, **hp)
    twin = torch_twin(reference, cls, **hp)
    for step, ids in enumerate(batches(4)):
        for opt in (optimizer, twin):  # a changing lr, set the way a scheduler does
            for group in opt.param_groups:
                group["lr"] = hp["lr"] * (1 + step) / 4
        assert train_step(model, optimizer, ids) == pytest.approx(train_step(reference, twin, ids), rel=1e-5)
    assert_models_close(model, reference)


def test_groups_hold_every_trainable_parameter_and_drive_the_fused_layers():
    model = patched()
    model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = ForgeOptimizer(model, lr=1e-3, weight_decay=0.1)
    trainable = {p for p in model.parameters() if p.requires_grad}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(held) == len(trainable) and set(held) == trainable
    decay, no_decay = optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    norms = {p for n, p in model.named_parameters() if "norm" in n}
    assert norms <= set(no_decay["params"])
    for layer in (m for m in model.modules() if isinstance(m, ForgeLinear)):
        assert layer.forge_group is decay  # the group dict itself, not a copy
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, 2, 10)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
        assert model.model.layers[1].mlp.down_proj.forge_group["lr"] == scheduler.get_last_lr()[0]


def test_hyperparameters_default_to_the_patched_ones_and_unknown_names_fail():
    model = patched("sgd", momentum=0.9)
    assert ForgeOptimizer(model, lr=0.1).defaults["momentum"] == 0.9
    with pytest.raises(TypeError, match="momentun"):
        ForgeOptimizer(model, momentun=0.9)
    with pytest.raises(ValueError, match="patch_model"):
        ForgeOptimizer(tiny_llama())


# ------------------------------------------------------- step() and zero_grad()


def test_step_twice_or_never_leaves_fused_weights_alone():
    model = patched()
    optimizer = ForgeOptimizer(model, lr=1e-2)
    before = {n: w.detach().clone() for n, w in fused_weights(model).items()}
    optimizer.step()  # no backward yet: nothing has a gradient
    optimizer.zero_grad()
    for n, w in fused_weights(model).items():
        assert torch.equal(w, before[n]), n
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()  # the fused weights step here
    after_backward = {n: w.detach().clone() for n, w in fused_weights(model).items()}
    assert all(w.grad is None for w in fused_weights(model).values())
    assert not any(torch.equal(after_backward[n], before[n]) for n in before)
    optimizer.step()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.zero_grad()
    for n, w in fused_weights(model).items():
        assert torch.equal(w, after_backward[n]), n


def test_weight_read_outside_its_layer_falls_back_to_step():
    """A fused weight with a second consumer takes the ordinary path in each such step
    (linear.py); step() then applies the rule to its whole gradient, with the layer's own state."""

    class Shared(nn.Module):
        def __init__(self, proj):
            super().__init__()
            self.proj = proj

        def forward(self, x):
            return self.proj(x) + x @ self.proj.weight.t()  # a second consumer of the weight

    torch.manual_seed(0)
    model = Shared(nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    model.proj = ForgeLinear.from_linear(model.proj, backend="reference")
    optimizer = ForgeOptimizer(model, lr=1e-2, weight_decay=0.1)
    twin = torch_twin(reference, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        x = torch.randn(4, 8)
        for m, opt in ((model, optimizer), (reference, twin)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ForgeFallbackWarning)
                m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    # the second consumer is there in every step: each step takes the ordinary path
    assert model.proj.forge_fallback() is not None and model.proj.forge_state.step == 3
    assert_models_close(model, reference)


@pytest.mark.parametrize("rule,precision", [("adamw", "fp32"), ("lion", "fp32"), ("rmsprop", "fp32"), ("sgd", "fp32"),
                                            ("adamw", "bf16"), ("adamw", "int8"), ("adamw", "al8")])
def test_unfused_layer_is_stepped_like_the_fused_one(rule, precision):
    """forge_enabled=False: the layer returns W.grad and step() applies the same rule to it,
    with the layer's own state, stored the same way (same rounding stream: same salt)."""
    gen = torch.Generator().manual_seed(0)
    base = nn.Linear(100, 70)
    model = nn.ModuleList(ForgeLinear.from_linear(copy.deepcopy(base), optimizer=rule, state_precision=precision,
                                                  backend="reference") for _ in range(2))
    model[1].forge_enabled = False
    momentum = dict(momentum=0.9) if rule in ("rmsprop", "sgd") else {}
    optimizer = ForgeOptimizer(model, lr=1e-2, **momentum)
    for _ in range(3):
        x, dy = exact_inputs((5, 9, 100), 70, generator=gen)  # exact gradients: no summation-order noise
        for layer in model:
            layer(x).backward(dy)
        assert model[1].weight.grad is not None and model[0].weight.grad is None
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(model[0].weight, model[1].weight)
    fused, unfused = (m.forge_state.state_dict() for m in model)
    assert fused.keys() == unfused.keys() and fused["step"] == 3
    for key, value in fused.items():
        assert torch.equal(value, unfused[key]) if torch.is_tensor(value) else value == unfused[key], key


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_bf16_ordinary_parameters_use_the_layers_rounding(rounding):
    """A norm weight of 1.0 has a bf16 step of 2**-7: an Adam step of 1e-4 vanishes when
    rounded to nearest and survives, on average, when rounded stochastically."""
    model = tiny_llama().to(torch.bfloat16)
    patch_model(model, backend="reference", min_params=0, rounding=rounding)
    optimizer = ForgeOptimizer(model, lr=1e-4)
    norm = model.model.norm.weight
    before = norm.detach().clone()
    for ids in batches(3):
        train_step(model, optimizer, ids)
    moved = (norm != before).float().mean().item()
    assert (moved > 0.01) if rounding == "stochastic" else (moved == 0.0)


# ---------------------------------------------------------------- checkpoints


def _round_trip(optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # what Trainer's resume does


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_dict_resumes_bit_identically(precision):
    data = batches(6)
    model = patched(state_precision=precision)
    optimizer = ForgeOptimizer(model, lr=1e-2, weight_decay=0.1)
    for ids in data[:3]:
        train_step(model, optimizer, ids)
    for group in optimizer.param_groups:
        group["lr"] = 5e-3  # hyperparameters travel with the checkpoint
    saved = _round_trip(optimizer)

    resumed = patched(state_precision=precision)
    resumed.load_state_dict(model.state_dict())
    resumed_optimizer = ForgeOptimizer(resumed, lr=1.0)
    resumed_optimizer.load_state_dict(saved)
    layer = resumed.model.layers[0].self_attn.q_proj
    assert layer.forge_group is resumed_optimizer.param_groups[0]  # re-linked to the new groups
    assert layer.forge_group["lr"] == 5e-3 and layer.forge_state.step == 3
    for ids in data[3:]:
        train_step(model, optimizer, ids)
        train_step(resumed, resumed_optimizer, ids)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------ non-finite tiles


def test_nonfinite_tiles_are_skipped_counted_and_can_stop_training():
    layer = ForgeLinear.from_linear(nn.Linear(300, 200), backend="reference")
    model = nn.Sequential(layer)
    optimizer = ForgeOptimizer(model, lr=1e-2)
    x, dy = exact_inputs((16, 300), 200)
    x[3, 10] = float("inf")  # column 10 of the gradient: the 4 tiles of column block 0 (64 wide)
    before = layer.weight.detach().clone()
    layer(x).backward(dy)
    optimizer.step()
    assert optimizer.pop_nonfinite_tiles() == 4
    assert optimizer.pop_nonfinite_tiles() == 0
    assert torch.equal(layer.weight[:, :64], before[:, :64])
    assert not torch.equal(layer.weight[:, 64:], before[:, 64:])
    assert torch.isfinite(optimizer.last_grad_norm)

    optimizer.stop_on_nonfinite = True
    layer(x).backward(dy)
    with pytest.raises(FloatingPointError, match="stop_on_nonfinite"):
        optimizer.step()


def test_nonfinite_gradient_of_an_ordinary_parameter_writes_nothing():
    model = patched()
    optimizer = ForgeOptimizer(model, lr=1e-2)
    norm = model.model.norm.weight
    before = norm.detach().clone()
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    norm.grad[0] = float("nan")
    optimizer.step()
    assert torch.equal(norm, before)
    assert optimizer.pop_nonfinite_tiles() == 1


# ------------------------------------------------------------------ README loop


def test_readme_plain_pytorch_loop():
    """The loop the README shows, against torch AdamW on an unpatched copy."""
    model, reference = tiny_llama(), tiny_llama()
    report = patch_model(model, optimizer="adamw", state_precision="fp32", backend="reference", min_params=0)
    assert len(report.fused) == 15  # 7 per decoder layer and lm_head
    optimizer = ForgeOptimizer(model, lr=2e-3, weight_decay=0.01)
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, 2, 8)
    twin = torch_twin(reference, torch.optim.AdamW, lr=2e-3, weight_decay=0.01)
    twin_scheduler = transformers.get_cosine_schedule_with_warmup(twin, 2, 8)
    for ids in batches(8):
        assert model.model.layers[0].mlp.up_proj.forge_group["lr"] == scheduler.get_last_lr()[0]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # fused layers are updated here, with this step's lr
        optimizer.step()  # the rest: embeddings, norms, biases, skipped layers
        optimizer.zero_grad()
        scheduler.step()
        assert loss.item() == pytest.approx(train_step(reference, twin, ids), rel=1e-5)
        twin_scheduler.step()
    assert_models_close(model, reference)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_non_fused_step_in_chunks_is_bit_identical(precision):
    """The non-fused step walks big tensors (embeddings) a chunk of rows at a time to bound
    its temporaries; the result must not depend on the chunk size."""
    results = []
    for chunk in (ForgeOptimizer.CHUNK, 40):
        model = patched(state_precision=precision).to(torch.bfloat16)
        opt = ForgeOptimizer(model, lr=1e-2, weight_decay=0.01)
        opt.CHUNK = chunk  # 40 elements: many chunks, some not a whole number of rows
        for ids in batches(2):
            train_step(model, opt, ids)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_non_fused_step_through_the_kernel_matches_the_pytorch_path(precision):
    """With the Triton backend the non-fused tensors (embeddings, norms) are stepped by the
    fused kernel reading their gradient: same rule, same rounding, same bits; and their
    squared sums, which the kernel adds into one pair for all of them, give the same
    gradient norm as the PyTorch path's sums tensor by tensor."""
    results, first_norms = [], []
    for backend in ("reference", "triton"):
        model = patched(state_precision=precision, backend=backend).to(DEVICE, torch.bfloat16)
        opt = ForgeOptimizer(model, lr=1e-2, weight_decay=0.01)
        assert opt._kernel == (backend == "triton")
        for ids in batches(2):
            train_step(model, opt, ids.to(DEVICE))
            if len(first_norms) < len(results) + 1:
                first_norms.append(opt.last_grad_norm.item())  # the first step's: same weights, same gradients
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert first_norms[1] == pytest.approx(first_norms[0], rel=1e-5)
    for name, ref in results[0].items():
        got = results[1][name]
        if "embed" in name or "norm" in name:  # stepped by ForgeOptimizer
            same = (got.view(torch.int16) == ref.view(torch.int16)).float().mean()
            assert same >= 0.999, name
