"""Batches brought to a replayable shape (integrations/batch_shapes.py): which masks may go,
which models allow it, the padding to a bucket, and that a tiny decoder's loss and gradients
are those of the original batch (fp32 on the CPU)."""

import pytest
import torch

from forge_hf.integrations.batch_shapes import (
    MASK_DROPPABLE,
    PaddingMaskCheck,
    bucket_length,
    causal_reason,
    mask_reason,
    pad_to_bucket,
    take_mark,
    without_mask,
    without_varlen_keys,
)
from tests.optim.test_optimizer import VOCAB, tiny_llama


def right_padded(lengths, width, seed=0):
    """input_ids, attention_mask and labels (-100 under the padding) of rows of these lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=gen)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def test_bucket_lengths():
    assert [bucket_length(n, 64) for n in (1, 63, 64, 65, 128, 129)] == [64, 64, 64, 128, 128, 192]
    assert bucket_length(37, 1) == 37


def test_a_mask_of_right_padding_under_ignored_labels_may_go():
    batch = right_padded([5, 9, 3], 9)
    assert mask_reason(batch["attention_mask"], batch["labels"]) is None
    ones = torch.ones(2, 6, dtype=torch.long)
    assert mask_reason(ones, torch.zeros(2, 6, dtype=torch.long)) is None  # nothing padded


@pytest.mark.parametrize("case, expected", [
    ("left", "padding before a real token"),
    ("hole", "padding before a real token"),
    ("labels", "labels other than -100"),
    ("no_labels", "no labels"),
])
def test_masks_that_must_stay(case, expected):
    batch = right_padded([5, 9, 3], 9)
    mask, labels = batch["attention_mask"], batch["labels"]
    if case == "left":
        mask = mask.flip(1)
        labels = labels.flip(1)
    elif case == "hole":
        mask[1, 4] = 0
        labels[1, 4] = -100
    elif case == "labels":
        labels = batch["input_ids"]  # the padding's own ids as labels: the loss counts them
    elif case == "no_labels":
        labels = None
    assert expected in mask_reason(mask, labels)


def test_the_collator_check_marks_only_right_padding():
    rows = [right_padded([4], 6, seed=i) for i in range(2)]

    def stack(features):
        return {k: torch.cat([f[k] for f in features]) for k in features[0]}

    batch = PaddingMaskCheck(stack)(rows)
    assert batch[MASK_DROPPABLE] is True
    left = [{k: v.flip(1) for k, v in row.items()} for row in rows]
    assert MASK_DROPPABLE not in PaddingMaskCheck(stack)(left)
    for_model, droppable = take_mark(batch)
    assert droppable and MASK_DROPPABLE not in for_model and "attention_mask" in for_model
    assert "attention_mask" not in without_mask(for_model)
    for_model, droppable = take_mark(PaddingMaskCheck(stack)(left))
    assert not droppable and "attention_mask" in for_model


def test_varlen_keys_go_where_attention_ignores_them():
    model = tiny_llama()
    batch = dict(input_ids=torch.zeros(1, 4), position_ids=torch.arange(4)[None], cu_seq_lens_q=torch.tensor([0, 4]),
                 cu_seq_lens_k=torch.tensor([0, 4]), max_length_q=4, max_length_k=4)
    assert set(without_varlen_keys(batch, model)) == {"input_ids", "position_ids"}
    model.config._attn_implementation = "flash_attention_2"  # reads them: they stay
    assert without_varlen_keys(batch, model) is batch


def test_causal_decoders_and_the_models_that_need_their_mask():
    from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    assert causal_reason(tiny_llama()) is None
    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64))
    assert "not causal" in causal_reason(bert)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                             d_kv=16))
    assert "encoder-decoder" in causal_reason(t5)
    assert "no attention module" in causal_reason(torch.nn.Linear(2, 2))


def test_padding_to_a_bucket():
    batch = right_padded([5, 9], 9)
    padded, reason = pad_to_bucket({**batch, "num": torch.tensor(3)}, 8)
    assert reason is None and padded["input_ids"].shape == (2, 16) and padded["num"].shape == ()
    assert torch.equal(padded["input_ids"][:, :9], batch["input_ids"]) and not padded["input_ids"][:, 9:].any()
    assert (padded["labels"][:, 9:] == -100).all() and not padded["attention_mask"][:, 9:].any()
    same, reason = pad_to_bucket(batch, 9)
    assert same is batch and reason is None
    _, reason = pad_to_bucket({"input_ids": batch["input_ids"]}, 8)
    assert "no labels" in reason
    _, reason = pad_to_bucket({**batch, "completion_mask": batch["attention_mask"]}, 8)
    assert "completion_mask" in reason


def test_a_padding_free_row_gets_its_padding_as_one_more_sequence():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    ids = torch.arange(1, 10)[None]
    padded, reason = pad_to_bucket(dict(input_ids=ids, labels=ids, position_ids=positions), 8)
    assert reason is None
    assert padded["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]]


def _loss_and_gradients(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    loss_a, grads_a = a
    loss_b, grads_b = b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_dropping_the_mask_and_bucketing_keep_the_loss_and_gradients(attn):
    model = tiny_llama()
    model.config._attn_implementation = attn
    batch = right_padded([5, 13, 9], 13)
    masked = _loss_and_gradients(model, batch)
    dropped = without_mask(batch)
    _assert_same(_loss_and_gradients(model, dropped), masked)
    bucketed, _ = pad_to_bucket(dropped, 8)
    assert bucketed["input_ids"].shape[1] == 16
    _assert_same(_loss_and_gradients(model, bucketed), masked)


def test_a_padding_free_row_bucketed_keeps_the_loss_and_gradients():
    model = tiny_llama()
    gen = torch.Generator().manual_seed(1)
    lengths = (4, 7, 3)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    starts = torch.tensor([0, 4, 11])
    labels[0, starts] = -100  # each example's first token predicts nothing across the boundary
    batch = dict(input_ids=ids, labels=labels, position_ids=positions)
    reference = _loss_and_gradients(model, batch)
    bucketed, _ = pad_to_bucket(batch, 8)
    assert bucketed["input_ids"].shape[1] == 16
    _assert_same(_loss_and_gradients(model, bucketed), reference)


# ------------------------------------------------------------------ through ForgeTrainer


def _padded_data(n=8, width=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (n,), generator=gen).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (k,), generator=gen)} for k in lengths]


def _right_padding_collator(rows):
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])], mask[i, : len(r["input_ids"])] = r["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train_seeing_masks(tmp_path, trainer_cls, model=None):
    """The run's step losses and, for each forward, whether the model was given a mask."""
    from tests.integrations.test_trainer import step_logs, training_args

    model = tiny_llama() if model is None else model
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append("attention_mask" in kwargs),
                                    with_kwargs=True)
    args = training_args(tmp_path, max_steps=4, train_sampling_strategy="sequential")
    trainer = trainer_cls(model=model, args=args, train_dataset=_padded_data(), data_collator=_right_padding_collator)
    trainer.train()
    return [log["loss"] for log in step_logs(trainer)], seen


