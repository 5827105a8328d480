"""Trainer integration: optim="forge_*" names, ForgeTrainer against Trainer(adamw_torch),
the lr the kernels use, grad_norm, checkpoint resume, refusals, accelerate launch."""

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments
from transformers.training_args import OptimizerNames

import forge_hf
from forge_hf.core.config import ForgeConfig
from forge_hf.core.rules import NUM_SCALARS
from forge_hf.integrations.trainer import ForgeTrainer
from forge_hf.integrations.training_args import OPTIMIZER_NAMES, config_from_training_args, register_optimizer_names
from forge_hf.kernels import dispatch
from forge_hf.optim.optimizer import ForgeOptimizer, fused_layers
from tests.helpers import RTOL_FP32, assert_close_rel
from tests.optim.test_optimizer import SEQ, VOCAB, tiny_llama

STEPS = 20
FAST = "backend=reference,min_params=0"  # the PyTorch backend, and fuse these tiny layers


def dataset(n: int = 2 * STEPS, seed: int = 0) -> list[dict]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": x, "labels": x} for x in ids]


def training_args(out, optim="forge_adamw", **overrides) -> TrainingArguments:
    options = dict(output_dir=str(out), optim=optim, use_cpu=True, report_to="none", dataloader_num_workers=0,
                   per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-3, weight_decay=0.01,
                   lr_scheduler_type="cosine", warmup_steps=3, logging_steps=1, save_strategy="no", seed=0,
                   disable_tqdm=True, max_grad_norm=0.0,
                   optim_args=FAST if optim.startswith("forge_") else None)
    options.update(overrides)
    return TrainingArguments(**options)


def step_logs(trainer) -> list[dict]:
    return [log for log in trainer.state.log_history if "loss" in log]


def record_kernel_lrs(monkeypatch) -> dict[int, list[float]]:
    """Optimizer step -> the AdamW lr each fused kernel call was given (args[6] = -lr / (1 - beta1^t))."""
    used: dict[int, list[float]] = {}
    resolve = dispatch.resolve_backend

    def recording(backend, device):
        run = resolve(backend, device)

        def run_and_record(x, dy, weight, slots, args, *rest):
            t = int(args[NUM_SCALARS])
            used.setdefault(t, []).append(-args[:NUM_SCALARS].view(torch.float32)[6].item() * (1 - 0.9**t))
            return run(x, dy, weight, slots, args, *rest)

        return run_and_record

    monkeypatch.setattr(dispatch, "resolve_backend", recording)
    return used


# ------------------------------------------------------------ parity with Trainer


