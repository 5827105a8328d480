"""ForgeConfig: every option declared once and validated where it is handed in; the
optimizer's param groups the one owner of the hyperparameters."""

import dataclasses

import pytest
import torch
from torch import nn

from forge_hf import ForgeConfig, ForgeLinear, ForgeOptimizer, patch_model
from forge_hf.core.config import DEFAULT_MIN_PARAMS, trainer_keys
from forge_hf.optim.optimizer import fused_layers
from forge_hf.train.arguments import OPTIM_ARGS_HELP, ForgeArguments
from tests.helpers import tiny_llama


def test_the_defaults_and_the_option_sets():
    config = ForgeConfig()
    assert (config.optimizer, config.state_precision, config.rounding, config.backend) == \
        ("adamw", "auto", "stochastic", "auto")
    assert (config.lean_loss, config.recompute_swiglu, config.cuda_graph) == ("auto", "auto", "auto")
    assert config.min_params == DEFAULT_MIN_PARAMS and config.include == () and config.hyperparameters == {}
    # the recipe's forge_* keys and optim_args' keys are the config's trainer keys, nothing else
    assert {f.name for f in dataclasses.fields(ForgeArguments)} == {f"forge_{k}" for k in trainer_keys()}
    assert all(k in OPTIM_ARGS_HELP for k in trainer_keys())
    assert {"optimizer", "seed", "hyperparameters"}.isdisjoint(trainer_keys())


def test_auto_state_precision_follows_each_weights_dtype():
    config = ForgeConfig()
    assert config.state_precision_for(torch.bfloat16) == "bf16"
    assert config.state_precision_for(torch.float32) == "fp32"
    assert config.state_precision_for(torch.float16) == "fp32"  # states only come in fp32 and bf16
    assert ForgeConfig(state_precision="al8").state_precision_for(torch.float32) == "al8"


def test_the_switches_read_true_and_false_as_their_words():
    config = ForgeConfig(lean_loss=True, recompute_swiglu=False, cuda_graph=True)
    assert (config.lean_loss, config.recompute_swiglu, config.cuda_graph) == ("true", "false", "true")


def test_from_options_splits_the_rules_hyperparameters():
    config = ForgeConfig.from_options(optimizer="SGD", state_precision="bf16", lr=0.1, momentum=0.9, include="q_proj")
    assert config.optimizer == "sgd" and config.state_precision == "bf16" and config.include == ("q_proj",)
    assert config.hyperparameters == dict(lr=0.1, momentum=0.9)
    assert config.group()["lr"] == 0.1 and config.group()["dampening"] == 0.0  # the rule's defaults fill in
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rounding = "nearest"


@pytest.mark.parametrize("options,error,match", [
    (dict(optimizer="adamm"), ValueError, "unknown optimizer 'adamm' for forge: .*did you mean 'adamw'"),
    (dict(rounding="nearst"), ValueError, r"unknown rounding='nearst': choose one of \['stochastic', 'nearest'\] "
                                          r"\(did you mean 'nearest'\?\)"),
    (dict(state_precision="int4"), ValueError, r"unknown state_precision='int4': choose one of \['auto', 'fp32'"),
    (dict(cuda_graph="sometimes"), ValueError, r"unknown cuda_graph='sometimes'"),
    (dict(exclude=["q_proj", ""]), TypeError, "non-empty strings"),
    (dict(min_params=True), ValueError, "min_params=True is not a count"),
    (dict(seed=-1), ValueError, "seed=-1 is not a count"),
    (dict(lean_loss="yes"), ValueError, r"unknown lean_loss='yes': choose one of \['auto', 'true', 'false'\]"),
    (dict(recompute_swiglu=1), ValueError, r"unknown recompute_swiglu=1: choose one of \['auto', 'true', 'false'\]"),
    (dict(betas=(0.9, 1.5)), ValueError, r"invalid betas=\(0.9, 1.5\)"),
    (dict(momentun=0.9), TypeError, r"unknown hyperparameter\(s\) \['momentun'\] for forge adamw"),
])
def test_a_bad_option_names_the_value_and_the_fix(options, error, match):
    with pytest.raises(error, match=match):
        ForgeConfig.from_options(**options)


def test_patch_model_refuses_the_trainers_options_and_changes_nothing():
    model = tiny_llama(vocab=64)
    with pytest.raises(TypeError, match=r"patch_model does not take \['cuda_graph', 'lean_loss'\]: ForgeTrainer"):
        patch_model(model, cuda_graph="true", lean_loss=True)
    with pytest.raises(TypeError, match="config='bf16' is not a ForgeConfig"):
        patch_model(model, "bf16")
    assert not fused_layers(model)


def test_every_layer_reads_the_one_config_and_the_optimizer_takes_its_hyperparameters():
    model = tiny_llama(vocab=64)
    config = ForgeConfig(state_precision="bf16", min_params=0, backend="reference",
                         hyperparameters=dict(lr=3e-3, weight_decay=0.0))
    report = patch_model(model, config, seed=7)  # keyword options apply over the config
    layers = fused_layers(model)
    assert report.config.seed == 7 and all(m.forge_config is report.config for m in layers.values())
    optimizer = ForgeOptimizer(model, betas=(0.8, 0.9))
    assert optimizer.config.state_precision == "bf16"
    assert optimizer.defaults["lr"] == 3e-3 and optimizer.defaults["betas"] == (0.8, 0.9)


def _step(layer: ForgeLinear, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    layer(torch.randn(5, layer.in_features, generator=gen)).sum().backward()


def test_the_optimizers_group_is_the_one_owner_of_the_hyperparameters():
    """A layer reads its group in backward: a change to the optimizer's group reaches the
    next step with nothing re-linked, and a loaded state keeps the same group dicts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 10, bias=False))
    patch_model(model, min_params=0, backend="reference", lr=1.0)
    layer = model[0]
    own = layer.forge_group
    assert own["lr"] == 1.0  # without an optimizer: its own one-group holder
    optimizer = ForgeOptimizer(model)
    (group,) = [g for g in optimizer.param_groups if layer.weight in g["params"]]
    assert layer.forge_group is group and group is not own and group["lr"] == 1.0
    group["lr"] = 0.0
    before = layer.weight.detach().clone()
    _step(layer)
    assert torch.equal(layer.weight, before)  # lr 0: read at the step, not copied when linked
    group["lr"] = 1e-2
    _step(layer, 1)
    assert not torch.equal(layer.weight, before)
    saved = optimizer.state_dict()
    group["lr"] = 5.0
    optimizer.load_state_dict(saved)
    assert layer.forge_group is group and group["lr"] == 1e-2  # the loaded values, in the same dict
