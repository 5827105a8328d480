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
    assert trainer.forge_graph.steps == {} and "cpu" in trainer.forge_graph.off


class _StandInStep:
    """GraphedStep's counting without a GPU: warm-up calls, then the calls that capture (one a
    micro-batch with ``accumulation_steps``); ``stale``: the replays refuse, as after a
    checkpoint was loaded; ``fails``: the capture raises, as a step that reads the GPU on the
    host; ``fails_at``: only the capture of that micro-batch of a step does."""

    fails = False
    fails_at = None

    def __init__(self, model, optimizer, loss_fn, warmup_steps, pool):
        self.model, self.optimizer, self.warmup_steps, self.pool = model, optimizer, warmup_steps, pool
        self.accumulation_steps = optimizer.accumulation_steps  # GraphedStep's: the optimizer's count
        self.graph, self.calls, self.stale, self.pending = None, 0, False, False
        self.lengths = []  # the sequence length of each micro-batch given

    @property
    def capturing(self):
        return self.graph is None and self.calls >= self.warmup_steps * self.accumulation_steps

    def join(self):
        self.pending = False

    def launch(self, inputs):
        from forge_hf.optim.graphs import StaleGraph

        if self.graph is not None and self.stale:
            raise StaleGraph("replaced since the capture")  # before joining, as GraphedStep's check
        self.launched_pending = self.pending  # a replay joins the last one itself
        self.pending = False
        loss = self._launch(inputs)
        self.pending = self.graph is not None
        return loss

    def _launch(self, inputs):
        index = self.calls % self.accumulation_steps
        if self.capturing:
            if self.fails or index == self.fails_at:
                raise RuntimeError("operation not permitted when stream is capturing")
            if index == self.accumulation_steps - 1:
                self.graph = "captured"
            self.length = inputs["input_ids"].shape[1]
        self.lengths.append(inputs["input_ids"].shape[1])
        self.calls += 1
        return torch.zeros(())


def _stand_in_graph(monkeypatch, accumulation_steps=1, **options):
    """TrainerGraph('auto', **options) with GraphedStep stood in for, the model taken to be
    on a GPU and an optimizer of ``accumulation_steps`` micro-batches a step, and a function
    running one step on a batch of a given length and rows (its loss, or None: eager).
    ``graph.skipped`` counts the optimizer steps a graph took."""
    from forge_hf.integrations import cuda_graph

    monkeypatch.setattr(cuda_graph, "GraphedStep", _StandInStep)
    monkeypatch.setattr(cuda_graph, "new_pool", lambda: ("pool",))
    on_gpu = types.SimpleNamespace(device=torch.device("cuda"))
    model = types.SimpleNamespace(parameters=lambda: iter([on_gpu]), training=True, trained=0)
    model.train = lambda: setattr(model, "training", True) or setattr(model, "trained", model.trained + 1)
    optimizer = types.SimpleNamespace(last_grad_norm=None, accumulation_steps=accumulation_steps)
    optimizer.skip_next_step = lambda: setattr(graph, "skipped", graph.skipped + 1)
    trainer = types.SimpleNamespace(forge_optimizer=optimizer, _prepare_inputs=lambda inputs: inputs,
                                    _forge_model_inputs=lambda inputs, captured: dict(inputs))
    graph = cuda_graph.TrainerGraph("auto", **options)
    graph.skipped = 0
    monkeypatch.setattr(graph, "_static_reason", lambda trainer, model: None)
    graph.model = model

    def run(n, rows=1):
        ids = torch.zeros(rows, n, dtype=torch.long)
        return graph.run(trainer, model, {"input_ids": ids, "labels": ids}, None)
    return graph, run


