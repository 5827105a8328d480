"""patch_model / unpatch_model: the report and each skip reason, bad arguments, patching
twice, unpatching, nn.Linear subclasses, the runtime multi-consumer fallback and its
place in the report, gradient checkpointing, Liger and PEFT composition. Model-wide
exactness is in test_patch_models.py (whose tiny models and comparison these tests
reuse)."""

import copy
import re
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.esm.modeling_esmfold import EsmFoldLinear
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.pytorch_utils import Conv1D

from forge_hf.nn.conv1d import ForgeConv1D
from forge_hf.nn.linear import ForgeFallbackWarning, ForgeLinear
from forge_hf.optim.optimizer import ForgeOptimizer
from forge_hf.optim.patch import (
    ADAPTER,
    BELOW_MIN_PARAMS,
    EXCLUDED,
    EXPERT_TENSOR,
    FELL_BACK,
    FLOAT16,
    FROZEN,
    LIGER_LM_HEAD,
    LINEAR_MAP_SUBCLASSES,
    NOT_INCLUDED,
    SHARED,
    TIED,
    UNSUPPORTED,
    patch_model,
    unpatch_model,
)
from tests.optim.test_optimizer import assert_models_close, batches, patched, torch_twin, train_step
from tests.optim.test_patch_models import (
    CASES,
    HP,
    STEPS,
    Case,
    assert_trained_alike,
    build,
    no_fallback,
    run_pair,
    tiny_llama,
    tiny_lora,
    train,
)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(4, 8, 8))


class SubLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class Zoo(nn.Module):
    """One module per skip reason, plus three fusable ones."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.conv = Conv1D(24, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.shared_a, self.shared_b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.shared_b.weight = self.shared_a.weight
        self.twice = nn.Linear(8, 8)
        self.again = nn.ModuleList([self.twice])  # the same module under a second name
        self.small = nn.Linear(2, 2)
        self.sub = SubLinear(8, 8)
        self.experts = Experts()
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def test_report_gives_each_skip_reason_and_prints_a_table():
    model = Zoo()
    report = patch_model(model, min_params=16, backend="reference")
    assert report.fused_names == ["up", "down", "conv"]
    assert report.skip_reasons() == {
        "frozen": FROZEN, "shared_a": SHARED, "shared_b": SHARED, "twice": SHARED,
        "small": BELOW_MIN_PARAMS, "sub": UNSUPPORTED, "head": TIED, "experts.gate_up": EXPERT_TENSOR,
    }
    assert type(model.up) is ForgeLinear and type(model.conv) is ForgeConv1D
    assert type(model.frozen) is nn.Linear and type(model.twice) is nn.Linear
    assert [m.shape for m in report.fused] == [(32, 8), (8, 32), (24, 8)]  # (out, in), Conv1D too
    assert report.fused_params == 256 + 256 + 192
    assert report.gradient_bytes_saved == 4 * report.fused_params
    assert [m.layer_index for m in report.fused] == [0, 1, 2]
    text = str(report)
    assert "3 modules fused (704 parameters" in text and "8 skipped" in text
    for needle in ("2.8 KiB of gradients", "Conv1D  24 x 8", "tied to the input embedding embed",
                   "also belongs to shared_b.weight", "registered under more than one name",
                   "4 weights < min_params=16", "SubLinear", "3-D expert tensor", "4 x 8 x 8"):
        assert needle in text, needle


def test_bf16_weights_save_two_bytes_per_parameter():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).bfloat16()
    report = patch_model(model, min_params=0)
    assert report.gradient_bytes_saved == 2 * report.fused_params == 2 * (64 + 32)


def test_fp16_weight_is_skipped_with_its_cause_and_fix():
    model = nn.Sequential(nn.Linear(8, 8).half(), nn.Linear(8, 8), nn.Linear(8, 8).double())
    report = patch_model(model, min_params=0)
    assert report.fused_names == ["1"]
    assert report.skip_reasons() == {"0": FLOAT16, "2": UNSUPPORTED}
    fp16 = next(line for line in str(report).splitlines() if line.startswith("0 "))  # the layer's own row
    for words in ("float16: fused steps need float32 or bfloat16 weights", "gradient scaler",
                  "load the model in bfloat16, or in float32 and train with bf16=True"):
        assert words in fp16, fp16
    assert "float64 is not supported" in report.skipped[1].detail


def test_all_fp16_weights_warn_with_the_cause():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).half()
    with pytest.warns(UserWarning, match=r"fused no module of Sequential \(its float16 weights are not fused, .*"
                                         r"load the model in bfloat16, or in float32 and train with bf16=True\): "
                                         r"skipped 2 float16"):
        patch_model(model, min_params=0)


def test_default_min_params_keeps_tiny_layers_and_says_so():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.warns(UserWarning, match="fused no module of Sequential .pass min_params=0"):
        report = patch_model(model)
    assert report.skip_reasons() == {"0": BELOW_MIN_PARAMS}


@pytest.mark.parametrize("pattern,expected", [
    ("lm_head", {"lm_head"}),
    ("q_proj", {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}),
    ("layers.1.mlp", {f"model.layers.1.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")}),
    ("model.layers.*.self_attn.[kv]_proj",
     {f"model.layers.{i}.self_attn.{c}_proj" for i in (0, 1) for c in "kv"}),
])
def test_exclude_and_include_patterns_match_whole_name_parts(pattern, expected):
    model = tiny_llama()
    report = patch_model(model, exclude=pattern, min_params=0)
    assert {s.name for s in report.skipped if s.reason == EXCLUDED} == expected
    assert len(report.fused) == 15 - len(expected)
    unpatch_model(model)
    report = patch_model(model, include=[pattern], min_params=0)
    assert set(report.fused_names) == expected
    assert all(s.reason == NOT_INCLUDED for s in report.skipped)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(optimizer="adamx"), ValueError, "unknown optimizer 'adamx' for forge: choose one of"),
    (dict(state_precision="fp8"), ValueError, "unknown state_precision='fp8': choose one of"),
    (dict(rounding="up"), ValueError, "unknown rounding='up'"),
    (dict(backend="cuda"), ValueError, "unknown backend='cuda'"),
    (dict(exclude="qproj"), ValueError, "exclude pattern 'qproj' matches no linear module of LlamaForCausalLM"),
    (dict(include=["q_proj", "mlp.gate"]), ValueError, "include pattern 'mlp.gate' matches no linear module"),
    (dict(include=[""]), TypeError, "non-empty strings"),
    (dict(min_params=-1), ValueError, "min_params=-1 is not a count"),
    (dict(momentum=0.9), TypeError, r"unknown hyperparameter\(s\) \['momentum'\] for forge adamw"),
    (dict(lr=-1.0), ValueError, "invalid learning rate lr=-1.0"),
])
def test_bad_arguments_name_the_value_and_change_nothing(kwargs, error, match):
    model = tiny_llama()
    with pytest.raises(error, match=match):
        patch_model(model, **kwargs)
    assert not any(isinstance(m, ForgeLinear) for m in model.modules())


def test_a_bare_layer_is_refused():
    with pytest.raises(TypeError, match="use ForgeLinear.from_linear"):
        patch_model(nn.Linear(4, 4))


def test_patching_twice_keeps_modules_and_state():
    case = CASES["llama"]
    model = tiny_llama()
    first = patch_model(model, min_params=0, backend="reference", **HP)
    train(model, case, steps=1)
    layer = model.model.layers[0].self_attn.q_proj
    again = patch_model(model, min_params=0, backend="reference", **HP)
    assert model.model.layers[0].self_attn.q_proj is layer and layer.forge_state.step == 1
    assert again.fused == first.fused and again.skipped == first.skipped
    with pytest.raises(ValueError, match=r"already fused with .* call forge_hf.unpatch_model\(model\) first"):
        patch_model(model, optimizer="sgd", min_params=0)
    with pytest.warns(UserWarning, match="lm_head is no longer fused .excluded.: its fused optimizer state is dropped"):
        report = patch_model(model, exclude="lm_head", min_params=0)
    assert type(model.lm_head) is nn.Linear and report.skip_reasons() == {"lm_head": EXCLUDED}
    assert model.model.layers[0].self_attn.q_proj is layer


def test_unpatch_restores_plain_modules_with_the_same_parameters_and_hooks():
    model = Zoo()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    calls = []
    model.up.register_forward_hook(lambda *a: calls.append("up"))
    handle = model.conv.register_forward_hook(lambda *a: calls.append("conv"))
    patch_model(model, min_params=0, backend="reference")
    assert type(model.up) is ForgeLinear and list(model.state_dict()) == keys
    handle.remove()  # a handle taken before patching still works
    restored = unpatch_model(model)
    assert restored == ["up", "down", "conv", "small"]
    assert type(model.up) is nn.Linear and type(model.conv) is Conv1D and type(model.small) is nn.Linear
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    model.up(torch.randn(2, 8)).sum().backward()
    model.conv(torch.randn(2, 8))
    assert calls == ["up"] and model.up.weight.grad is not None  # plain autograd again
    assert unpatch_model(model) == []


class InitOnlyLinear(nn.Linear):
    """A subclass that keeps nn.Linear's forward (as EsmFoldLinear does)."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.init = "glorot"