class GradNorms(TrainerCallback):
    """The true norm of the whole gradient before each step (Trainer logs it only when clipping,
    in some versions)."""

    def __init__(self):
        self.norms = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """20 steps of ForgeTrainer(forge_adamw) and of Trainer(adamw_torch), same data and schedule."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        used = record_kernel_lrs(monkeypatch)
        forge = ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path_factory.mktemp("forge")),
                             train_dataset=dataset())
        forge.train()
    plain = Trainer(model=tiny_llama(), args=training_args(tmp_path_factory.mktemp("torch"), "adamw_torch"),
                    train_dataset=dataset(), callbacks=[GradNorms()])
    plain.train()
    return forge, plain, used


def test_losses_and_weights_match_adamw_torch(parity):
    forge, plain, _ = parity
    forge_logs, plain_logs = step_logs(forge), step_logs(plain)
    assert len(forge_logs) == len(plain_logs) == STEPS
    for a, b in zip(forge_logs, plain_logs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    for (name, a), b in zip(forge.model.named_parameters(), plain.model.parameters()):
        assert_close_rel(a.detach(), b.detach(), RTOL_FP32, what=name)


def test_kernels_use_the_logged_lr_of_each_step(parity):
    forge, plain, used = parity
    logged = {log["step"]: log["learning_rate"] for log in step_logs(forge)}
    assert logged == {log["step"]: log["learning_rate"] for log in step_logs(plain)}
    assert logged[1] < logged[2] < logged[3] < logged[4] > logged[10] > logged[STEPS]  # warmup, then cosine
    assert sorted(used) == sorted(logged)
    fused = len(fused_layers(forge.model))
    for step, lrs in used.items():
        assert len(lrs) == fused, step  # every fused layer stepped once per step
        assert lrs == pytest.approx([logged[step]] * len(lrs), rel=1e-6, abs=1e-12), step


def test_grad_norm_is_the_true_gradient_norm(parity):
    forge, plain, _ = parity
    (norms,) = [c.norms for c in plain.callback_handler.callbacks if isinstance(c, GradNorms)]
    assert len(norms) == STEPS
    for log, norm in zip(step_logs(forge), norms):
        assert log["grad_norm"] == pytest.approx(norm, rel=1e-5), log["step"]
        assert log["forge_nonfinite_tiles"] == 0


def test_forge_trainer_patches_and_owns_the_optimizer(parity):
    forge, _, _ = parity
    optimizer = forge.forge_optimizer
    assert isinstance(optimizer, ForgeOptimizer) and optimizer.rule.name == "adamw"
    layer = forge.model.model.layers[0].self_attn.o_proj
    assert layer.forge_group is optimizer.param_groups[0] and layer.forge_state.step == STEPS


@pytest.mark.parametrize("forge_name,optim_args,twin,lr", [
    ("forge_sgd", "momentum=0.9,nesterov=true", (torch.optim.SGD, dict(momentum=0.9, nesterov=True)), 1e-1),
    ("forge_rmsprop", "alpha=0.9,momentum=0.5", (torch.optim.RMSprop, dict(alpha=0.9, momentum=0.5)), 1e-4),
    # a starting sum keeps Adagrad's first steps from dividing a gradient near zero by its own
    # size, which turns the last-bit differences of two backends' gradients into weight differences
    ("forge_adagrad", "lr_decay=0.01,initial_accumulator_value=0.1",
     (torch.optim.Adagrad, dict(lr_decay=0.01, initial_accumulator_value=0.1)), 1e-2),
    ("forge_nadam", "", (torch.optim.NAdam, dict(betas=(0.8, 0.99), eps=1e-7)), 1e-3),
])
def test_hyperparameters_reach_the_rule(tmp_path, forge_name, optim_args, twin, lr):
    """optim_args and the TrainingArguments fields against the torch optimizer they name."""
    common = dict(max_steps=5, learning_rate=lr, warmup_steps=0, adam_beta1=0.8, adam_beta2=0.99,
                  adam_epsilon=1e-7)
    forge = ForgeTrainer(model=tiny_llama(), train_dataset=dataset(),
                         args=training_args(tmp_path / "f", forge_name, optim_args=f"{FAST},{optim_args}",
                                            **common))
    cls, kwargs = twin
    plain = Trainer(model=tiny_llama(), train_dataset=dataset(),
                    args=training_args(tmp_path / "t", "adamw_torch", **common),
                    optimizer_cls_and_kwargs=(cls, dict(kwargs, lr=lr, foreach=False)))
    forge.train()
    plain.train()
    for a, b in zip(step_logs(forge), step_logs(plain)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for (name, a), b in zip(forge.model.named_parameters(), plain.model.parameters()):
        assert_close_rel(a.detach(), b.detach(), RTOL_FP32, what=name)


def test_triton_backend_trains_like_the_reference(tmp_path):
    """The one check through the Triton kernel (interpreted on CPU)."""
    runs = {}
    for backend in ("auto", "reference"):
        trainer = ForgeTrainer(model=tiny_llama(), train_dataset=dataset(),
                               args=training_args(tmp_path / backend, max_steps=2,
                                                  optim_args=f"backend={backend},min_params=0"))
        trainer.train()
        runs[backend] = trainer.model
    for (name, a), b in zip(runs["auto"].named_parameters(), runs["reference"].parameters()):
        assert_close_rel(a.detach(), b.detach(), RTOL_FP32, what=name)


# ------------------------------------------------------------------- resume


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    """Two ForgeOptimizer state_dicts' per-tensor states, bit for bit: values, dtypes, layouts."""
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys(), i
        for key, value in a[i].items():
            other = b[i][key]
            if torch.is_tensor(value):
                assert value.dtype == other.dtype and value.stride() == other.stride(), (i, key)
                assert torch.equal(value, other), (i, key)
            else:
                assert value == other, (i, key)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "al8"])