def _drive_graph(lengths, monkeypatch, **options):
    """The graph state, the steps run eagerly (their indices) and the warnings after batches of
    these lengths."""
    graph, run = _stand_in_graph(monkeypatch, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = [i for i, n in enumerate(lengths) if run(n) is None]
    return graph, eager, [str(w.message) for w in caught]


def test_every_step_follows_the_last_replay(monkeypatch):
    """A replay lets the loss out before its backward is done. The next replay joins it
    itself, so the Trainer's checks of the new batch run beside that backward; a step run
    eagerly instead (a shape past max_graphs, a stale graph) is ordered after it first."""
    graph, run = _stand_in_graph(monkeypatch, graph_bucket=1, max_graphs=1)
    for n in (7, 7, 7, 7):
        run(n)
    (step,) = graph.steps.values()
    assert step.pending and step.launched_pending  # not joined before the replay's own launch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run(5) is None and not step.pending  # eager: joined first
    for n in (7, 7):
        run(n)
    assert step.pending
    step.stale = True
    assert run(7) is None  # refused as stale: the dropped step is joined all the same
    assert not step.pending and graph.steps == {}


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
    eagerly, and the next batches warm up and capture a new step."""
    graph, run = _stand_in_graph(monkeypatch)
    assert [run(7) is None for _ in range(3)] == [True, False, False]  # eager, a warm-up through the step, capture
    (first,) = graph.steps.values()
    first.stale = True
    assert run(7) is None and graph.steps == {} and graph.off is None
    assert [run(7) is None for _ in range(2)] == [False, False]  # a warm-up through the new step, then its capture
    (again,) = graph.steps.values()
    assert again is not first and again.graph == "captured"


def test_batches_of_nearby_lengths_replay_one_graph_and_new_buckets_capture_at_once(monkeypatch):
    """Lengths rounded up to multiples of graph_bucket: 5 to 64 tokens one graph, 65 to 128
    another; after the run's first two steps (eager, then the first step's warm-up) a new
    bucket is captured at its first batch, into the pool of the others."""
    graph, eager, messages = _drive_graph([5, 6, 70, 7, 100, 64, 128, 33], monkeypatch)
    assert graph.off is None and eager == [0] and messages == []
    assert sorted(s.length for s in graph.captured) == [64, 128]
    assert {s.pool for s in graph.steps.values()} == {("pool",)}
    assert [s.warmup_steps for s in graph.steps.values()] == [1, 0]


def test_shapes_past_max_graphs_run_eagerly_with_one_warning(monkeypatch):
    graph, eager, messages = _drive_graph([5, 6, 7, 8, 9, 8, 9, 6], monkeypatch, graph_bucket=1, max_graphs=2)
    assert graph.off is None and len(graph.captured) == 2
    assert eager == [0, 3, 4, 5, 6]  # the first step; 8 and 9 would be the third and fourth graphs
    assert sum("past max_graphs=2" in m for m in messages) == 2  # once per shape: each names its own


def test_a_shape_whose_capture_fails_warms_up_then_runs_eagerly_while_the_others_replay(monkeypatch):
    """A new shape's capture at its first batch fails: that batch warms a step of the shape up
    (a kernel variant for its token count may have been missing); if its capture fails again,
    batches of that shape run eagerly and the other shapes keep replaying."""
    graph, run = _stand_in_graph(monkeypatch, graph_bucket=1)
    for n in (7, 7, 7):
        run(n)
    _StandInStep.fails = True
    try:
        assert run(9) is not None  # the warm-up, through a new step of the shape
        assert graph.steps[max(graph.steps)].warmup_steps == 1
        with pytest.warns(UserWarning, match="capturing it failed"):
            assert run(9) is None
    finally:
        _StandInStep.fails = False
    assert run(9) is None and run(7) is not None and graph.off is None and len(graph.captured) == 1


def test_a_first_capture_that_fails_ends_the_graphs_for_the_run(monkeypatch):
    graph, run = _stand_in_graph(monkeypatch)
    _StandInStep.fails = True
    try:
        run(7)
        run(7)
        with pytest.warns(UserWarning, match="without a CUDA graph: capturing it failed"):
            assert run(7) is None
    finally:
        _StandInStep.fails = False
    assert graph.off is not None and run(7) is None and graph.steps == {}


@pytest.fixture
def accumulating(monkeypatch):
    graph, _ = _stand_in_graph(monkeypatch, accumulation_steps=2, graph_bucket=8)
    trainer = types.SimpleNamespace(forge_optimizer=types.SimpleNamespace(last_grad_norm=None, accumulation_steps=2),
                                    _prepare_inputs=lambda inputs: inputs,
                                    _forge_model_inputs=lambda inputs, captured: dict(inputs))
    trainer.forge_optimizer.skip_next_step = lambda: setattr(graph, "skipped", graph.skipped + 1)

    def window(*lengths, batches=None):
        """One optimizer step of micro-batches of these lengths (or these ``batches``), as the
        Trainer runs it: whether each went through a step."""
        if batches is None:
            batches = [{key: torch.zeros(1, n, dtype=torch.long) for key in ("input_ids", "labels")} for n in lengths]
        graph.start_window(batches)
        return [graph.run(trainer, graph.model, None, None) is not None for _ in batches]
    return graph, window


def test_accumulated_micro_batches_are_padded_to_one_shape_and_replay_one_step(accumulating):
    """gradient_accumulation_steps=2: a step's micro-batches are padded together to the bucket
    of the longest (8 tokens); the run's first step is eager, the second warms up through the
    GraphedStep, the third captures its two graphs, and every step after replays them; the
    Trainer's optimizer.step() is skipped once a step, after its last micro-batch."""
    graph, window = accumulating
    assert window(3, 7) == [False, False]  # the Trainer's own first step
    assert window(5, 2) == [True, True]  # the warm-up through the step
    assert window(1, 8) == [True, True]  # the capture
    assert window(6, 6) == [True, True]
    (step,) = graph.steps.values()
    assert step.accumulation_steps == 2 and step.graph == "captured" and step.calls == 6
    assert step.lengths == [8] * 6 and graph.skipped == 3
    assert window(9, 3) == [True, True]  # another bucket: 16 tokens, a step of its own, captured at once
    assert sorted(s.lengths[-1] for s in graph.steps.values()) == [8, 16] and graph.skipped == 4