def test_subclasses_with_the_plain_map_are_fused_and_restored_with_their_class():
    model = nn.Sequential(InitOnlyLinear(8, 8), FalconLinear(8, 8), EsmFoldLinear(8, 8), SubLinear(8, 8))
    report = patch_model(model, min_params=0, backend="reference")
    assert report.fused_names == ["0", "1", "2"] and report.skip_reasons() == {"3": UNSUPPORTED}
    assert [type(m) for m in model[:3]] == [ForgeLinear] * 3 and model[0].init == "glorot"
    assert unpatch_model(model) == ["0", "1", "2"]
    assert [type(m) for m in model] == [InitOnlyLinear, FalconLinear, EsmFoldLinear, SubLinear]
    assert all(not k.startswith("forge_") for m in model for k in vars(m))


@pytest.mark.parametrize("bias", [True, False])
def test_listed_subclasses_compute_exactly_the_parent_map(bias):
    """LINEAR_MAP_SUBCLASSES holds, in the installed transformers, what it says."""
    import importlib

    for qualified, plain in LINEAR_MAP_SUBCLASSES.items():
        module, _, name = qualified.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, plain) and cls.forward is not plain.forward, qualified
        torch.manual_seed(0)
        layer, x = cls(16, 24, bias=bias), torch.randn(3, 5, 16)
        torch.testing.assert_close(layer(x), plain.forward(layer, x), rtol=1e-6, atol=1e-6)


# Every nn.Linear / Conv1D subclass in transformers' models, by what its forward does, as
# read in transformers 5.25. A new one fails the test below until it is read and placed.
KEEPS_PARENT_FORWARD = {"EsmFoldLinear"}
OWN_FORWARD = {  # refused (UNSUPPORTED): each computes more than the linear map
    "DeepseekV4GroupedLinear": "grouped bmm over n_groups slices of the weight",
    "DoryLMHead": "scales the logits by a learned per-token vector",
    "ErgoLinearWithFP32Output": "casts its operands and computes fp32 logits outside autocast",
    "IdeficsDecoupledLinear": "concatenates a second linear's output",
    "Llama4Router": "top-k and sigmoid of the logits",
    "Ovis2_5VisualEmbeddingProjection": "an embedding lookup through the transposed weight (lookup=True)",
    "PhimoeTopKRouter": "input jitter and sparsemixer routing",
}


def test_every_linear_subclass_in_transformers_is_placed():
    import transformers

    found, bases = {}, {"Linear", "Conv1D"}
    sources = {p: p.read_text() for p in Path(transformers.__file__).parent.glob("models/*/modeling_*.py")}
    while True:  # subclasses of subclasses too
        for path, text in sources.items():
            for name, base in re.findall(r"^class (\w+)\(([\w.]+)\):", text, re.M):
                if base.rpartition(".")[2] in bases:
                    found[name] = path.parent.name
        if set(found) <= bases:
            break
        bases |= set(found)
    listed = {q.rpartition(".")[2] for q in LINEAR_MAP_SUBCLASSES}
    assert set(found) == listed | KEEPS_PARENT_FORWARD | set(OWN_FORWARD), found