def test_resume_from_checkpoint_is_bit_identical(tmp_path, precision, rounding, single_thread):
    """bf16 weights (so rounding matters for every precision): 6 steps straight against 3,
    checkpoint, resume, 3 more. The checkpoint's states must load in the precision they were
    saved in (accelerate's wrapping of the optimizer reloads its empty state first)."""
    args = training_args(tmp_path, max_steps=6, save_strategy="steps", save_steps=3, logging_steps=6,
                         optim_args=f"{FAST},state_precision={precision},rounding={rounding}")
    straight = ForgeTrainer(model=tiny_llama().to(torch.bfloat16), args=args, train_dataset=dataset())
    straight.train()
    resumed = ForgeTrainer(model=tiny_llama().to(torch.bfloat16), args=args, train_dataset=dataset())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*is converted to")
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.state.global_step == 6
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    states = straight.forge_optimizer.state_dict()["state"]
    assert any(s["precision"] == precision and "exp_avg" in s for s in states.values())
    assert_same_optimizer_state(states, resumed.forge_optimizer.state_dict()["state"])


# ------------------------------------------------------------ non-finite tiles


def _poison_step(trainer, step: int) -> None:
    """Make every gradient below the last MLP non-finite during optimizer step ``step``."""
    mlp = trainer.model.model.layers[-1].mlp

    def hook(module, inputs, output):
        if trainer.state.global_step + 1 == step:
            output.register_hook(lambda g: g * float("inf"))

    mlp.register_forward_hook(hook)


def test_nonfinite_tiles_are_logged_and_training_goes_on(tmp_path):
    trainer = ForgeTrainer(model=tiny_llama(), train_dataset=dataset(),
                           args=training_args(tmp_path, max_steps=4))
    _poison_step(trainer, 3)
    trainer.train()
    counts = [log["forge_nonfinite_tiles"] for log in step_logs(trainer)]
    assert counts[0] == counts[1] == counts[3] == 0 and counts[2] > 0
    for name, p in trainer.model.named_parameters():
        assert torch.isfinite(p).all(), name


def test_stop_on_nonfinite(tmp_path):
    trainer = ForgeTrainer(model=tiny_llama(), train_dataset=dataset(),
                           args=training_args(tmp_path, max_steps=4,
                                              optim_args=f"{FAST},stop_on_nonfinite=true"))
    _poison_step(trainer, 2)
    with pytest.raises(FloatingPointError, match="stop_on_nonfinite"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_recompute_swiglu_by_default_trains_bit_for_bit(tmp_path):
    weights = []
    for extra in (",recompute_swiglu=false", ""):
        trainer = ForgeTrainer(model=tiny_llama(), train_dataset=dataset(),
                               args=training_args(tmp_path / str(len(weights)), max_steps=3,
                                                  optim_args=FAST + extra))
        trainer.train()
        mlp = trainer.model.model.layers[0].mlp
        assert ("forward" in mlp.__dict__) == (not extra)  # auto: every SwiGLU MLP with a fused down_proj
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
    for a, b in zip(*weights):
        assert torch.equal(a, b)


# ----------------------------------------------------------------- refusals


@pytest.mark.parametrize("overrides,after,match", [
    (dict(fp16=True), None, "fp16=True .* bf16=True"),
    (dict(auto_find_batch_size=True), None, "auto_find_batch_size=True"),
    ({}, lambda args: setattr(args, "deepspeed", {"zero_optimization": {"stage": 2}}), "DeepSpeed"),
    (dict(optim="adamw_torch"), None, "not a forge optimizer"),
    (dict(optim_args=f"{FAST},lr=0.1"), None, "TrainingArguments.learning_rate"),
    (dict(torch_compile=True, use_liger_kernel=True), None, "torch_compile=True with use_liger_kernel=True .* alone"),
], ids=["fp16", "auto_batch", "deepspeed", "not_forge", "lr_in_optim_args", "compile_with_liger"])
def test_refusals(tmp_path, overrides, after, match):
    args = training_args(tmp_path, **overrides)
    if after is not None:
        after(args)
    with pytest.raises(ValueError, match=match):
        ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset())


