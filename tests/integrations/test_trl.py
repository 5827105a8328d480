"""TRL's SFTTrainer with ForgeTrainerMixin, the two lines the README shows, on a tiny Llama
and the bundled smoke tokenizer and data (CPU, no hub): the loss falls, grad_norm is
logged, and the report says what was fused. TRL's fused LM head reads lm_head.weight
itself, so lm_head stays on the ordinary path, said up front (TRL_LM_HEAD); a layer that
falls back at run time instead shows in the report and the logs. With a LoRA
``peft_config`` the default min_params leaves the adapters alone and says what to do.

Against SFTTrainer(adamw_torch) on variable-length rows: the same weights within 1e-6 in fp32 (bf16=False);
under SFTConfig's default bf16=True autocast, the plain trainer steps its weights with their
gradients rounded to bf16 (a linear's weight gradient under autocast is a bf16 matmul's output)
where forge steps the fp32 sum of the same bf16 products: the two differ by that rounding, and
forge matches a plain trainer whose linears keep their fp32 weight gradients."""

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset
from torch import nn
from torch.nn import functional as F
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainerCallback

import forge_hf
from forge_hf.integrations.lean_loss import lean_causal_lm_loss
from forge_hf.nn.linear import ForgeFallbackWarning, ForgeLinear
from forge_hf.optim import patch
from forge_hf.optim.patch import FELL_BACK, TRL_LM_HEAD
from tests.helpers import assert_close_rel

SMOKE = Path(forge_hf.__file__).parent / "assets" / "smoke"
STEPS = 12


class ForgeSFT(forge_hf.ForgeTrainerMixin, trl.SFTTrainer):
    pass


def rows(n=24) -> Dataset:
    with open(SMOKE / "omi2_mini.jsonl") as f:
        lines = [json.loads(next(f)) for _ in range(n)]
    return Dataset.from_list([{"text": f"{r['problem']}\n{r['generated_solution']}"} for r in lines])


def tiny_llama(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


def sft_config(tmp_path, optim="forge_adamw", optim_args="backend=reference,min_params=0", **overrides):
    options = dict(output_dir=str(tmp_path), optim=optim, optim_args=optim_args if optim.startswith("forge_") else None,
                   max_grad_norm=0.0, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4,
                   learning_rate=3e-3, lr_scheduler_type="constant", max_length=48, logging_steps=1,
                   save_strategy="no", report_to="none", seed=0, disable_tqdm=True)
    return trl.SFTConfig(**{**options, **overrides})


def sft(tmp_path, optim_args="backend=reference,min_params=0", **kwargs) -> ForgeSFT:
    tokenizer = AutoTokenizer.from_pretrained(SMOKE / "tokenizer")
    args = sft_config(tmp_path, optim_args=optim_args, bf16=False)
    return ForgeSFT(model=tiny_llama(tokenizer), args=args, train_dataset=rows(), processing_class=tokenizer, **kwargs)


def step_logs(trainer) -> list[dict]:
    return [log for log in trainer.state.log_history if "loss" in log]


def test_sft_trainer_trains_with_fused_layers_and_lm_head_on_the_ordinary_path(tmp_path, single_thread):
    trainer = sft(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForgeFallbackWarning)
        trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == STEPS
    losses = [log["loss"] for log in logs]
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    assert all(log["grad_norm"] > 0 and log["forge_fallback_layers"] == 0 for log in logs), logs

    report, model = trainer.forge_report, trainer.model
    assert report.skip_reasons() == {"lm_head": TRL_LM_HEAD} and report.fell_back == []
    assert len(report.fused) == 14  # 7 linears in each of 2 layers
    for fused in report.fused:
        layer = model.get_submodule(fused.name)
        assert type(layer) is ForgeLinear and layer.forge_enabled, fused.name
        assert layer.weight.grad is None and layer.forge_state.step == STEPS, fused.name
    # lm_head trains through the optimizer's ordinary path, with TRL's gradient
    assert type(model.lm_head) is nn.Linear
    assert trainer.forge_optimizer.state[model.lm_head.weight].step == STEPS
    assert "lm_head" in str(report) and "TRL's fused LM head" in str(report)


def test_a_layer_that_falls_back_shows_in_the_report_and_the_logs(tmp_path, single_thread, monkeypatch, caplog):
    # Without the up-front skip, TRL's head reads the fused lm_head's weight: the runtime
    # check sends it to the ordinary path at the first backward.
    monkeypatch.delitem(patch.HEAD_READERS, "trl")
    trainer = sft(tmp_path)
    trainer.args.max_steps = 3
    with caplog.at_level(logging.WARNING, logger="forge_hf"), \
            pytest.warns(ForgeFallbackWarning, match="lm_head falls back .* read directly"):
        trainer.train()
    assert [log["forge_fallback_layers"] for log in step_logs(trainer)] == [1, 1, 1]
    report = trainer.forge_report
    assert "lm_head" not in report.fused_names and len(report.fused) == 14
    assert [(s.name, s.reason) for s in report.fell_back] == [("lm_head", FELL_BACK)]
    assert "15 modules fused" not in str(report) and "14 modules fused" in report.summary()
    assert "1 fell back" in report.summary() and "fell back  kind" in str(report)
    logged = [r.getMessage() for r in caplog.records if "fell back" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("forge: lm_head fell back to the ordinary optimizer: its weight")
    assert "14 modules fused" in logged[0], logged


def test_lora_adapters_are_left_to_the_ordinary_optimizer_by_default_with_the_fix_named(tmp_path, single_thread):
    import peft

    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = sft(tmp_path, optim_args="backend=reference", peft_config=lora)
    with pytest.warns(UserWarning, match="fused no module"), pytest.raises(ValueError) as caught:
        trainer.train()
    message = str(caught.value)
    assert message.startswith("optim='forge_adamw' has nothing to fuse in PeftModel: its trainable "
                              "linears are 8 PEFT adapters") and "\n" not in message
    assert "adamw_torch_fused" in message and "add min_params=0 to optim_args" in message

    trainer = sft(tmp_path, optim_args="backend=reference,min_params=0", peft_config=lora)
    trainer.args.max_steps = 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForgeFallbackWarning)
        trainer.train()
    fused = trainer.forge_report.fused_names
    assert len(fused) == 8 and all(".lora_A." in n or ".lora_B." in n for n in fused), fused
    assert all(trainer.model.get_submodule(n).forge_state.step == 3 for n in fused)


# ---------------------------------------------------- parity with SFTTrainer(adamw_torch)

PARITY_STEPS = 8


class StepWeights(TrainerCallback):
    """The weights after each optimizer step, and the ordinary gradients of the first."""

    def __init__(self):
        self.steps, self.first_grads = [], {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.detach().clone() for n, p in model.named_parameters()})