def test_deepcopy_of_a_patched_model_watches_its_own_weights():
    model = nn.Sequential(nn.Linear(8, 8))
    patch_model(model, min_params=0, backend="reference")
    twin = copy.deepcopy(model)
    assert twin[0].weight is not model[0].weight
    with pytest.warns(ForgeFallbackWarning, match="forge: 0 falls back"):
        F.linear(torch.randn(2, 8), twin[0].weight).sum().backward()
    assert "read directly" in twin[0].forge_fallback() and model[0].forge_fallback() is None


# ----------------------------------------------------------------------------- consumers


class OneLinear(nn.Module):
    """A linear that ``use`` consumes in some way; returns an object with ``.loss``."""

    def __init__(self, use):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.use = use

    def forward(self, x):
        return types.SimpleNamespace(loss=self.use(self, x).square().mean())


USES = {
    "called_twice": lambda m, x: m.lin(torch.tanh(m.lin(x))),
    # the direct reader's backward runs (and its AccumulateGrad fires) before the fused node
    "read_after_call": lambda m, x: m.lin(x) + F.linear(x.flip(0), m.lin.weight),
    # ... and after it: caught in the fused node's backward, before the step
    "read_before_call": lambda m, x: F.linear(x.flip(0), m.lin.weight) + m.lin(x),
    "read_only": lambda m, x: F.linear(x, m.lin.weight, m.lin.bias),  # module never called
}


@pytest.mark.parametrize("use", sorted(USES))
def test_multi_consumer_weight_falls_back_once_and_trains_exactly(use):
    case = Case(lambda: OneLinear(USES[use]), batch=lambda gen: dict(x=torch.randn(4, 5, 16, generator=gen)))
    with pytest.warns(ForgeFallbackWarning) as caught:
        report, forge_model, torch_model, grads = run_pair(case)
        train(forge_model, case)
    assert report.fused_names == ["lin"]
    assert [str(w.message).split(":")[1] for w in caught] == [" lin falls back to the ordinary optimizer"]
    # the cause is there in every step: on the ordinary path in each, warned once
    assert forge_model.lin.forge_enabled and forge_model.lin.forge_fallback() is not None
    assert_trained_alike(forge_model, torch_model, grads)


class SometimesShared(nn.Module):
    """``lin`` consumed by ``use`` in the steps where ``shared`` is set, else called once."""

    def __init__(self, use):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.use = use
        self.shared = False

    def forward(self, x):
        return (self.use(self, x) if self.shared else self.lin(x)).square().mean()


# read_only: the module is not called in the shared steps; ForgeOptimizer.step() ends the
# fused step before, so the direct reader's gradient is this step's, not one after a step
@pytest.mark.parametrize("use", sorted(USES))
def test_a_fallback_for_one_step_fuses_again_once_its_gradient_is_consumed(use):
    torch.manual_seed(0)
    model = SometimesShared(USES[use])
    reference = copy.deepcopy(model)
    report = patch_model(model, min_params=0, backend="reference")
    optimizer = ForgeOptimizer(model, lr=1e-2, weight_decay=0.1)
    twin = torch_twin(reference, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    layer = model.lin
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shared in (True, False, True, True, False):
            x = torch.randn(4, 5, 16, generator=gen)
            for m in (model, reference):
                m.shared = shared
                m(x).backward()
            assert (layer.weight.grad is not None) == shared  # a fused step leaves no gradient
            for opt in (optimizer, twin):
                opt.step()
                opt.zero_grad()
            text = str(report)  # up to date without update_fallbacks
            if shared:
                assert report.fused == [] and [s.name for s in report.fell_back] == ["lin"]
                assert ", 1 fell back," in report.summary() and "fell back  kind" in text
                assert f"fell_back: {layer.forge_fallback()} (last step; it fuses again" in text
            else:
                assert report.fused_names == ["lin"] and report.fell_back == [] and "fell back" not in text
    warned = [str(w.message) for w in caught if issubclass(w.category, ForgeFallbackWarning)]
    assert len(warned) == 1, warned  # the cause came back in two more steps: told once
    assert "lin falls back to the ordinary optimizer: " in warned[0] and "fuses again" in warned[0]
    assert layer.forge_enabled and layer.forge_state.step == 5  # one state, whichever path stepped it
    assert_models_close(model, reference)


def test_a_patched_model_in_eval_mode_trains_as_in_train_mode():
    """from_pretrained returns a model in eval mode: its fused layers step the same bits as
    in train mode (the model has no dropout), and none falls back."""
    models = {mode: patched() for mode in ("train", "eval")}
    models["eval"].eval()
    optimizers = {mode: ForgeOptimizer(m, lr=1e-3, weight_decay=0.1) for mode, m in models.items()}
    report = patch_model(models["eval"], backend="reference", min_params=0)  # fused already: the same layers
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForgeFallbackWarning)
        for ids in batches(3):
            for mode, m in models.items():
                train_step(m, optimizers[mode], ids)
    assert not models["eval"].training and report.fell_back == [] and " fell back" not in str(report)
    for (name, a), b in zip(models["eval"].named_parameters(), models["train"].parameters()):
        assert torch.equal(a, b), name
    for name, layer in models["eval"].named_modules():
        if isinstance(layer, ForgeLinear):
            assert layer.forge_state.step == 3 and layer.weight.grad is None, name