@pytest.mark.parametrize("overrides,advised", [
    (dict(gradient_accumulation_steps=2), True),
    (dict(gradient_accumulation_steps=2, use_liger_kernel=True), False),
    (dict(gradient_accumulation_steps=1), False),
], ids=["eager", "liger", "no_accumulation"])
def test_accumulating_with_eager_model_ops_is_advised_to_compile(tmp_path, caplog, overrides, advised):
    trainer = ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path, **overrides), train_dataset=dataset())
    with caplog.at_level(logging.WARNING):
        trainer.create_optimizer()
    assert ("set torch_compile=True or use_liger_kernel=True" in caplog.text) is advised


def test_refuses_torch_data_parallel_over_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError, match="n_gpu=2"):
        ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path), train_dataset=dataset())


def _guard_args(**overrides):
    from types import SimpleNamespace

    values = dict(gradient_accumulation_steps=1, fp16=False, deepspeed=None, fsdp=[], n_gpu=1,
                  auto_find_batch_size=False)
    return SimpleNamespace(**{**values, **overrides})


def test_refuses_fsdp():
    from types import SimpleNamespace

    from forge_hf.integrations.trainer import check_training_arguments

    with pytest.raises(ValueError, match="FSDP is not supported"):
        check_training_arguments(_guard_args(fsdp=["full_shard"]))
    with pytest.raises(ValueError, match="FSDP is not supported"):
        check_training_arguments(_guard_args(), SimpleNamespace(distributed_type="FSDP"))


def test_refuses_a_distributed_type_other_than_data_parallel():
    from types import SimpleNamespace

    from forge_hf.integrations.trainer import check_training_arguments

    for kind in ("MEGATRON_LM", "XLA"):
        with pytest.raises(ValueError, match=f"distributed_type={kind} is not supported"):
            check_training_arguments(_guard_args(), SimpleNamespace(distributed_type=kind))
    check_training_arguments(_guard_args(), SimpleNamespace(distributed_type="MULTI_CPU"))  # DDP is fine


def test_bad_data_parallel_mode_is_refused(tmp_path):
    args = training_args(tmp_path, optim_args=f"{FAST},data_parallel=zero3")
    with pytest.raises(ValueError, match=r"optim_args data_parallel: unknown data_parallel='zero3': choose one "
                                         r"of \['sharded'"):
        ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset())


@pytest.mark.parametrize("optim_args,match", [
    ("state_precison=bf16", r"unknown optim_args key 'state_precison' .*did you mean 'state_precision'"),
    ("rounding=nearst", r"optim_args rounding: unknown rounding='nearst'.*did you mean 'nearest'"),
    ("momentum=0.9", r"unknown optim_args key 'momentum' for optim='forge_adamw'"),
], ids=["key", "value", "other_rules_key"])
def test_bad_optim_args_stop_the_trainers_construction(tmp_path, optim_args, match):
    with pytest.raises(ValueError, match=match):  # when built, not at train()
        ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path, optim_args=f"{FAST},{optim_args}"),
                     train_dataset=dataset())


def test_refuses_to_train_when_nothing_is_fused(tmp_path):
    trainer = ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path, optim_args="backend=reference"),
                           train_dataset=dataset())
    with pytest.warns(UserWarning, match="fused no module"), pytest.raises(ValueError, match="min_params=0"):
        trainer.train()  # every layer of the tiny model is below patch_model's default min_params