def test_an_accumulated_step_that_cannot_take_one_shape_runs_eagerly_as_a_whole(accumulating):
    """A window of fewer micro-batches than gradient_accumulation_steps (an epoch's last), or
    whose micro-batches keep different keys, runs eagerly from its first micro-batch to its
    last, said once; the steps captured before are untouched and replay after."""
    graph, window = accumulating
    for _ in range(3):
        window(4, 4)
    (step,) = graph.steps.values()
    with pytest.warns(UserWarning, match="a step of 1 micro-batches, not gradient_accumulation_steps=2"):
        assert window(4) == [False]
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.warns(UserWarning, match="different keys or shapes"):
        assert window(batches=[{"input_ids": ids, "labels": ids}, {"input_ids": ids, "labels": ids,
                                                                   "attention_mask": ids}]) == [False, False]
    assert step.calls == 4 and graph.skipped == 2  # the warm-up and the capture
    assert window(4, 4) == [True, True] and step.calls == 6 and graph.skipped == 3


def test_a_capture_failing_within_an_accumulated_step_leaves_the_rest_of_it_eager(accumulating):
    """The second micro-batch's capture fails: it and the rest of its step run eagerly (from
    what the first micro-batch's replay holds), the optimizer step is the Trainer's, and, no
    other step being captured, the run goes on without graphs."""
    graph, window = accumulating
    window(4, 4)
    window(4, 4)
    _StandInStep.fails_at = 1
    try:
        with pytest.warns(UserWarning, match="capturing it failed"):
            assert window(4, 4) == [True, False]
    finally:
        _StandInStep.fails_at = None
    assert graph.skipped == 1 and graph.off is not None and window(4, 4) == [False, False]


def test_a_new_shape_whose_last_micro_batch_fails_to_capture_runs_eagerly_then_captures(accumulating):
    """A later shape captures at its first step; its last micro-batch, the one that steps all
    the step's tokens at once, may need a kernel variant no eager step compiled: that step
    goes on eagerly (which compiles it) and the shape's next step captures. A second failure
    leaves the shape eager while the others replay."""
    graph, window = accumulating
    for _ in range(3):
        window(4, 4)
    _StandInStep.fails_at = 1
    try:
        assert window(12, 12) == [True, False]  # 16 tokens: a new shape, its last capture fails
        with pytest.warns(UserWarning, match=r"batches of shapes input_ids \[1, 16\].*capturing it failed"):
            assert window(12, 12) == [True, False]  # and fails again: that shape stays eager
    finally:
        _StandInStep.fails_at = None
    assert window(12, 12) == [False, False] and window(4, 4) == [True, True] and len(graph.captured) == 1
    graph, window = accumulating  # the same, with the second attempt succeeding
    _StandInStep.fails_at = 1
    try:
        assert window(20, 20) == [True, False]
    finally:
        _StandInStep.fails_at = None
    assert window(20, 20) == [True, True] and len(graph.captured) == 2


