"""ForgeTrainer's optim_args lean_loss=true: the loss by forge's chunked cross-entropy
(nn/loss.py) as the Trainer's compute_loss_func trains as Hugging Face's model loss does,
num_items_in_batch included, eagerly, compiled and (GPU) through the CUDA graph; what it
cannot do is refused."""

import types

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainingArguments

from forge_hf.integrations import lean_loss as lean_loss_module
from forge_hf.integrations import trainer as trainer_module
from forge_hf.integrations.lean_loss import check_lean_loss, lean_causal_lm_loss
from forge_hf.integrations.trainer import ForgeTrainer
from forge_hf.integrations.training_args import config_from_training_args
from forge_hf.nn import loss as loss_module
from tests.helpers import tiny_llama
from tests.integrations.test_trainer import step_logs, training_args

VOCAB = 97  # no multiple of any tile: lm_head's rows end in a partial tile
SEQ, STEPS = 12, 4
LEAN = "backend=reference,min_params=0,lean_loss=true"
# fp32 model, same data, the same arithmetic but for the loss's fp32 summation order: the
# losses agree to 1e-6 (relative; measured: at most 1.6e-7), and each parameter ends within
# 3e-4 of how far it moved (largest entries of each; Adam divides each gradient entry by its
# own running scale, which lets a rounding difference in a near-zero entry move its weight;
# measured: at most 3.2e-5, a norm weight).
LOSS_RTOL, MOVED_RTOL = 1e-6, 3e-4


def padded_dataset(n: int = 2 * STEPS, seed: int = 0) -> list[dict]:
    """Rows whose labels are -100 over a prompt at the start and padding at the end, of
    different lengths per row: the counts of targets differ between the rows of a batch."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    rows = []
    for i, x in enumerate(ids):
        labels = x.clone()
        labels[: i % 5] = -100
        labels[SEQ - i % 3:] = -100
        rows.append({"input_ids": x, "labels": labels})
    return rows


class GatheredCounts(ForgeTrainer):
    """num_items_in_batch three times the batch's own count, as average_tokens_across_devices
    gathers it over three ranks (one process here): the divisor is not the mean's."""

    def _get_num_items_in_batch(self, batch_samples, device):
        count = super()._get_num_items_in_batch(batch_samples, device)
        return None if count is None else count * 3


def train(tmp_path, lean: bool, trainer_cls=ForgeTrainer, model=None, **overrides):
    optim_args = LEAN if lean else "backend=reference,min_params=0,lean_loss=false"
    args = training_args(tmp_path / f"lean{int(lean)}", optim_args=optim_args, **{"max_steps": STEPS, **overrides})
    trainer = trainer_cls(model=model if model is not None else tiny_llama(VOCAB), args=args,
                          train_dataset=padded_dataset(), eval_dataset=padded_dataset(4, seed=1))
    trainer.train()
    return trainer


class Divisors(list):
    chunked = None


@pytest.fixture
def spy_divisors(monkeypatch):
    """Every num_items_in_batch the lean loss is given (and, in ``chunked``, each call that
    took the chunked Function, not the no-grad fallback); its fp32 blocks made 5 rows (of a
    batch's 24): several blocks and a partial last one."""
    seen = Divisors()
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 5 * VOCAB)

    chunked = loss_module.ChunkedCrossEntropy

    class Counted(chunked):
        calls = 0

        @staticmethod
        def forward(ctx, *args):
            Counted.calls += 1
            return chunked.forward(ctx, *args)

    monkeypatch.setattr(loss_module, "ChunkedCrossEntropy", Counted)
    seen.chunked = Counted
    shifted = lean_loss_module.shifted_cross_entropy

    def spy(logits, labels, num_items_in_batch=None):
        seen.append(num_items_in_batch)
        return shifted(logits, labels, num_items_in_batch)

    monkeypatch.setattr(lean_loss_module, "shifted_cross_entropy", spy)
    return seen


def assert_same_training(lean, plain, start):
    lean_logs, plain_logs = step_logs(lean), step_logs(plain)
    assert len(lean_logs) == len(plain_logs) == STEPS
    for a, b in zip(lean_logs, plain_logs):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), a["step"]
    for (name, a), b, a0 in zip(plain.model.named_parameters(), lean.model.parameters(), start):
        moved, apart = (a - a0).abs().max(), (b - a).abs().max()
        assert moved > 0 and apart <= MOVED_RTOL * moved, f"{name}: {apart:.3e} apart after moving {moved:.3e}"


@pytest.mark.parametrize("trainer_cls", [ForgeTrainer, GatheredCounts], ids=["batch_count", "gathered_count"])
def test_lean_loss_trains_as_huggingfaces_loss(tmp_path, trainer_cls, spy_divisors, single_thread):
    start = [p.detach().clone() for p in tiny_llama(VOCAB).parameters()]
    plain = train(tmp_path, False, trainer_cls)
    lean = train(tmp_path, True, trainer_cls)
    assert lean.compute_loss_func is lean_causal_lm_loss and plain.compute_loss_func is None
    assert_same_training(lean, plain, start)
    # the Trainer's divisor reached the chunked loss, as a tensor, on every step
    assert len(spy_divisors) == STEPS and all(torch.is_tensor(n) for n in spy_divisors)
    assert spy_divisors.chunked.calls == STEPS
    plain_eval, lean_eval = plain.evaluate(), lean.evaluate()
    assert lean_eval["eval_loss"] == pytest.approx(plain_eval["eval_loss"], rel=LOSS_RTOL)