def test_float16_weights_are_named_as_why_nothing_is_fused(tmp_path):
    trainer = ForgeTrainer(model=tiny_llama().half(), args=training_args(tmp_path), train_dataset=dataset())
    with pytest.warns(UserWarning, match="its float16 weights are not fused"), pytest.raises(
            ValueError, match=r"fused no module of LlamaForCausalLM: 15 of its linears have float16 weights, and "
                              r"fused steps need float32 or bfloat16 weights, .*gradient scaler.*: load the model "
                              r"in bfloat16, or in float32 and train with bf16=True \(autocast\)$"):
        trainer.create_optimizer()


def test_refuses_an_optimizer_that_is_not_forge(tmp_path):
    model = tiny_llama()
    with pytest.raises(ValueError, match="ForgeOptimizer"):
        ForgeTrainer(model=model, args=training_args(tmp_path), train_dataset=dataset(),
                     optimizers=(torch.optim.AdamW(model.parameters()), None))


def test_plain_trainer_stops_at_once(tmp_path):
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=dataset())
    with pytest.raises(ValueError, match="forge_hf.ForgeTrainer"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_the_default_max_grad_norm_clips_and_says_once_what_it_costs(tmp_path):
    args = training_args(tmp_path, max_grad_norm=1.0, max_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset())
        trainer.train()
    ours = [str(w.message) for w in caught if "max_grad_norm" in str(w.message)]
    assert len(ours) == 1 and "clipped at max_grad_norm=1.0 (the Trainer's default)" in ours[0]
    assert "max_grad_norm=0" in ours[0]
    assert args.max_grad_norm == 1.0 and trainer.args.max_grad_norm == 0.0  # the caller's args untouched
    assert trainer.forge_optimizer.max_grad_norm == 1.0 and trainer.forge_optimizer.holds_updates
    assert all("grad_norm" in log for log in step_logs(trainer))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path, max_grad_norm=0.5), train_dataset=dataset())
    assert not [w for w in caught if "max_grad_norm" in str(w.message)]  # set by the user: nothing to say


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05, 100.0])
def test_accumulation_and_clipping_match_adamw_torch(tmp_path, max_grad_norm):
    """gradient_accumulation_steps=2 with and without clipping (active at 0.05, not at 100)
    against Trainer(adamw_torch) with the same arguments: the same losses, logged norms and
    weights to fp32 round-off (the stash's one GEMM over both micro-batches against torch's
    two gradients added: tests/optim/test_accumulation.py)."""
    options = dict(gradient_accumulation_steps=2, max_grad_norm=max_grad_norm, max_steps=6,
                   per_device_train_batch_size=2)
    forge = ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path / "f", **options), train_dataset=dataset())
    forge.train()
    plain = Trainer(model=tiny_llama(), args=training_args(tmp_path / "p", "adamw_torch", **options),
                    train_dataset=dataset())
    plain.train()
    forge_logs, plain_logs = step_logs(forge), step_logs(plain)
    assert len(forge_logs) == len(plain_logs) == 6
    for a, b in zip(forge_logs, plain_logs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]
    clipped = [log["grad_norm"] > max_grad_norm for log in plain_logs]
    assert all(clipped) if max_grad_norm == 0.05 else not any(clipped) or max_grad_norm == 0.0
    for (name, a), b in zip(forge.model.named_parameters(), plain.model.parameters()):
        assert_close_rel(a.detach(), b.detach(), 1e-4, what=name)


def test_a_given_optimizer_must_hold_as_the_arguments_ask(tmp_path):
    model = tiny_llama()
    forge_hf.patch_model(model, optimizer="adamw", backend="reference", min_params=0)
    optimizer = forge_hf.ForgeOptimizer(model, lr=1e-3)
    with pytest.raises(ValueError, match=r"accumulate=False, max_grad_norm=0.0, but the arguments ask for "
                                         r"gradient_accumulation_steps=2.*ForgeOptimizer\(..., accumulate=True"):
        ForgeTrainer(model=model, args=training_args(tmp_path, gradient_accumulation_steps=2),
                     train_dataset=dataset(), optimizers=(optimizer, None))