def test_the_captured_loss_is_scaled_for_accumulation_as_the_trainer_scales_it():
    from forge_hf.integrations.cuda_graph import loss_is_scaled_for_accumulation as scaled

    trainer = types.SimpleNamespace(loss_is_scaled_for_ga=None, model_accepts_loss_kwargs=True, compute_loss_func=None)
    assert scaled(trainer, torch.tensor(12)) and not scaled(trainer, None)
    trainer.compute_loss_func = lambda *a, **k: None
    assert scaled(trainer, None)
    trainer.loss_is_scaled_for_ga = False
    assert not scaled(trainer, torch.tensor(12))


@pytest.mark.parametrize("lean_loss", [True, False])
def test_the_captured_steps_loss_gives_the_eager_steps_bits(tmp_path, single_thread, lean_loss):
    """An accumulated step through Trainer.training_step (an eager step) and through the loss
    function a warm-up and a capture run (with the normaliser as the graph's input) form the
    same loss and gradients: two steps of each from the same start end on the same weights."""
    from forge_hf.integrations.cuda_graph import NUM_ITEMS, TrainerGraph

    data = dataset(4)
    batches = [{k: torch.stack([d[k] for d in data[i:i + 2]]) for k in data[0]} for i in (0, 2)]
    items = torch.tensor(sum(int(b["labels"][:, 1:].numel()) for b in batches))
    weights = []
    for path in ("eager", "captured"):
        torch.manual_seed(0)
        options = f"backend=reference,min_params=0,state_precision=fp32,lean_loss={str(lean_loss).lower()}"
        args = training_args(tmp_path / path, gradient_accumulation_steps=2, max_steps=2, optim_args=options,
                             lr_scheduler_type="constant", warmup_steps=0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="forge: gradient_accumulation_steps=2 with the model's ops eager")
            trainer = ForgeTrainer(model=tiny_llama(), args=args, train_dataset=data)
            trainer.create_optimizer_and_scheduler(num_training_steps=2)
            trainer.model.train()
            for _ in range(2):
                for batch in batches:
                    if path == "eager":
                        trainer.training_step(trainer.model, dict(batch), items)
                    else:
                        inputs = {**trainer._prepare_inputs(dict(batch)), NUM_ITEMS: items}
                        TrainerGraph._loss_fn(trainer, trainer.model)(trainer.model, inputs).backward()
                trainer.optimizer.step()
                trainer.optimizer.zero_grad()
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
    start = [p.detach() for p in tiny_llama().parameters()]
    assert all(not torch.equal(a, s) for a, s in zip(weights[0], start))  # every parameter trained
    assert all(torch.equal(a, b) for a, b in zip(*weights))


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


def train(out, mode, callbacks=None, data=None, **overrides):
    args = cuda_args(out, optim_args=f"state_precision=bf16,min_params=0,cuda_graph={mode}", **overrides)
    trainer = ForgeTrainer(model=cuda_llama(), args=args, train_dataset=dataset() if data is None else data,
                           eval_dataset=dataset(8, seed=9), callbacks=callbacks)
    with sdpa_kernel(SDPBackend.MATH):  # deterministic attention backward
        trainer.train()
    return trainer


@pytest.mark.gpu
def test_a_run_whose_capture_fails_goes_on_with_the_eager_runs_bits(tmp_path):
    """The reference backend reads the GPU on the host, so its capture fails, after the
    optimizer's Python counted a step for some tensors: the run goes on eagerly with those
    counts taken back, step for step the eager run. (graph_bucket=1: the warm-up before the
    capture pads no batch, whose padded loss would be summed in another order.)"""
    runs = []
    for mode in ("auto", "false"):
        options = f"state_precision=fp32,min_params=0,backend=reference,graph_bucket=1,cuda_graph={mode}"
        args = cuda_args(tmp_path / mode, optim_args=options, lr_scheduler_type="constant", warmup_steps=0)
        trainer = ForgeTrainer(model=tiny_llama().cuda(), args=args, train_dataset=dataset())
        with sdpa_kernel(SDPBackend.MATH), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        runs.append((trainer, [str(w.message) for w in caught]))
    (graphed, messages), (eager, _) = runs
    assert any("capturing it failed" in m for m in messages), messages
    assert step_logs(graphed) == step_logs(eager)
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        assert torch.equal(a, b), name
    counts = [[s.step for s in run.forge_optimizer.state.values()] for run in (graphed, eager)]
    assert counts[0] == counts[1], counts


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
    assert len(graphed.forge_graph.captured) == 1
    assert graphed.forge_graph.captured[0].calls == 10 - 1  # the first step eager through the Trainer
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
    assert len(graphed.forge_graph.captured) == 1 and len(graphed_seen.taken) == 10
    for step, (seen, reference) in enumerate(zip(graphed_seen.taken, eager_seen.taken)):
        for (name, _), a, b, a0 in zip(graphed.model.named_parameters(), reference, seen, start):
            moved = (a.float() - a0.float()).norm()
            apart = (b.float() - a.float()).norm()
            assert apart <= 0.05 * moved or bf16_ulps_apart(a, b).max() <= 2, f"step {step}, {name}"


