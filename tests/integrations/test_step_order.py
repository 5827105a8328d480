"""The Trainer's work after a replayed step (integrations/step_order.py and ForgeTrainer's
joins): what may touch the step's tensors waits for its backward; the Trainer's own
host-only callbacks do not, so the host runs ahead."""

import torch
from transformers import TrainerCallback

from forge_hf.integrations.step_order import StepOrder
from forge_hf.integrations.trainer import ForgeTrainer
from tests.integrations.test_trainer import dataset, training_args
from tests.optim.test_optimizer import tiny_llama


class _Joins:
    """A TrainerGraph's join, counted."""

    def __init__(self):
        self.count = 0

    def join(self):
        self.count += 1


class _ReadsWeights(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        pass


class _SaysHostOnly(_ReadsWeights):
    forge_host_only = True


def _trainer(tmp_path, callbacks=(), **overrides):
    trainer = ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path, **overrides), train_dataset=dataset(),
                           callbacks=list(callbacks))
    trainer.forge_graph = _Joins()
    return trainer


def _events(trainer, *names):
    order = trainer.callback_handler.callbacks[0]
    for name in names:
        getattr(order, name)(trainer.args, trainer.state, trainer.control)
    return trainer.forge_graph.count


def test_it_is_the_first_callback(tmp_path):
    trainer = _trainer(tmp_path, [_ReadsWeights()])
    assert isinstance(trainer.callback_handler.callbacks[0], StepOrder)


def test_the_trainers_own_callbacks_order_nothing_between_steps(tmp_path):
    assert _events(_trainer(tmp_path), "on_pre_optimizer_step", "on_optimizer_step", "on_step_end") == 0


def test_a_callback_that_may_read_the_weights_is_ordered_after_the_step(tmp_path):
    trainer = _trainer(tmp_path, [_ReadsWeights()])
    assert _events(trainer, "on_pre_optimizer_step", "on_optimizer_step") == 0  # it handles neither
    assert _events(trainer, "on_step_end") == 1


def test_a_callback_can_say_it_touches_no_tensor(tmp_path):
    assert _events(_trainer(tmp_path, [_SaysHostOnly()]), "on_step_end") == 0


def test_a_callback_added_later_is_seen(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.add_callback(_ReadsWeights())
    assert _events(trainer, "on_step_end") == 1


def test_an_epochs_end_and_the_runs_end_always_join(tmp_path):
    assert _events(_trainer(tmp_path), "on_epoch_end", "on_train_end") == 2


def test_checkpoints_and_saves_join_first(tmp_path, monkeypatch):
    """The weights a save reads are the last replay's."""
    trainer = _trainer(tmp_path)
    seen = []
    monkeypatch.setattr("transformers.Trainer._save_checkpoint",
                        lambda self, model, trial: seen.append(self.forge_graph.count))
    monkeypatch.setattr("transformers.Trainer.save_model",
                        lambda self, output_dir=None, _internal_call=False: seen.append(self.forge_graph.count))
    trainer._save_checkpoint(trainer.model, None)
    trainer.save_model(str(tmp_path / "model"))
    assert seen == [1, 2]


def test_evaluation_and_logging_join_first(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    seen = []
    monkeypatch.setattr("transformers.Trainer.log", lambda self, logs, *a, **k: seen.append(self.forge_graph.count))
    monkeypatch.setattr("transformers.Trainer.prediction_step",
                        lambda self, *a, **k: seen.append(self.forge_graph.count))
    trainer.log({"eval_loss": 1.0})
    trainer.prediction_step(trainer.model, {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, True)
    assert seen == [1, 2]