def test_the_optimizer_takes_the_hyperparameters_and_the_micro_batch_count_once(tmp_path):
    """ForgeTrainer hands learning_rate (and the other hyperparameters) to the ForgeOptimizer
    alone: the patched layers carry the options, not a second copy of them; the micro-batches
    a step are the optimizer's count, which a given optimizer built with accumulate=True or
    accumulate=k takes from, or agrees with, gradient_accumulation_steps."""
    args = training_args(tmp_path, gradient_accumulation_steps=2, learning_rate=3e-3)
    trainer = ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset())
    trainer.create_optimizer()
    optimizer = trainer.forge_optimizer
    assert optimizer.accumulation_steps == 2 and optimizer.holds_updates
    assert all(group["lr"] == 3e-3 for group in optimizer.param_groups)
    assert all(m.forge_config.hyperparameters == {} for m in fused_layers(trainer.model).values())
    for accumulate in (True, 2):
        model = tiny_llama()
        forge_hf.patch_model(model, optimizer="adamw", backend="reference", min_params=0)
        given = forge_hf.ForgeOptimizer(model, lr=1e-3, accumulate=accumulate)
        ForgeTrainer(model=model, args=training_args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=0.0),
                     train_dataset=dataset(), optimizers=(given, None))
        assert given.accumulation_steps == 2


# ------------------------------------------------------------- registration


def test_every_rule_has_a_name_and_registration_is_idempotent(tmp_path):
    assert set(OPTIMIZER_NAMES) >= {"forge_adamw", "forge_nadam", "forge_radam", "forge_lion", "forge_rmsprop",
                                    "forge_adagrad", "forge_sgd"}
    members, hook = list(OptimizerNames), Trainer.get_optimizer_cls_and_kwargs
    register_optimizer_names()
    register_optimizer_names()
    assert list(OptimizerNames) == members and Trainer.get_optimizer_cls_and_kwargs is hook
    for name in OPTIMIZER_NAMES:
        assert TrainingArguments(str(tmp_path), optim=name, use_cpu=True).optim == name
    with pytest.raises(ValueError, match="forge_nope"):
        TrainingArguments(str(tmp_path), optim="forge_nope", use_cpu=True)


def test_hf_argument_parser_command_line_and_yaml(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", "forge_lion", "--use_cpu", "true"])
    assert args.optim == OptimizerNames.FORGE_LION
    recipe = tmp_path / "args.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\noptim: forge_rmsprop\noptim_args: momentum=0.9\n"
                      "use_cpu: true\n")
    (args,) = parser.parse_yaml_file(str(recipe))
    assert args.optim == "forge_rmsprop" and config_from_training_args(args).hyperparameters["momentum"] == 0.9


def test_forge_config_from_training_arguments(tmp_path):
    args = training_args(tmp_path, "forge_sgd", weight_decay=0.1,
                         optim_args="state_precision=bf16,momentum=0.9,backend=reference,rounding=nearest,"
                                    "nesterov=true,include=q_proj|v_proj,stop_on_nonfinite=true,min_params=0")
    config = config_from_training_args(args)
    assert config.optimizer == "sgd" and config.stop_on_nonfinite and config.seed == args.seed
    assert config.hyperparameters == dict(lr=1e-3, weight_decay=0.1, momentum=0.9, nesterov=True)
    assert (config.state_precision, config.rounding, config.backend, config.include, config.min_params) == \
        ("bf16", "nearest", "reference", ("q_proj", "v_proj"), 0)
    lion = config_from_training_args(training_args(tmp_path, "forge_lion", adam_beta1=0.95, adam_beta2=0.98))
    assert lion.hyperparameters == dict(lr=1e-3, weight_decay=0.01, betas=(0.95, 0.98))  # Lion has no eps
    adamw = config_from_training_args(training_args(tmp_path, adam_epsilon=1e-6))
    assert adamw.hyperparameters["eps"] == 1e-6
    with pytest.raises(ValueError, match="unknown optim_args key 'momentum' for optim='forge_adamw'"):
        config_from_training_args(training_args(tmp_path, optim_args="momentum=0.9"))
    with pytest.raises(ValueError, match="unknown optim_args key 'state_precison' .*did you mean 'state_precision'"):
        config_from_training_args(training_args(tmp_path, optim_args="state_precison=bf16"))
    with pytest.raises(ValueError, match="optim_args rounding: unknown rounding='nearst'.*did you mean 'nearest'"):
        config_from_training_args(training_args(tmp_path, optim_args="rounding=nearst"))
    with pytest.raises(ValueError, match="adam_epsilon"):
        config_from_training_args(training_args(tmp_path, optim_args="eps=1e-6"))


