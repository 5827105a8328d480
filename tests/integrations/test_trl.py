"""TRL's SFTTrainer with ForgeTrainerMixin, the two lines the README shows, on a tiny Llama
and the bundled smoke tokenizer and data (CPU, no hub): the loss falls, grad_norm is
logged, and the report says what was fused. TRL's fused LM head reads lm_head.weight
itself, so lm_head stays on the ordinary path, said up front (TRL_LM_HEAD); a layer that
falls back at run time instead shows in the report and the logs. With a LoRA
``peft_config`` the default min_params leaves the adapters alone and says what to do."""

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset
from torch import nn
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import forge_hf
from forge_hf.nn.linear import ForgeFallbackWarning, ForgeLinear
from forge_hf.optim import patch
from forge_hf.optim.patch import FELL_BACK, TRL_LM_HEAD

SMOKE = Path(forge_hf.__file__).parent / "assets" / "smoke"
STEPS = 12


class ForgeSFT(forge_hf.ForgeTrainerMixin, trl.SFTTrainer):
    pass


def rows(n=24) -> Dataset:
    with open(SMOKE / "omi2_mini.jsonl") as f:
        lines = [json.loads(next(f)) for _ in range(n)]
    return Dataset.from_list([{"text": f"{r['problem']}\n{r['generated_solution']}"} for r in lines])


def sft(tmp_path, optim_args="backend=reference,min_params=0", **kwargs) -> ForgeSFT:
    tokenizer = AutoTokenizer.from_pretrained(SMOKE / "tokenizer")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    args = trl.SFTConfig(
        output_dir=str(tmp_path), optim="forge_adamw", optim_args=optim_args,
        max_grad_norm=0.0, use_cpu=True, bf16=False, max_steps=STEPS, per_device_train_batch_size=4,
        learning_rate=3e-3, lr_scheduler_type="constant", max_length=48, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, disable_tqdm=True)
    return ForgeSFT(model=model, args=args, train_dataset=rows(), processing_class=tokenizer, **kwargs)


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
