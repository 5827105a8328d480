"""CUDA graphs inside ForgeTrainer (integrations/cuda_graph.py): the option, its refusals on
CPU, and on a GPU the graphed Trainer against the eager one with everything a Trainer user
relies on between steps (logging, the LR schedule, evaluation, checkpoints and resume, a
short last batch, a padding collator)."""

import types
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import forge_hf
from forge_hf.integrations.trainer import ForgeTrainer
from forge_hf.integrations.training_args import config_from_training_args
from forge_hf.optim.optimizer import ForgeOptimizer
from tests.helpers import bf16_ulps_apart
from tests.integrations.test_trainer import dataset, step_logs, training_args
from tests.optim.test_optimizer import SEQ, VOCAB, tiny_llama

# ------------------------------------------------------------------------ CPU


def test_an_unknown_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"optim_args cuda_graph: unknown cuda_graph='sometimes': choose one of "
                                         r"\['auto', 'true'"):
        config_from_training_args(training_args(tmp_path, optim_args="cuda_graph=sometimes"))


def test_graph_required_on_a_cpu_stops_before_any_step(tmp_path):
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = ForgeTrainer(model=model, args=training_args(tmp_path, optim_args="backend=reference,min_params=0,"
                                                                                 "cuda_graph=true"),
                           train_dataset=dataset())
    with pytest.raises(RuntimeError, match="cuda_graph=true, but the step cannot be captured: the model is on cpu"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_auto_on_a_cpu_trains_eagerly_without_a_warning(tmp_path):
    trainer = ForgeTrainer(model=tiny_llama(), args=training_args(tmp_path, max_steps=3), train_dataset=dataset())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="forge:")
        trainer.train()
    assert trainer.forge_graph.step is None and "cpu" in trainer.forge_graph.off


class _StandInStep:
    """GraphedStep's counting without a GPU: warm-up calls, then the call that captures;
    ``stale``: the replays refuse, as after a checkpoint was loaded."""

    def __init__(self, model, optimizer, loss_fn, warmup_steps):
        self.model, self.optimizer, self.warmup_steps = model, optimizer, warmup_steps
        self.graph, self.calls, self.stale, self.pending = None, 0, False, False

    def join(self):
        self.pending = False

    def launch(self, inputs):
        from forge_hf.optim.graphs import StaleGraph

        if self.graph is not None and self.stale:
            raise StaleGraph("replaced since the capture")  # before joining, as GraphedStep's check
        self.launched_pending = self.pending  # a replay joins the last one itself
        self.pending = False
        loss = self._launch()
        self.pending = self.graph is not None
        return loss

    def _launch(self):
        if self.calls >= self.warmup_steps:
            self.graph = "captured"
        self.calls += 1
        return torch.zeros(())


def _stand_in_graph(monkeypatch):
    """TrainerGraph('auto') with GraphedStep stood in for and the model taken to be on a GPU,
    and a function running one step on a batch of a given length (its loss, or None: eager)."""
    from forge_hf.integrations import cuda_graph

    monkeypatch.setattr(cuda_graph, "GraphedStep", _StandInStep)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda"))
    model = types.SimpleNamespace(parameters=lambda: iter([on_gpu]), training=True, trained=0)
    model.train = lambda: setattr(model, "training", True) or setattr(model, "trained", model.trained + 1)
    optimizer = types.SimpleNamespace(last_grad_norm=None, skip_next_step=lambda: None)
    trainer = types.SimpleNamespace(forge_optimizer=optimizer, _prepare_inputs=lambda inputs: inputs)
    graph = cuda_graph.TrainerGraph("auto")
    monkeypatch.setattr(graph, "_static_reason", lambda trainer, model: None)
    graph.model = model
    return graph, lambda n: graph.run(trainer, model, {"input_ids": torch.zeros(1, n, dtype=torch.long)}, None)