def parity_run(tmp_path, optim, steps=PARITY_STEPS, plain_linears=nn.Linear, **overrides) -> StepWeights:
    """ForgeSFT (optim="forge_adamw") or SFTTrainer (optim="adamw_torch") on rows of 32 to 78
    tokens, padded per batch, with TRL's defaults (gradient checkpointing, the fused LM head and
    its metrics); the plain trainer's linears but lm_head made ``plain_linears``."""
    tokenizer = AutoTokenizer.from_pretrained(SMOKE / "tokenizer")
    model = tiny_llama(tokenizer)
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name != "lm_head" and not optim.startswith("forge_"):
            module.__class__ = plain_linears
    # lr=1e-3, as the Trainer parity test: at 3e-3 Adam magnifies the last-bit differences of a
    # few embedding entries' tiny gradients to 3e-6 of the largest entry by the eighth step
    args = sft_config(tmp_path / optim / plain_linears.__name__, optim, max_steps=steps, max_length=128,
                      learning_rate=1e-3, **overrides)
    weights = StepWeights()
    trainer_cls = ForgeSFT if optim.startswith("forge_") else trl.SFTTrainer
    trainer_cls(model=model, args=args, train_dataset=rows(32), processing_class=tokenizer,
                callbacks=[weights]).train()
    assert len(weights.steps) == steps
    return weights


def largest_difference(a: dict, b: dict) -> float:
    """The largest over the tensors of assert_close_rel's measure, max |a - b| / max |b|."""
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


def test_weights_match_sft_trainer_in_fp32(tmp_path, single_thread):
    """They differ by last bits: torch's AdamW on the CPU rounds its last line as w + (s * m) / d,
    forge's rule as w + s * (m / d) (an fp32 ulp on some of the weights from the first step),
    and a fused layer sums its gradient over the tokens in another order."""
    forge = parity_run(tmp_path, "forge_adamw", bf16=False).steps
    plain = parity_run(tmp_path, "adamw_torch", bf16=False).steps
    for step, (a, b) in enumerate(zip(forge, plain), 1):
        for name in b:
            assert_close_rel(a[name], b[name], 1e-6, what=f"step {step}: {name}")