@pytest.mark.gpu
def test_graph_required_trains_through_the_graph(tmp_path):
    trainer = train(tmp_path, "true")
    assert len(trainer.forge_graph.captured) == 1


@pytest.mark.gpu
def test_resume_captures_again_and_continues_like_a_straight_run(tmp_path):
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    straight = train(tmp_path, "auto", save_strategy="steps", save_steps=5)
    args = cuda_args(tmp_path, optim_args="state_precision=bf16,min_params=0,cuda_graph=auto", save_strategy="steps",
                     save_steps=5)
    resumed = ForgeTrainer(model=cuda_llama(), args=args, train_dataset=dataset())
    with sdpa_kernel(SDPBackend.MATH):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert len(resumed.forge_graph.captured) == 1
    assert_parameters_follow(resumed.model, straight.model, start)


@pytest.mark.gpu
def test_accumulated_and_clipped_steps_are_captured_and_follow_the_eager_run(tmp_path):
    """gradient_accumulation_steps=2 with an active clip: a step's two micro-batches replay two
    graphs, the second clipping and stepping; each epoch's last step has one micro-batch (five
    batches an epoch) and runs eagerly, from the same weights and states; the run trains as
    the eager one does."""
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    common = dict(gradient_accumulation_steps=2, max_grad_norm=0.05, data=dataset(2 * 5))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="forge: a step runs eagerly: a step of 1 micro-batches")
        graphed = train(tmp_path / "g", "auto", **common)
    eager = train(tmp_path / "e", "false", **common)
    (step,) = graphed.forge_graph.captured
    assert len(step.micros) == 2 and step.calls > 4
    assert all(log["grad_norm"] > 0.05 for log in step_logs(eager))  # the clip is active
    assert_trains_alike(graphed, eager, start)


@pytest.mark.gpu
def test_a_short_last_batch_is_a_graph_of_its_own(tmp_path):
    data = dataset(2 * 6 + 1)  # six full batches of two, then one of one
    args = cuda_args(tmp_path, optim_args="state_precision=bf16,min_params=0", max_steps=-1, num_train_epochs=2)
    trainer = ForgeTrainer(model=cuda_llama(), args=args, train_dataset=data)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="forge:")
        trainer.train()
    assert trainer.forge_graph.off is None and len(trainer.forge_graph.captured) == 2
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in step_logs(trainer))


def padded_rows(lengths, labels_on_padding=False, left=False):
    """Rows of these lengths and a collator padding each batch to its longest row, with an
    attention mask and labels -100 under the padding (``labels_on_padding``: the padding's own
    ids; ``left``: padding before the tokens)."""
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen)} for n in lengths]

    def collate(rows):
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            where = slice(longest - n, longest) if left else slice(0, n)
            ids[i, where], mask[i, where] = r["input_ids"], 1
        labels = ids.clone() if labels_on_padding else ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return data, collate


class MaskKept(ForgeTrainer):
    """ForgeTrainer that gives the model every mask: the reference for the dropped ones."""

    def _forge_causal(self):
        return False