def _drive_graph(lengths, monkeypatch):
    """The graph state and the warnings after batches of these lengths."""
    graph, run = _stand_in_graph(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in lengths:
            run(n)
    return graph, [str(w.message) for w in caught]


def test_every_step_follows_the_last_replay(monkeypatch):
    """A replay lets the loss out before its backward is done. The next replay joins it
    itself, so the Trainer's checks of the new batch run beside that backward; a step run
    eagerly instead (a batch of other shapes, a stale graph) is ordered after it first."""
    graph, run = _stand_in_graph(monkeypatch)
    for n in (7, 7, 7, 7):
        run(n)
    step = graph.step
    assert step.pending and step.launched_pending  # not joined before the replay's own launch
    assert run(5) is None and not step.pending  # eager: joined first
    for n in (7, 7):
        run(n)
    assert step.pending
    step.stale = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run(7) is None  # refused as stale: the dropped step is joined all the same
    assert not step.pending and graph.step is None


def test_a_model_already_training_is_not_switched_again(monkeypatch):
    """train() walks every module: only a model an evaluation switched off gets it."""
    graph, run = _stand_in_graph(monkeypatch)
    for _ in range(4):
        run(7)
    assert graph.model.trained == 0
    graph.model.training = False  # the Trainer's evaluate() ran
    run(7)
    assert graph.model.training and graph.model.trained == 1


def test_a_replay_refused_as_stale_is_captured_again(monkeypatch):
    """After a checkpoint is loaded the replay refuses before it runs: that step runs
    eagerly, and the next batches of the shape warm up and capture a new step."""
    graph, run = _stand_in_graph(monkeypatch)
    assert [run(7) is None for _ in range(3)] == [True, False, False]  # eager, a warm-up through the step, capture
    first = graph.step
    first.stale = True
    assert run(7) is None and graph.step is None and graph.off is None
    assert [run(7) is None for _ in range(2)] == [False, False]  # a warm-up through the new step, then its capture
    assert graph.step is not first and graph.step.graph == "captured"


def test_batches_of_one_shape_three_in_a_row_are_captured(monkeypatch):
    graph, messages = _drive_graph([5, 6, 7, 7, 7, 7], monkeypatch)
    assert graph.off is None and graph.step.graph == "captured" and graph.waiting == 0
    assert messages == []


def test_shapes_that_pair_up_but_never_settle_release_the_graph(monkeypatch):
    """Two batches of one shape warm a step up, the third would capture it: shapes that come
    in pairs never settle, and after UNSETTLED_STEPS eager steps the run goes on without a graph."""
    graph, messages = _drive_graph([5, 5, 6, 6, 7, 7, 8, 8] * 2, monkeypatch)
    assert graph.off is not None and "vary" in graph.off and graph.step is None
    assert sum("without a CUDA graph" in m for m in messages) == 1


def test_a_step_taken_by_the_graph_is_not_taken_again():
    model = tiny_llama()
    forge_hf.patch_model(model, optimizer="adamw", backend="reference", min_params=0)
    opt = ForgeOptimizer(model, lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    embed = model.model.embed_tokens.weight
    before = embed.detach().clone()
    opt.skip_next_step()
    opt.step()  # the Trainer's call after a replay: nothing
    assert torch.equal(embed, before)
    opt.step()  # the next one steps
    assert not torch.equal(embed, before)


# ------------------------------------------------------------------------ GPU
# The graph's GEMMs may round differently from eager ones (cuBLAS's workspace differs under
# capture), so whole models are compared within the tolerances of tests/optim/test_graphs.py.


def cuda_args(out, **overrides):
    options = dict(use_cpu=False, bf16=True, optim_args="state_precision=bf16,min_params=0", max_steps=10,
                   lr_scheduler_type="cosine", warmup_steps=2)
    options.update(overrides)
    return training_args(out, **options)


def cuda_llama():
    return tiny_llama().cuda().to(torch.bfloat16)


def train(out, mode, callbacks=None, **overrides):
    args = cuda_args(out, optim_args=f"state_precision=bf16,min_params=0,cuda_graph={mode}", **overrides)
    trainer = ForgeTrainer(model=cuda_llama(), args=args, train_dataset=dataset(), eval_dataset=dataset(8, seed=9),
                           callbacks=callbacks)
    with sdpa_kernel(SDPBackend.MATH):  # deterministic attention backward
        trainer.train()
    return trainer


def assert_trains_alike(graphed, eager, start):
    a_logs, b_logs = step_logs(graphed), step_logs(eager)
    assert len(a_logs) == len(b_logs) > 0
    for a, b in zip(a_logs, b_logs):
        assert a["learning_rate"] == b["learning_rate"]
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * abs(b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-2 * b["grad_norm"]
    assert_parameters_follow(graphed.model, eager.model, start)


def assert_parameters_follow(model, reference, start):
    """Each parameter where ``reference``'s is, up to the GEMMs' rounding: within 5% of how far
    it moved from ``start``; one that moved a few bf16 steps may end one stochastic rounding apart."""
    for (name, a), b, a0 in zip(reference.named_parameters(), model.parameters(), start):
        moved = (a.float() - a0.float()).norm()
        apart = (b.float() - a.float()).norm()
        close = apart <= 0.05 * moved or bf16_ulps_apart(a, b).max() <= 2
        assert close, f"{name}: {apart:.3e} apart after moving {moved:.3e}"


@pytest.mark.gpu
def test_graphed_trainer_follows_the_eager_one_with_eval_and_schedule(tmp_path):
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    common = dict(eval_strategy="steps", eval_steps=4)
    graphed = train(tmp_path / "g", "auto", **common)
    eager = train(tmp_path / "e", "false", **common)
    assert graphed.forge_graph.step is not None and graphed.forge_graph.step.graph is not None
    assert graphed.forge_graph.step.calls == 10 - 1  # the first step eager through the Trainer
    assert any("eval_loss" in log for log in graphed.state.log_history)
    assert_trains_alike(graphed, eager, start)


class WeightSnapshots:
    """A TrainerCallback (made lazily) that copies every weight at each step's end on the
    current stream, as an averaging callback would: after a replay it must read the step's
    updated weights, not weights its backward is still writing."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Snapshots(TrainerCallback):
            def __init__(self):
                self.taken = []

            def on_step_end(self, args, state, control, model=None, **kw):
                self.taken.append([p.detach().clone() for p in model.parameters()])

        return Snapshots()


@pytest.mark.gpu
def test_callbacks_see_each_step_finished(tmp_path):
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    graphed_seen, eager_seen = WeightSnapshots(), WeightSnapshots()
    graphed = train(tmp_path / "g", "true", callbacks=[graphed_seen])
    train(tmp_path / "e", "false", callbacks=[eager_seen])
    assert graphed.forge_graph.step.graph is not None and len(graphed_seen.taken) == 10
    for step, (seen, reference) in enumerate(zip(graphed_seen.taken, eager_seen.taken)):
        for (name, _), a, b, a0 in zip(graphed.model.named_parameters(), reference, seen, start):
            moved = (a.float() - a0.float()).norm()
            apart = (b.float() - a.float()).norm()
            assert apart <= 0.05 * moved or bf16_ulps_apart(a, b).max() <= 2, f"step {step}, {name}"


@pytest.mark.gpu
def test_graph_required_trains_through_the_graph(tmp_path):
    trainer = train(tmp_path, "true")
    assert trainer.forge_graph.step.graph is not None


@pytest.mark.gpu
def test_resume_captures_again_and_continues_like_a_straight_run(tmp_path):
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    straight = train(tmp_path, "auto", save_strategy="steps", save_steps=5)
    args = cuda_args(tmp_path, optim_args="state_precision=bf16,min_params=0,cuda_graph=auto", save_strategy="steps",
                     save_steps=5)
    resumed = ForgeTrainer(model=cuda_llama(), args=args, train_dataset=dataset())
    with sdpa_kernel(SDPBackend.MATH):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert resumed.forge_graph.step is not None and resumed.forge_graph.step.graph is not None
    assert_parameters_follow(resumed.model, straight.model, start)


@pytest.mark.gpu
def test_a_short_last_batch_runs_eagerly_and_the_graph_stays(tmp_path):
    data = dataset(2 * 6 + 1)  # six full batches of two, then one of one
    args = cuda_args(tmp_path, optim_args="state_precision=bf16,min_params=0", max_steps=-1, num_train_epochs=2)
    trainer = ForgeTrainer(model=cuda_llama(), args=args, train_dataset=data)
    with pytest.warns(UserWarning, match="other shapes"):
        trainer.train()
    assert trainer.forge_graph.off is None and trainer.forge_graph.step.graph is not None
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in step_logs(trainer))


@pytest.mark.gpu
def test_a_padding_collator_releases_the_graph_with_one_warning(tmp_path):
    lengths = [SEQ, SEQ - 3, SEQ - 5, SEQ - 1] * 4

    def collate(rows):  # pads to the longest row of the batch: shapes vary
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = r["input_ids"]
        return {"input_ids": ids, "labels": ids.clone()}

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen)} for n in lengths]
    # in this order (no shuffling) no two batches in a row have one shape
    args = cuda_args(tmp_path, optim_args="state_precision=bf16,min_params=0", max_steps=-1, num_train_epochs=1,
                     per_device_train_batch_size=1, train_sampling_strategy="sequential")
    trainer = ForgeTrainer(model=cuda_llama(), args=args, train_dataset=data, data_collator=collate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert trainer.forge_graph.off is not None and "vary" in trainer.forge_graph.off
    assert sum("without a CUDA graph" in str(w.message) for w in caught) == 1
    assert len(step_logs(trainer)) == len(lengths)


def test_gradient_checkpointing_is_a_reason_and_torch_compile_is_not():
    from forge_hf.integrations.cuda_graph import TrainerGraph

    args = types.SimpleNamespace(torch_compile=True, gradient_checkpointing=False)
    trainer = types.SimpleNamespace(args=args, forge_optimizer=types.SimpleNamespace(stop_on_nonfinite=False))
    assert TrainerGraph("auto")._static_reason(trainer, torch.nn.Linear(2, 2)) is None
    args.gradient_checkpointing = True
    reason = TrainerGraph("auto")._static_reason(trainer, torch.nn.Linear(2, 2))
    assert reason.startswith("gradient checkpointing")
    with pytest.raises(RuntimeError, match="cuda_graph=true, but the step cannot be captured: gradient checkpointing"):
        TrainerGraph("true")._disable(reason)


@pytest.mark.gpu
def test_a_compiled_step_is_captured_and_follows_the_compiled_eager_one(tmp_path):
    """torch_compile=True: the compiled model's step captured, forge's kernels inside it."""
    torch._dynamo.reset()
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    graphed = train(tmp_path / "g", "true", torch_compile=True)
    torch._dynamo.reset()
    eager = train(tmp_path / "e", "false", torch_compile=True)
    assert graphed.forge_graph.step.graph is not None and graphed.forge_graph.step.calls == 10 - 1
    assert_trains_alike(graphed, eager, start)