class Fp32WeightGradient(torch.autograd.Function):
    """A linear under bf16 autocast, as autocast runs it, but whose weight gradient is the fp32
    sum of the bf16 products dY^T X (as forge's fused step forms it), not rounded to bf16."""

    @staticmethod
    def forward(ctx, x, weight):
        x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(x16, w16)
        ctx.x_dtype = x.dtype
        return F.linear(x16, w16)

    @staticmethod
    def backward(ctx, dy):
        x16, w16 = ctx.saved_tensors
        g = dy.reshape(-1, dy.shape[-1]).float().t() @ x16.reshape(-1, x16.shape[-1]).float()
        return (dy @ w16).to(ctx.x_dtype), g


class Fp32WeightGradientLinear(nn.Linear):
    def forward(self, x):
        assert torch.is_autocast_enabled(x.device.type) and self.bias is None
        with torch.autocast(x.device.type, enabled=False):
            return Fp32WeightGradient.apply(x, self.weight)


def test_under_bf16_autocast_sft_trainer_steps_a_gradient_rounded_to_bf16(tmp_path, single_thread, monkeypatch):
    """SFTConfig's bf16 defaults to True: fp32 weights then train under bf16 autocast. The plain
    trainer's weight gradients are rounded to bf16 and forge's are not, so the two runs part from
    the first step; forge matches the plain trainer whose linears keep the fp32 gradient. Three
    steps: a few more, and a last-bit weight difference flips a bf16 rounding in the forward and
    grows to 1e-4 (two plain runs that differ only in how AdamW's last line is rounded do the
    same by the seventh)."""
    assert sft_config(tmp_path).bf16 is True
    fused_gradients = {}
    fused_step = ForgeLinear.forge_fused_step

    def recording(layer, x2, dy2):
        assert x2.dtype == dy2.dtype == torch.bfloat16  # the fused step's inputs: autocast's tensors
        fused_gradients.setdefault(f"{layer.forge_name}.weight", dy2.float().t() @ x2.float())
        return fused_step(layer, x2, dy2)

    monkeypatch.setattr(ForgeLinear, "forge_fused_step", recording)
    forge = parity_run(tmp_path, "forge_adamw", steps=3).steps
    plain = parity_run(tmp_path, "adamw_torch", steps=3)
    fp32_gradients = parity_run(tmp_path, "adamw_torch", steps=3, plain_linears=Fp32WeightGradientLinear).steps

    assert len(fused_gradients) == 14
    for name, exact in fused_gradients.items():
        rounded = plain.first_grads[name]
        assert torch.equal(rounded, rounded.bfloat16().float()), name  # every entry a bf16 value
        assert (exact != exact.bfloat16().float()).float().mean() > 0.9, name  # forge's: fp32 values
        # forge's gradient rounded to bf16, up to the two sums' orders
        assert ((rounded - exact).abs() <= 2**-8 * exact.abs() + 1e-6 * exact.abs().max()).all(), name
    for step, (a, b, c) in enumerate(zip(forge, plain.steps, fp32_gradients), 1):
        for name in c:
            assert_close_rel(a[name], c[name], 1e-6, what=f"step {step}: {name}")
        assert largest_difference(a, b) > 10 * largest_difference(a, c), step


# ---------------------------------------------------- captured steps (integrations/captured_loss.py)


def _sft_batches(tmp_path, **config):
    """An SFTTrainer (its default loss) and two batches from its own collator."""
    tokenizer = AutoTokenizer.from_pretrained(SMOKE / "tokenizer")
    args = sft_config(tmp_path, bf16=False, **config)
    trainer = ForgeSFT(model=tiny_llama(tokenizer), args=args, train_dataset=rows(8), processing_class=tokenizer)
    loader = trainer.get_train_dataloader()
    return trainer, [batch for batch, _ in zip(loader, range(2))]


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_captured_sft_loss_is_trls_loss(tmp_path, padding_free):
    """A captured step of SFTTrainer computes Trainer.compute_loss on the batch for the model
    (mask dropped, varlen keys out, padded to a bucket): the loss TRL computes on the batch as
    collated, to fp32 round-off, with and without num_items_in_batch."""
    from transformers import Trainer

    from forge_hf.integrations.batch_shapes import pad_to_bucket
    from forge_hf.integrations.captured_loss import captured_loss

    free = dict(padding_free=True, packing=True) if padding_free else {}  # TRL enforces max_length by packing
    trainer, batches = _sft_batches(tmp_path, **free)
    compute_loss, plain = captured_loss(trainer)
    assert plain and compute_loss.func is Trainer.compute_loss
    for batch in batches:
        for_graph = trainer._forge_model_inputs(batch, captured=True)
        if padding_free:
            assert "position_ids" in for_graph and "cu_seq_lens_q" not in for_graph and "max_length_k" not in for_graph
        else:
            assert "attention_mask" in batch and "attention_mask" not in for_graph
        for_graph, _ = pad_to_bucket(for_graph, 64)
        num_items = (batch["labels"][:, 1:] != -100).sum()
        for n in (num_items, None):
            eager_batch = trainer._forge_model_inputs(batch)
            reference = trainer.compute_loss(trainer.model, eager_batch, num_items_in_batch=n)
            loss = compute_loss(trainer.model, dict(for_graph), num_items_in_batch=n)
            torch.testing.assert_close(loss, reference, rtol=2e-6, atol=0)