def test_the_report_moves_a_layer_that_falls_back_and_says_why():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    report = patch_model(model, min_params=0, backend="reference")
    assert report.update_fallbacks(model) == [] and report.gradient_bytes_saved == 2 * 4 * 64
    with pytest.warns(ForgeFallbackWarning):
        F.linear(model(torch.randn(2, 8)), model[1].weight).sum().backward()
    moved = report.update_fallbacks(model)
    assert [(s.name, s.reason) for s in moved] == [("1", FELL_BACK)] and report.fell_back == moved
    assert report.fused_names == ["0"] and report.gradient_bytes_saved == 4 * 64
    assert "received a gradient from outside the module" in moved[0].detail
    assert report.summary().startswith("forge patch: 1 modules fused") and ", 1 fell back," in report.summary()
    assert "fell back  kind" in str(report) and "fell_back: its weight received a gradient" in str(report)
    assert report.update_fallbacks(model) == []  # recorded once


def _fused(**kwargs):
    layer = ForgeLinear.from_linear(nn.Linear(16, 16), backend="reference", **kwargs)
    layer.forge_name = "lin"
    return layer


def test_gradient_from_another_backward_after_the_step_is_dropped_with_a_warning():
    layer = _fused()
    layer(torch.randn(3, 16)).sum().backward()
    assert layer.forge_state.step == 1
    with pytest.warns(ForgeFallbackWarning, match="lin falls back to the ordinary optimizer for good: .* that "
                                                  "gradient was dropped"):
        layer.weight.square().sum().backward()
    assert layer.weight.grad is None and not layer.forge_enabled
    for _ in range(2):  # for good: the next steps, without the second backward, stay on the ordinary path
        layer(torch.randn(3, 16)).sum().backward()
        assert layer.weight.grad is not None and layer.forge_state.step == 1
        layer.weight.grad = None
    assert "that gradient was dropped" in layer.forge_fallback()


def test_the_report_says_a_fallback_for_good_is_for_good():
    model = nn.Sequential(nn.Linear(16, 16))
    report = patch_model(model, min_params=0, backend="reference")
    model(torch.randn(3, 16)).sum().backward()
    with pytest.warns(ForgeFallbackWarning, match="for good"):
        model[0].weight.square().sum().backward()
    model(torch.randn(3, 16)).sum().backward()
    text = str(report)
    assert "that gradient was dropped, so this step's update used only the module's own share (for good)" in text
    assert report.fused == [] and [s.name for s in report.fell_back] == ["0"]


def test_a_stale_saved_weight_fails_loudly_instead_of_using_the_new_value():
    layer = _fused()
    other = layer.weight.square().sum()  # saves the weight at its current version
    layer(torch.randn(3, 16)).sum().backward()  # steps it in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()