def train_padded(out, mode, lengths, trainer_cls=ForgeTrainer, **collate_options):
    data, collate = padded_rows(lengths, **collate_options)
    args = cuda_args(out, optim_args=f"state_precision=bf16,min_params=0,cuda_graph={mode}", max_steps=-1,
                     num_train_epochs=1, per_device_train_batch_size=2, train_sampling_strategy="sequential")
    trainer = trainer_cls(model=cuda_llama(), args=args, train_dataset=data, data_collator=collate)
    with sdpa_kernel(SDPBackend.MATH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    trainer.forge_messages = [str(w.message) for w in caught if "forge:" in str(w.message)]
    return trainer


LENGTHS = [SEQ, SEQ - 3, SEQ - 5, SEQ - 1, 9, 3, SEQ - 7, SEQ - 2] * 2 + [40, 33, 70, 12]


@pytest.mark.gpu
def test_right_padded_batches_replay_bucketed_graphs_and_train_as_the_masked_eager_run(tmp_path):
    """Batches padded to their longest row, mask dropped and padded on to a bucket of 64
    tokens: one graph for the rows up to 64, one past it; the run follows the eager one on
    the batches as collated, and its losses those of the run that keeps every mask."""
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    graphed = train_padded(tmp_path / "g", "true", LENGTHS)
    eager = train_padded(tmp_path / "e", "false", LENGTHS)  # the batches as collated, masks dropped
    masked = train_padded(tmp_path / "m", "false", LENGTHS, trainer_cls=MaskKept)
    assert graphed.forge_messages == []
    assert sorted(s.micros[0].inputs["input_ids"].shape[1] for s in graphed.forge_graph.captured) == [64, 128]
    assert all("attention_mask" not in s.micros[0].inputs for s in graphed.forge_graph.captured)
    assert_trains_alike(graphed, eager, start)
    # attention's masked and unmasked paths round apart in bf16: the losses agree, step by step
    for a, b in zip(step_logs(graphed), step_logs(masked), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * abs(b["loss"])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["left", "labels_on_padding"])
def test_masks_that_must_stay_are_captured_with_them(tmp_path, case):
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    options = {case: True}
    graphed = train_padded(tmp_path / "g", "auto", LENGTHS, **options)
    eager = train_padded(tmp_path / "e", "false", LENGTHS, trainer_cls=MaskKept, **options)
    assert graphed.forge_graph.off is None and graphed.forge_graph.captured
    assert all("attention_mask" in s.micros[0].inputs for s in graphed.forge_graph.captured)
    assert_trains_alike(graphed, eager, start)


@pytest.mark.gpu
def test_gradient_checkpointing_is_captured_and_follows_the_eager_run(tmp_path):
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    graphed = train(tmp_path / "g", "true", gradient_checkpointing=True)
    eager = train(tmp_path / "e", "false", gradient_checkpointing=True)
    assert len(graphed.forge_graph.captured) == 1
    assert_trains_alike(graphed, eager, start)


def test_static_reasons():
    """Gradient checkpointing, torch_compile, clipping and accumulation are captured;
    stop_on_nonfinite reads the host. (The micro-batches a step are the optimizer's count,
    which ForgeTrainer agrees with its arguments: test_trainer.)"""
    from forge_hf.integrations.cuda_graph import TrainerGraph

    args = types.SimpleNamespace(torch_compile=True, gradient_checkpointing=True)
    optimizer = types.SimpleNamespace(stop_on_nonfinite=False, holds_updates=True, accumulation_steps=2)
    trainer = types.SimpleNamespace(args=args, forge_optimizer=optimizer)
    assert TrainerGraph("auto")._static_reason(trainer, torch.nn.Linear(2, 2)) is None
    optimizer.stop_on_nonfinite = True
    reason = TrainerGraph("auto")._static_reason(trainer, torch.nn.Linear(2, 2))
    assert reason.startswith("stop_on_nonfinite")
    with pytest.raises(RuntimeError, match="cuda_graph=true, but the step cannot be captured: stop_on_nonfinite"):
        TrainerGraph("true")._disable(reason)


@pytest.mark.gpu
def test_a_compiled_step_is_captured_and_follows_the_compiled_eager_one(tmp_path):
    """torch_compile=True: the compiled model's step captured, forge's kernels inside it."""
    torch._dynamo.reset()
    start = [p.detach().clone() for p in cuda_llama().parameters()]
    graphed = train(tmp_path / "g", "true", torch_compile=True)
    torch._dynamo.reset()
    eager = train(tmp_path / "e", "false", torch_compile=True)
    assert len(graphed.forge_graph.captured) == 1 and graphed.forge_graph.captured[0].calls == 10 - 1
    assert_trains_alike(graphed, eager, start)
