"""Which checkpoints resume: the newest finished one for `true`, each skipped one named; a
missing or damaged file refused in one line naming it (integrations/checkpoints.py), by
ForgeTrainer.train and by the recipe (exit 2)."""

import json
import logging
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

from forge_hf.integrations.checkpoints import CheckpointError, check_checkpoint, latest_checkpoint
from forge_hf.integrations.trainer import ForgeTrainer
from forge_hf.train import cli
from tests.helpers import write_checkpoint
from tests.integrations.test_trainer import dataset, training_args
from tests.optim.test_optimizer import tiny_llama
from tests.train.test_recipes import write_recipe


def _cut(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _one_line_naming(error: CheckpointError, *fragments):
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, message


def test_a_whole_checkpoint_resumes(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoint-10")
    assert check_checkpoint(path) == str(path)
    assert latest_checkpoint(str(tmp_path)) == str(path)


def test_save_only_model_checkpoint_resumes(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoint-10")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (path / name).unlink()
    assert check_checkpoint(path) == str(path)  # the Trainer resumes its weights only


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors"])
def test_a_truncated_file_is_named(tmp_path, name):
    write_checkpoint(tmp_path / "checkpoint-10")
    path = write_checkpoint(tmp_path / "checkpoint-20")
    _cut(path / name)
    for given in (lambda: check_checkpoint(path), lambda: latest_checkpoint(str(tmp_path))):
        with pytest.raises(CheckpointError) as error:
            given()
        _one_line_naming(error, path / name, "is damaged", f"resume from {tmp_path / 'checkpoint-10'}",
                         f"or delete {path}")


def test_a_missing_scheduler_is_named(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoint-20")
    (path / "scheduler.pt").unlink()
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(path)
    _one_line_naming(error, path / "scheduler.pt", "is missing", f"delete {path} and train from the start")


def test_missing_weights_and_a_sharded_index(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoint-20")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(path)
    _one_line_naming(error, path / "model.safetensors", "is missing")
    save_file({"a": torch.zeros(3)}, str(path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(path)
    _one_line_naming(error, path / "model-00002-of-00002.safetensors", "is missing")
    save_file({"b": torch.zeros(3)}, str(path / "model-00002-of-00002.safetensors"))
    assert check_checkpoint(path) == str(path)


def test_peft_adapters_in_folders_are_weights(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoint-20")
    (path / "model.safetensors").unlink()
    (path / "default").mkdir()
    save_file({"lora_A": torch.zeros(2, 4)}, str(path / "default" / "adapter_model.safetensors"))
    assert check_checkpoint(path) == str(path)
    _cut(path / "default" / "adapter_model.safetensors")
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(path)
    _one_line_naming(error, path / "default" / "adapter_model.safetensors", "is damaged")


def test_fsdp2_sharded_optimizer_needs_its_metadata(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoint-20")
    (path / "optimizer.pt").unlink()
    (path / "forge_optimizer").mkdir()
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(path)
    _one_line_naming(error, path / "forge_optimizer" / ".metadata", "is missing")
    (path / "forge_optimizer" / ".metadata").write_bytes(b"written last")
    assert check_checkpoint(path) == str(path)


def test_bad_trainer_state_given_is_refused_and_true_skips_it(tmp_path, caplog):
    earlier = write_checkpoint(tmp_path / "checkpoint-10")
    path = write_checkpoint(tmp_path / "checkpoint-20")
    (path / "trainer_state.json").write_text('{"global_step": 2')  # cut short while written
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(path)
    _one_line_naming(error, f"{path / 'trainer_state.json'} is cut short or damaged", f"resume from {earlier}")
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(str(tmp_path)) == str(earlier)
    assert f"skipping {path}, an unfinished save" in caplog.text and f"resuming from {earlier}" in caplog.text


def test_true_skips_an_unfinished_save(tmp_path, caplog):
    earlier = write_checkpoint(tmp_path / "checkpoint-10")
    unfinished = tmp_path / "checkpoint-20"  # what a save killed after the model's config leaves
    unfinished.mkdir()
    (unfinished / "config.json").write_text("{}")
    (unfinished / "generation_config.json").write_text("")
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(str(tmp_path)) == str(earlier)
    assert f"skipping {unfinished}, an unfinished save (no trainer_state.json" in caplog.text


def test_true_with_only_unfinished_saves(tmp_path):
    for step in (10, 20):
        (tmp_path / f"checkpoint-{step}").mkdir()
    with pytest.raises(CheckpointError) as error:
        latest_checkpoint(str(tmp_path))
    _one_line_naming(error, tmp_path, "holds no complete checkpoint", "checkpoint-20 is an unfinished save",
                     "checkpoint-10 is an unfinished save")
    assert latest_checkpoint(str(tmp_path / "empty")) is None  # no checkpoint at all: the caller's message


def test_forge_trainer_refuses_a_damaged_checkpoint_before_loading(tmp_path):
    out = tmp_path / "out"
    path = write_checkpoint(out / "checkpoint-20")
    _cut(path / "optimizer.pt")
    trainer = ForgeTrainer(model=tiny_llama(), args=training_args(out), train_dataset=dataset())
    for given in (True, str(path)):
        with pytest.raises(CheckpointError, match=f"{path / 'optimizer.pt'} is damaged") as error:
            trainer.train(resume_from_checkpoint=given)
        assert isinstance(error.value, ValueError) and "\n" not in str(error.value)
    assert trainer.state.global_step == 0


class StepCounter(TrainerCallback):
    count = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1


def test_forge_trainer_resumes_past_an_unfinished_save(tmp_path, caplog):
    out = tmp_path / "out"
    args = dict(max_steps=10, save_strategy="steps", save_steps=5)
    ForgeTrainer(model=tiny_llama(), args=training_args(out, **args), train_dataset=dataset()).train()
    unfinished = out / "checkpoint-10"
    (unfinished / "trainer_state.json").unlink()  # as a save killed before its last file leaves it
    steps = StepCounter()
    resumed = ForgeTrainer(model=tiny_llama(), args=training_args(out, **args), train_dataset=dataset(),
                           callbacks=[steps])
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert f"skipping {unfinished}, an unfinished save" in caplog.text
    assert (resumed.state.global_step, steps.count) == (10, 5)  # steps 6-10, from checkpoint-5
    assert check_checkpoint(unfinished) == str(unfinished)  # written again, whole


def test_rotation_and_the_best_checkpoint_are_kept(tmp_path):
    out = tmp_path / "out"
    args = training_args(out, save_strategy="steps", save_steps=5, eval_strategy="steps", eval_steps=5,
                         save_total_limit=2, load_best_model_at_end=True, metric_for_best_model="loss")
    trainer = ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), eval_dataset=dataset(4, seed=1))
    trainer.train()
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    best = trainer.state.best_model_checkpoint
    assert len(kept) == 2 and {"checkpoint-20", os.path.basename(best)} <= set(kept), (kept, best)
    for name in kept:
        assert check_checkpoint(out / name) == str(out / name)
    assert latest_checkpoint(str(out)) == str(out / "checkpoint-20")


def _recipe_refuses(capsys, tmp_path, *fragments):
    recipe, out = write_recipe(tmp_path), tmp_path / "out"
    assert cli.main(["train", str(recipe), "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"forge_hf.train: error: {recipe}: resume_from_checkpoint=true: ") and \
        stderr.count("\n") == 1, stderr  # one line, before the model loads
    for fragment in fragments:
        assert str(fragment) in stderr, stderr


def test_recipe_with_a_damaged_checkpoint_exits_2_in_one_line(capsys, tmp_path):
    out = tmp_path / "out"
    write_checkpoint(out / "checkpoint-10")
    path = write_checkpoint(out / "checkpoint-20")
    _cut(path / "optimizer.pt")
    _recipe_refuses(capsys, tmp_path, f"{path / 'optimizer.pt'} is damaged",
                    f"resume from {out / 'checkpoint-10'}, or delete {path}")


def test_recipe_with_only_unfinished_saves_exits_2(capsys, tmp_path):
    (tmp_path / "out" / "checkpoint-20").mkdir(parents=True)
    _recipe_refuses(capsys, tmp_path, "holds no complete checkpoint", "checkpoint-20 is an unfinished save")