def test_forge_trainer_drops_a_right_padding_mask_and_trains_as_with_it(tmp_path):
    from forge_hf.integrations.trainer import ForgeTrainer

    class MaskKept(ForgeTrainer):
        def _forge_causal(self):
            return False

    dropped, seen_dropped = _train_seeing_masks(tmp_path / "d", ForgeTrainer)
    kept, seen_kept = _train_seeing_masks(tmp_path / "k", MaskKept)
    assert seen_dropped == [False] * 4 and seen_kept == [True] * 4
    torch.testing.assert_close(torch.tensor(dropped), torch.tensor(kept), rtol=1e-5, atol=0)


def test_a_trainer_with_its_own_compute_loss_keeps_the_mask(tmp_path):
    """A subclass's compute_loss (TRL's reads the mask for its token counts) sees the batch as
    the collator made it."""
    from forge_hf.integrations.trainer import ForgeTrainer

    class OwnLoss(ForgeTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            assert "attention_mask" in inputs
            return super().compute_loss(model, inputs, *args, **kwargs)

    _, seen = _train_seeing_masks(tmp_path, OwnLoss)
    assert seen == [True] * 4


def test_an_encoder_keeps_its_mask(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from forge_hf.integrations.trainer import ForgeTrainer
    from tests.integrations.test_trainer import training_args

    bert = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64))
    trainer = ForgeTrainer(model=bert, args=training_args(tmp_path), train_dataset=_padded_data(),
                           data_collator=_right_padding_collator)
    batch = PaddingMaskCheck(_right_padding_collator)(_padded_data()[:2])
    assert batch[MASK_DROPPABLE] is True
    assert "attention_mask" in trainer._forge_model_inputs(batch)
    assert "attention_mask" in trainer._forge_model_inputs(batch, captured=True)


@pytest.mark.parametrize("case", ["left", "hole"])
def test_left_padding_and_holes_reach_the_model_with_their_mask(tmp_path, case):
    from forge_hf.integrations.trainer import ForgeTrainer
    from tests.integrations.test_trainer import training_args

    def collate(rows):
        batch = _right_padding_collator(rows)
        if case == "left":
            return {k: v.flip(1) for k, v in batch.items()}
        batch["attention_mask"][:, 1] = 0  # every row has a hole after its first token
        batch["labels"][:, 1] = -100
        return batch

    model, seen = tiny_llama(), []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append("attention_mask" in kwargs), with_kwargs=True)
    trainer = ForgeTrainer(model=model, args=training_args(tmp_path, max_steps=2), train_dataset=_padded_data(),
                           data_collator=collate)
    trainer.train()
    assert seen == [True, True]
    batch = trainer.get_train_dataloader().collate_fn(_padded_data()[:2])
    assert "attention_mask" in trainer._forge_model_inputs(batch, captured=True)
