"""PatchReport.memory (optim/memory_budget.py): the bytes a patched model keeps between steps,
predicted from its shapes, against what a ForgeOptimizer then allocates."""

import pytest
import torch

import forge_hf
from tests.helpers import tiny_llama

VOCAB, HIDDEN, FFN = 300, 64, 192  # linears of 64 x 64 and up: fused with min_params=0


def _rows(report) -> dict:
    return {r.part: r for r in report.memory()}


def _train_one_step(model):
    opt = forge_hf.ForgeOptimizer(model, lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return opt


@pytest.mark.parametrize("precision", ["auto", "int8", "log4", "log4_factored"])
def test_the_predicted_states_are_the_bytes_the_optimizer_allocates(precision):
    model = tiny_llama(VOCAB, HIDDEN, FFN).to(torch.bfloat16)
    report = forge_hf.patch_model(model, state_precision=precision, min_params=0, backend="reference")
    rows = _rows(report)
    opt = _train_one_step(model)
    fused = {id(m.weight) for m in model.modules() if isinstance(m, forge_hf.nn.linear.FusedWeightMixin)}
    allocated = {"fused": 0, "other": 0}
    for p, state in opt.state.items():
        allocated["fused" if id(p) in fused else "other"] += state.nbytes()
    others = ("states, embedding", "states, other parameters")
    predicted_other = sum(r.bytes for part, r in rows.items() if part in others)
    assert rows["states, fused layers"].bytes == allocated["fused"]
    assert predicted_other == allocated["other"]
    every = {id(p): p for p in model.parameters()}.values()
    assert rows["weights"].bytes == sum(p.numel() * 2 for p in every)


def test_bytes_a_parameter_follow_the_precision_and_accumulation():
    model = tiny_llama(VOCAB, HIDDEN, FFN).to(torch.bfloat16)
    rows = _rows(forge_hf.patch_model(model, state_precision="log4", min_params=0, accumulation="buffer"))
    # two 4-bit moments, a bf16 scale per 64 elements of a row: 2 x (0.5 + 2 / 64)
    assert rows["states, fused layers"].per_param == pytest.approx(1.0625)
    assert rows["held, accumulation or clipping"].per_param == 4  # the fp32 buffer
    forge_hf.unpatch_model(model)
    rows = _rows(forge_hf.patch_model(model, min_params=0))
    assert rows["states, fused layers"].per_param == 4  # bf16 weights: bf16 moments under auto
    assert rows["held, accumulation or clipping"].per_param == 2  # never more than the Trainer's bf16 gradient
    assert rows["states, embedding"].params == VOCAB * HIDDEN  # the compact-rows embedding, no dense gradient
    assert "states, embedding" in str(forge_hf.patch_model(model, min_params=0)).split("memory between steps")[1]


def test_a_report_whose_model_is_gone_has_no_budget():
    model = tiny_llama(VOCAB, HIDDEN, FFN)
    report = forge_hf.patch_model(model, min_params=0)
    del model
    import gc

    gc.collect()
    assert report.memory() == []


def test_under_log4_factored_the_compact_embedding_keeps_log4_codes():
    """Its rows are stepped a chunk a launch, and a factored moment's sums span every row."""
    model = tiny_llama(VOCAB, HIDDEN, FFN).to(torch.bfloat16)
    report = forge_hf.patch_model(model, state_precision="log4_factored", min_params=0)
    assert "states log4" in str(report) and "states log4_factored" not in str(report)
    opt = _train_one_step(model)
    assert opt.state[model.model.embed_tokens.weight].stored_precision == "log4"
    assert opt.state[model.lm_head.weight].stored_precision == "log4_factored"