# ---------------------------------------------------------- accelerate launch

LAUNCHED = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
import forge_hf

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
ids = torch.randint(0, 64, (8, 8))
data = [{"input_ids": x, "labels": x} for x in ids]
args = TrainingArguments(OUT, optim="forge_adamw", optim_args="backend=reference,min_params=0", max_steps=3,
                         per_device_train_batch_size=2, report_to="none", max_grad_norm=0.0,
                         dataloader_num_workers=0, save_strategy="no", use_cpu=True)
trainer = forge_hf.ForgeTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=data)
trainer.train()
print("FORGE_OK", trainer.state.global_step, trainer.accelerator.num_processes)
"""


@pytest.mark.slow
def test_accelerate_launch_one_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LAUNCHED).replace("OUT", repr(str(tmp_path / "out"))))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes=1", "--num_machines=1",
               "--mixed_precision=no", "--dynamo_backend=no", "--cpu", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FORGE_OK 3 1" in done.stdout


def test_a_forge_config_for_another_rule_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"forge_config is for optimizer='sgd' but args.optim='forge_adamw': "
                                         r"set optim='forge_sgd'"):
        ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path), train_dataset=dataset(),
                     forge_config=ForgeConfig(optimizer="sgd"))


def test_a_forge_config_adds_its_options_to_the_training_arguments(tmp_path):
    args = training_args(tmp_path, learning_rate=2e-3, optim_args="min_params=0")
    trainer = ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset(),
                           forge_config=ForgeConfig(state_precision="bf16", backend="reference"))
    config = trainer.forge_config
    assert (config.state_precision, config.backend, config.min_params) == ("bf16", "reference", 0)
    assert config.seed == args.seed
    assert config.hyperparameters["lr"] == 2e-3  # unset in the config: the TrainingArguments' own
    with pytest.raises(ValueError, match=r"forge_config sets min_params=5 but the TrainingArguments give 0"):
        ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), forge_config=ForgeConfig(min_params=5))
    with pytest.raises(ValueError, match=r"forge_config sets lr=0.1 but the TrainingArguments give 0.002"):
        ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset(),
                     forge_config=ForgeConfig(hyperparameters={"lr": 0.1}))


# ----------------------------------------------------------------- README


def test_the_readmes_trainer_snippet_runs_on_a_cpu_with_the_changes_it_names(tmp_path, monkeypatch):
    """The README's first Trainer example, with what it says to change on a machine without a
    GPU (use_cpu=True, no bf16=True, min_params=0 for a tiny model) and a tiny model of the
    same family built from its config in place of the download."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    snippet = readme.split("### With the Trainer", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    load = 'AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-0.6B", dtype="bfloat16")'
    assert load in snippet and "bf16=True" in snippet
    snippet = (snippet.replace(load, "tiny_model")
               .replace("bf16=True", 'use_cpu=True, optim_args="min_params=0", max_steps=2, report_to="none"'))
    monkeypatch.chdir(tmp_path)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    namespace = dict(tiny_model=transformers.Qwen3ForCausalLM(config).to(torch.bfloat16), train_set=dataset(4))
    exec(compile(snippet, "README.md", "exec"), namespace)
    report = namespace["trainer"].forge_report
    assert report.fused and report.summary().endswith("state_precision=bf16 (auto: bfloat16 weights), "
                                                      "rounding=stochastic")
    assert namespace["trainer"].state.global_step == 2
