"""What ForgeTrainer spares the host at every step, with the same results: no gradient norm
of the Trainer's own (the optimizer's is logged), the model's parameters counted once for
the FLOPs, no train() walk over the modules of a model already training; and the inputs that
spare transformers its packed-sequence check (a 4-D mask under a CUDA graph) without
changing what the model computes."""

import torch
from transformers import Trainer

from forge_hf.integrations.cuda_graph import skip_packing_check
from forge_hf.integrations.trainer import ForgeTrainer, ForgeTrainerMixin
from tests.helpers import tiny_llama
from tests.integrations.test_trainer import STEPS, step_logs, training_args

VOCAB, SEQ = 97, 12


def dataset(n: int = 2 * STEPS) -> list[dict]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


def test_no_gradient_norm_of_the_trainers_own_and_the_optimizers_is_logged(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Trainer's clip_grad_norm_ ran")

    trainer = ForgeTrainer(model=tiny_llama(VOCAB), args=training_args(tmp_path), train_dataset=dataset())
    monkeypatch.setattr(trainer.accelerator, "clip_grad_norm_", refuse)
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == STEPS and all(log["grad_norm"] > 0 for log in logs)


def test_flops_are_the_trainers_with_the_parameters_counted_once(tmp_path, monkeypatch):
    trainer = ForgeTrainer(model=tiny_llama(VOCAB), args=training_args(tmp_path), train_dataset=dataset())
    batch = {"input_ids": torch.zeros(3, SEQ, dtype=torch.long)}
    expected = Trainer.floating_point_ops(trainer, batch)
    counts = []
    count = trainer.model.num_parameters
    monkeypatch.setattr(trainer.model, "num_parameters", lambda **kw: counts.append(kw) or count(**kw))
    assert [trainer.floating_point_ops(batch) for _ in range(3)] == [expected] * 3 and len(counts) == 1
    assert trainer.floating_point_ops({"labels": batch["input_ids"]}) == 0  # no main input: the Trainer's answer


class OwnFlops(Trainer):
    def floating_point_ops(self, inputs):
        return 7


class ForgeOwnFlops(ForgeTrainerMixin, OwnFlops):  # the mixin before a trainer with its own formula
    pass


def test_a_trainer_with_its_own_flops_formula_keeps_it(tmp_path):
    trainer = ForgeOwnFlops(model=tiny_llama(VOCAB), args=training_args(tmp_path), train_dataset=dataset())
    assert trainer.floating_point_ops({"input_ids": torch.zeros(3, SEQ, dtype=torch.long)}) == 7


def test_the_packing_check_is_spared_only_for_positions_the_model_numbers_itself():
    model = tiny_llama(VOCAB)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    spared = skip_packing_check(model, {"input_ids": ids})
    assert spared == {"input_ids": ids, "use_cache": True}
    packed = {"input_ids": ids, "position_ids": torch.arange(SEQ).remainder(5).expand(2, SEQ)}
    assert skip_packing_check(model, packed) == packed  # may be packed: transformers must look
    assert skip_packing_check(torch.nn.Linear(2, 2), {"x": ids}) == {"x": ids}  # no cache to ask for
    assert skip_packing_check(torch.compile(model), {"input_ids": ids}) == spared  # the compiled model's own forward

    class NoCacheArgument(torch.nn.Module):  # a config with use_cache, a forward that does not name it
        config = model.config

        def forward(self, input_ids, **kwargs):
            return input_ids

    assert skip_packing_check(NoCacheArgument(), {"input_ids": ids}) == {"input_ids": ids}
    with torch.no_grad():  # the same logits with the cache as without
        assert torch.equal(model(**spared).logits, model(input_ids=ids, use_cache=False).logits)