def test_the_divisor_is_the_trainers_not_the_batch_mean(tmp_path, spy_divisors, single_thread):
    """The first step's loss (before any update) with three times the count is a third."""
    once = dict(max_steps=1)
    own = step_logs(train(tmp_path / "own", True, **once))[0]["loss"]
    counts = list(spy_divisors)
    gathered = step_logs(train(tmp_path / "gathered", True, GatheredCounts, **once))[0]["loss"]
    assert spy_divisors[len(counts):] == [3 * n for n in counts]
    assert gathered == pytest.approx(own / 3, rel=LOSS_RTOL)


def test_lean_loss_with_torch_compile(tmp_path, spy_divisors, single_thread):
    """The compiled model's logits, the loss outside it, its gradient written over them,
    against the eager model's own loss (compiled steps follow eager ones: tests/nn/test_compiled_linear.py)."""
    torch._dynamo.reset()
    start = [p.detach().clone() for p in tiny_llama(VOCAB).parameters()]
    plain = train(tmp_path, False)
    lean = train(tmp_path, True, torch_compile=True, torch_compile_backend="aot_eager")
    assert isinstance(lean.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert spy_divisors.chunked.calls == STEPS
    assert_same_training(lean, plain, start)


class NoHostReads(TorchDispatchMode):
    """Fails on any op that reads a tensor's value back to the host (item(), bool(), ...)."""

    READS = {"_local_scalar_dense", "nonzero", "masked_select", "item"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        assert name not in self.READS, f"{name} reads the device on the host: a CUDA graph cannot capture it"
        return func(*args, **(kwargs or {}))


def test_lean_loss_reads_nothing_back_to_the_host(tmp_path):
    """As a CUDA-graph capture needs (integrations/cuda_graph.py calls compute_loss inside
    it), with the divisor a device tensor as the graph passes it."""
    model = tiny_llama(VOCAB)
    batch = padded_dataset(2)
    ids = torch.stack([r["input_ids"] for r in batch])
    labels = torch.stack([r["labels"] for r in batch])
    outputs = model(input_ids=ids)
    with NoHostReads():
        loss = lean_causal_lm_loss(outputs, labels, num_items_in_batch=torch.tensor(17))
        loss.backward()
    assert model.lm_head.weight.grad is not None and torch.isfinite(loss.detach())


# ------------------------------------------------------------------ options


def test_lean_loss_is_an_optim_args_key(tmp_path):
    assert config_from_training_args(training_args(tmp_path)).lean_loss == "auto"
    config = config_from_training_args(training_args(tmp_path, optim_args="lean_loss=true,min_params=0"))
    assert config.lean_loss == "true" and config.min_params == 0
    with pytest.raises(ValueError, match=r"unknown lean_loss='maybe': choose one of \['auto', 'true', 'false'\]"):
        config_from_training_args(training_args(tmp_path, optim_args="lean_loss=maybe"))


def test_auto_takes_the_lean_loss_for_a_causal_lm_where_nothing_conflicts(tmp_path):
    def mine(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().mean()

    def loss_func(model=None, optim_args="backend=reference,min_params=0", **kwargs):
        trainer = ForgeTrainer(model=model or tiny_llama(VOCAB), train_dataset=padded_dataset(),
                               args=training_args(tmp_path, optim_args=optim_args, **kwargs.pop("args", {})), **kwargs)
        return trainer.compute_loss_func

    assert loss_func() is lean_causal_lm_loss  # auto, the default
    assert loss_func(optim_args="backend=reference,min_params=0,lean_loss=false") is None
    assert loss_func(compute_loss_func=mine) is mine  # yours is kept
    assert loss_func(args=dict(label_smoothing_factor=0.1)) is None  # the Trainer smooths its own loss
    assert loss_func(args=dict(use_liger_kernel=True)) is None  # Liger's fused linear cross-entropy
    classifier = transformers.LlamaForSequenceClassification(tiny_llama(VOCAB).config)
    assert loss_func(model=classifier) is None  # not a causal LM


# ------------------------------------------------------------------ refusals


def test_refuses_a_compute_loss_func_of_the_users(tmp_path):
    def mine(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().mean()

    with pytest.raises(ValueError, match=r"lean_loss=true with compute_loss_func=.*mine: .*set lean_loss=false.*"
                                         r"or drop compute_loss_func"):
        ForgeTrainer(model=tiny_llama(VOCAB), args=training_args(tmp_path, optim_args=LEAN),
                     train_dataset=padded_dataset(), compute_loss_func=mine)


def test_refuses_a_batch_without_labels(tmp_path):
    model = tiny_llama(VOCAB)
    before = [p.detach().clone() for p in model.parameters()]
    data = [{"input_ids": r["input_ids"]} for r in padded_dataset()]
    trainer = ForgeTrainer(model=model, args=training_args(tmp_path, optim_args=LEAN), train_dataset=data)
    with pytest.raises(ValueError, match="lean_loss computes the loss from the batch's 'labels', and this "
                                         "batch has none: .*or set optim_args lean_loss=false"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_refuses_liger_fused_linear_cross_entropy(tmp_path):
    with pytest.raises(ValueError, match=r"lean_loss=true with use_liger_kernel=True: .*set lean_loss=false.*"
                                         r"fused_linear_cross_entropy': False.*use_liger_kernel=False"):
        ForgeTrainer(model=tiny_llama(VOCAB), args=training_args(tmp_path, optim_args=LEAN, use_liger_kernel=True),
                     train_dataset=padded_dataset())
    # Liger's other kernels with the model's loss left to forge: accepted
    args = training_args(tmp_path, optim_args=LEAN, use_liger_kernel=True,
                         liger_kernel_config={"fused_linear_cross_entropy": False})
    trainer = ForgeTrainer(model=tiny_llama(VOCAB), args=args, train_dataset=padded_dataset())
    assert trainer.compute_loss_func is lean_causal_lm_loss


def test_refuses_label_smoothing(tmp_path):
    with pytest.raises(ValueError, match="lean_loss=true with label_smoothing_factor=0.1: .*label_smoothing_factor=0"):
        ForgeTrainer(model=tiny_llama(VOCAB), args=training_args(tmp_path, optim_args=LEAN, label_smoothing_factor=0.1),
                     train_dataset=padded_dataset())


def test_refuses_context_parallelism(tmp_path):
    args = TrainingArguments(str(tmp_path), use_cpu=True)
    for cp, sp in ((True, False), (False, True)):
        accelerator = types.SimpleNamespace(parallelism_config=types.SimpleNamespace(cp_enabled=cp, sp_enabled=sp))
        with pytest.raises(ValueError, match="lean_loss=true with context or sequence parallelism"):
            check_lean_loss(args, None, accelerator)
    check_lean_loss(args, None, types.SimpleNamespace(parallelism_config=None))


# ------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_lean_loss_is_captured_and_follows_the_eager_model_loss(tmp_path):
    """cuda_graph=true refuses to train eagerly: the lean loss is inside the captured step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.integrations.test_cuda_graph import assert_trains_alike, cuda_args, cuda_llama, dataset

    def run(out, optim_args):
        trainer = ForgeTrainer(model=cuda_llama(), args=cuda_args(out, optim_args=optim_args),
                               train_dataset=dataset())
        with sdpa_kernel(SDPBackend.MATH):
            trainer.train()
        return trainer

    start = [p.detach().clone() for p in cuda_llama().parameters()]
    graphed = run(tmp_path / "g", "state_precision=bf16,min_params=0,cuda_graph=true,lean_loss=true")
    eager = run(tmp_path / "e", "state_precision=bf16,min_params=0,cuda_graph=false")
    assert len(graphed.forge_graph.captured) == 1 and graphed.compute_loss_func is lean_causal_lm_loss
    assert_trains_alike(graphed, eager, start)


class LogitDtypes(ForgeTrainer):
    """Records the dtype of the logits each call of the loss gets."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logit_dtypes, loss_func = [], self.compute_loss_func
        self.compute_loss_func = lambda outputs, labels, **kw: self.logit_dtypes.append(outputs["logits"].dtype) \
            or loss_func(outputs, labels, **kw)


def test_under_bf16_mixed_precision_the_logits_stay_bf16_and_train_alike(tmp_path, monkeypatch, single_thread):
    """accelerate's mixed precision returns the model's outputs in fp32, an fp32 copy of the
    logits: lean_loss takes that conversion off (autocast stays) and its loss, which upcasts
    each chunk itself, is the same to the bit, in training and evaluation."""
    kept = train(tmp_path / "kept", True, trainer_cls=LogitDtypes, bf16=True, eval_strategy="steps", eval_steps=2)
    monkeypatch.setattr(trainer_module, "keep_logits_in_model_dtype", lambda model: None)
    plain = train(tmp_path / "plain", True, trainer_cls=LogitDtypes, bf16=True, eval_strategy="steps", eval_steps=2)
    assert len(kept.logit_dtypes) > STEPS and set(kept.logit_dtypes) == {torch.bfloat16}
    assert set(plain.logit_dtypes) == {torch.float32}
    assert [log["loss"] for log in step_logs(kept)] == [log["loss"] for log in step_logs(plain)]
    evals = [[log["eval_loss"] for log in t.state.log_history if "eval_loss" in log] for t in (kept, plain)]
    assert len(evals[0]) == 2 and evals[0] == evals[1]
    plain_module = torch.nn.Linear(2, 2)
    lean_loss_module.keep_logits_in_model_dtype(plain_module)  # no accelerate wrapper: nothing to take off
    assert "forward" not in plain_module.__dict__