def test_backward_twice_through_a_stepped_layer_is_refused():
    layer = _fused()
    out = layer(torch.randn(3, 16)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice through lin, whose weight was already stepped"):
        out.backward()


def test_gradient_of_the_input_alone_does_not_step_the_weight():
    layer = _fused(optimizer="sgd", lr=0.1)
    before = layer.weight.detach().clone()
    x = torch.randn(3, 16, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).sum(), [x])
    assert torch.allclose(gx, before.sum(0).expand(3, 16))
    assert torch.equal(layer.weight, before) and layer.forge_state.step == 0 and layer.forge_enabled


def test_input_without_grad_and_no_bias_still_steps():
    layer = ForgeLinear.from_linear(nn.Linear(16, 16, bias=False), optimizer="sgd", lr=0.1, backend="reference")
    before = layer.weight.detach().clone()
    layer(torch.randn(3, 16)).sum().backward()
    assert layer.forge_state.step == 1 and not torch.equal(layer.weight, before)


# ----------------------------------------------------------------------------- composition


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradient_checkpointing_gives_the_same_weights(reentrant):
    case = CASES["llama"]
    with no_fallback():
        _, plain, torch_model, grads = run_pair(case)
        train(plain, case)
        _, checkpointed, _, _ = run_pair(case)
        checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        calls = []
        checkpointed.model.layers[0].mlp.up_proj.register_forward_hook(lambda *a: calls.append(1))
        train(checkpointed, case)
    assert len(calls) == 2 * STEPS  # forward, then recomputed in backward
    for (name, a), b in zip(checkpointed.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name  # the recomputed forward is the same forward
    assert_trained_alike(checkpointed, torch_model, grads)


def _liger(model):
    """Liger's kernels on ``model``: all of them on GPU; on CPU only the fused linear
    cross-entropy, the one that runs under the Triton interpreter."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    # Liger also rebinds transformers' module-level classes and functions, for every Llama
    # built later in this process (on CPU tensors in other tests): keep it to this model
    saved, forward = dict(vars(modeling_llama)), modeling_llama.LlamaForCausalLM.forward
    gpu = next(model.parameters()).is_cuda
    try:
        apply_liger_kernel_to_llama(rope=gpu, rms_norm=gpu, swiglu=gpu, fused_linear_cross_entropy=True, model=model)
    finally:
        vars(modeling_llama).update(saved)
        modeling_llama.LlamaForCausalLM.forward = forward
    return model


def test_liger_fused_linear_cross_entropy_keeps_lm_head_on_the_ordinary_path(device):
    case = Case(lambda: _liger(tiny_llama().to(device)))
    with no_fallback():
        report, forge_model, torch_model, grads = run_pair(case, device)
        train(forge_model, case)
    assert report.skip_reasons() == {"lm_head": LIGER_LM_HEAD} and len(report.fused) == 14
    assert_trained_alike(forge_model, torch_model, grads)


def test_liger_applied_after_patching_is_caught_at_runtime(device):
    case = CASES["llama"]
    torch_model = _liger(build(case, device))
    forge_model = build(case, device)
    report = patch_model(forge_model, min_params=0, backend="reference", **HP)
    assert "lm_head" in report.fused_names
    _liger(forge_model)  # from now on lm_head.weight is read directly, the module never runs
    grads = {}
    train(torch_model, case, record=grads)
    with pytest.warns(ForgeFallbackWarning, match="lm_head falls back .* read directly"):
        train(forge_model, case)
    assert forge_model.lm_head.forge_enabled and "read directly" in forge_model.lm_head.forge_fallback()
    assert_trained_alike(forge_model, torch_model, grads)


def test_peft_adapters_stay_on_the_ordinary_path_unless_min_params_is_0():
    import peft

    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                              modules_to_save=["lm_head"]))
    adapters = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".lora_" in n}
    # min_params=1: every adapter (4 x 32 = 128 weights) is above it, and still left alone
    report = patch_model(model, min_params=1, backend="reference")
    assert {n for n, r in report.skip_reasons().items() if r == ADAPTER} == adapters and len(adapters) == 8
    assert "a PEFT adapter (rank 4)" in str(report)
    assert report.fused_names == ["base_model.model.lm_head.modules_to_save.default"]  # a trained full copy
    unpatch_model(model)
    assert set(patch_model(model, min_params=0, backend="reference").fused_names) == adapters | {
        "base_model.model.lm_head.modules_to_save.default"}


def test_a_lora_model_with_the_default_min_params_fuses_nothing_and_says_how_to():
    model = tiny_lora()
    with pytest.warns(UserWarning, match=r"fused no module of PeftModel \(pass min_params=0 to fuse "
                                         r"small layers and PEFT adapters\): skipped 15 frozen, 8 adapter"):
        report = patch_model(model)
    assert report.fused == []


def test_peft_lora_save_pretrained_and_merge_work_on_a_patched_model(tmp_path):
    from safetensors.torch import load_file

    case = CASES["lora"]
    with no_fallback():
        report, forge_model, torch_model, grads = run_pair(case)
        train(forge_model, case)
    assert all(".lora_" in n for n in report.fused_names)
    forge_model.save_pretrained(tmp_path / "forge")
    torch_model.save_pretrained(tmp_path / "torch")
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("forge", "torch"))
    assert ours.keys() == theirs.keys() and len(ours) == 8
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-5 * theirs[key].abs().max().item())
    merged, reference = forge_model.merge_and_unload(), torch_model.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is nn.Linear
    ids = torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(merged.eval()(ids).logits, reference.eval()(ids).logits, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ state_precision="auto"


def _train_llama(dtype, steps=3, **options):
    """A tiny Llama of ``dtype`` patched with ``options`` and trained ``steps`` steps on fixed
    batches (every parameter on the ordinary path or fused): (model, report, optimizer)."""
    torch.manual_seed(0)
    model = tiny_llama().to(dtype)
    report = patch_model(model, min_params=0, backend="reference", **options)
    optimizer = ForgeOptimizer(model, lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, report, optimizer


@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, "bf16"), (torch.float32, "fp32")])
def test_auto_state_precision_is_the_weights_dtype_and_steps_as_that_precision(dtype, expected):
    auto, report, optimizer = _train_llama(dtype)
    explicit, _, _ = _train_llama(dtype, state_precision=expected)
    name = str(dtype).removeprefix("torch.")
    assert report.summary().endswith(f"state_precision={expected} (auto: {name} weights), rounding=stochastic")
    assert {state.stored_precision for state in optimizer.state.values()} == {expected}
    assert all(s.dtype == dtype for state in optimizer.state.values() for s in state.slots if s is not None)
    for a, b in zip(auto.parameters(), explicit.parameters()):
        assert torch.equal(a, b)  # the same bits as the precision named


def test_auto_state_precision_with_two_weight_dtypes_says_which_took_what():
    model = tiny_llama()
    model.model.layers[1].to(torch.bfloat16)
    report = patch_model(model, min_params=0, backend="reference")
    assert "state_precision=auto: bf16 for bfloat16 weights, fp32 for float32 weights," in report.summary()
    again = patch_model(model, min_params=0, backend="reference")  # patched already: auto makes the same choice
    assert again.summary() == report.summary()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels run on Hopper GPUs")
def test_bf16_weights_with_the_defaults_take_the_gluon_kernel_and_bf16_states(monkeypatch):
    from forge_hf.kernels.launch import persistent_launch

    taken = []
    launch = persistent_launch.PersistentLaunch.__call__

    def spy(self, *args):
        taken.append(launch(self, *args))
        return taken[-1]

    monkeypatch.setattr(persistent_launch.PersistentLaunch, "__call__", spy)
    weights, summaries = [], []
    for options in ({}, dict(state_precision="bf16")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(384, 256, bias=False), nn.Linear(256, 384, bias=False))
        model = model.to("cuda", torch.bfloat16)
        summaries.append(patch_model(model, **options).summary())
        optimizer = ForgeOptimizer(model, lr=1e-3)
        generator = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16, generator=generator)
            model(x).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
    assert "state_precision=bf16 (auto: bfloat16 weights)" in summaries[0]
    assert len(taken) == 2 * 2 * 3 and all(taken)  # both layers, both runs, every step: the persistent Gluon kernel
    for a, b in zip(*weights):
        assert torch.equal(a, b)