def test_a_loss_other_than_nll_is_captured_as_trl_defines_it(tmp_path):
    from forge_hf.integrations.captured_loss import captured_loss

    trainer, batches = _sft_batches(tmp_path, loss_type="dft")
    compute_loss, plain = captured_loss(trainer)
    assert not plain and compute_loss == trainer.compute_loss
    assert "attention_mask" in trainer._forge_model_inputs(batches[0], captured=True)


@pytest.mark.gpu
@pytest.mark.parametrize("padding_free", [False, True])
def test_sft_trainer_steps_are_captured_and_follow_the_eager_ones(tmp_path, padding_free):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.integrations.test_cuda_graph import assert_parameters_follow

    tokenizer = AutoTokenizer.from_pretrained(SMOKE / "tokenizer")
    start = [p.detach().clone().cuda() for p in tiny_llama(tokenizer).parameters()]
    trainers = {}
    for mode in ("true", "false"):
        free = dict(padding_free=True, packing=True) if padding_free else {}
        args = sft_config(tmp_path / mode, optim_args=f"min_params=0,cuda_graph={mode}", use_cpu=False, bf16=False,
                          **free)
        trainer = ForgeSFT(model=tiny_llama(tokenizer).cuda(), args=args, train_dataset=rows(),
                           processing_class=tokenizer)
        with sdpa_kernel(SDPBackend.MATH):
            trainer.train()
        trainers[mode] = trainer
    graphed, eager = trainers["true"], trainers["false"]
    assert graphed.forge_graph.captured
    for a, b in zip(step_logs(graphed), step_logs(eager), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"])
    assert_parameters_follow(graphed.model, eager.model, start)


# ---------------------------------------------------- an accumulating TRL trainer


class ForgeDPO(forge_hf.ForgeTrainerMixin, trl.DPOTrainer):
    pass


def test_dpo_accumulating_and_clipping_matches_the_plain_dpo_trainer(tmp_path, single_thread):
    """DPOTrainer through the mixin with gradient_accumulation_steps=2 and an active clip
    (max_grad_norm=0.5, the gradient's norm about 2): the losses, logged norms and weights of
    DPOTrainer(adamw_torch) to fp32 round-off."""
    tokenizer = AutoTokenizer.from_pretrained(SMOKE / "tokenizer")
    with open(SMOKE / "omi2_mini.jsonl") as f:
        lines = [json.loads(next(f)) for _ in range(16)]
    data = Dataset.from_list([{"prompt": r["problem"][:80], "chosen": r["generated_solution"][:60],
                               "rejected": r["generated_solution"][60:120]} for r in lines])
    trainers = []
    for cls, optim in ((ForgeDPO, "forge_adamw"), (trl.DPOTrainer, "adamw_torch")):
        args = trl.DPOConfig(output_dir=str(tmp_path / optim), optim=optim, use_cpu=True, bf16=False,
                             optim_args="backend=reference,min_params=0" if optim.startswith("forge_") else None,
                             max_grad_norm=0.5, max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-3, lr_scheduler_type="constant",
                             logging_steps=1, save_strategy="no", report_to="none", seed=0, max_length=64,
                             disable_tqdm=True)
        trainer = cls(model=tiny_llama(tokenizer), ref_model=tiny_llama(tokenizer), args=args, train_dataset=data,
                      processing_class=tokenizer)
        trainer.train()
        trainers.append(trainer)
    forge, plain = trainers
    assert len(forge.forge_report.fused) == 14 and forge.forge_optimizer.holds_updates
    for a, b in zip(step_logs(forge), step_logs(plain), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and b["grad_norm"] > 0.5
    for (name, a), b in zip(forge.model.named_parameters(), plain.model.parameters()):
        assert_close_rel(a.detach(), b.detach(), 1e-4, what=name)


def test_lean_loss_auto_leaves_trls_own_loss_and_true_takes_it(tmp_path):
    assert sft(tmp_path / "auto").compute_loss_func is None  # SFTTrainer's compute_loss: its loss, its metrics
    lean = sft(tmp_path / "true", optim_args="backend=reference,min_params=0,lean_loss=true")
    assert lean.compute_loss_func is lean_causal_lm_loss
