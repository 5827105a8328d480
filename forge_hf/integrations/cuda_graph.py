"""CUDA graphs inside ForgeTrainer: ``optim_args="cuda_graph=auto|true|false"``.

After the run's first two steps (eager: they compile the kernels and allocate the states),
each batch is padded up to its bucket (``graph_bucket``: the sequence length rounded up, the
padding out of the loss; batch_shapes.py) and replayed by the graph of its shapes, captured
when the shapes are first seen. Up to ``max_graphs`` graphs are kept, all in one memory pool:
they replay one at a time, so the pool holds the largest step's temporaries, not their sum;
a batch of a further shape runs eagerly (said once). ``auto`` (the default) captures on a
CUDA device where the step can be captured and warns once why not; ``true`` refuses to train
eagerly; ``false`` never captures. The design: docs/architecture.md, "CUDA graphs in the
Trainer".

With ``gradient_accumulation_steps=k`` a step's k micro-batches (the Trainer fetches them
together) are padded to one shape, the longest one's bucket, and replay a GraphedStep of k
graphs (optim/graphs.py), the last of which clips and steps. A step whose micro-batches cannot
take one shape, or that has fewer than k (an epoch's last), runs eagerly as a whole.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings

import torch
from torch import nn

from ..optim.graphs import GraphedStep, StaleGraph, sharded_factored
from .batch_shapes import bucket_length, pad_to_bucket, sequence_length
from .captured_loss import captured_loss

EAGER_STEPS = 2  # a run's first steps, eager: the Trainer's own, then a GraphedStep's warm-up
NUM_ITEMS = "forge_num_items_in_batch"  # Trainer's loss normaliser, carried into the graph as an input


def _shapes(inputs: dict) -> tuple | None:
    """The batch's (key, shape, dtype, device) signature; None if a value is not a tensor."""
    if not all(isinstance(v, torch.Tensor) for v in inputs.values()):
        return None
    return tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in sorted(inputs.items()))


def skip_packing_check(model: nn.Module, inputs: dict) -> dict:
    """A copy of ``inputs``, with ``use_cache=True`` where the batch has no position_ids and
    the model is a decoder whose forward takes the argument.

    Without a cache, a Hugging Face model checks its position_ids for sequences packed into
    one row; it cannot while a CUDA graph is captured (or a model compiled), and then builds a
    4-D causal mask, which sends SDPA down its masked path: the keys and values expanded to
    every head and kept (0.25 GiB on Llama-3.1-8B at 512 tokens), a slower kernel. Positions the
    model numbers itself are never packed, and a cache holds the keys and values attention
    keeps anyway. Position_ids the batch brings may mark packed sequences: left to the check."""
    module = _forward_module(model)
    module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the model it compiles
    config = getattr(module, "config", None)
    if "position_ids" in inputs or "use_cache" in inputs or getattr(config, "use_cache", None) is None \
            or getattr(config, "is_encoder_decoder", False) or not _takes_use_cache(type(module)):
        return dict(inputs)
    return {**inputs, "use_cache": True}


@functools.cache
def _takes_use_cache(module_type: type) -> bool:
    """Whether the model's forward names a ``use_cache`` argument (one it would pass on
    through ``**kwargs`` may reach a layer that does not take it)."""
    try:
        return "use_cache" in inspect.signature(module_type.forward).parameters
    except (TypeError, ValueError):
        return False


def _forward_module(model: nn.Module) -> nn.Module:
    """The module to run inside a capture: DDP's reducer is not captured (GraphedStep
    averages the other gradients itself), so the module it wraps."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def new_pool() -> tuple:
    """A memory pool for the captured steps of one run."""
    return torch.cuda.graph_pool_handle()


class TrainerGraph:
    """The graph state of one ForgeTrainer: the captured steps by batch shapes, which it
    captures, replays, or gives each step that runs eagerly its reason."""

    overlap = True  # False: the loss waits for the whole step (what benchmarks compare the overlap with)

    def __init__(self, mode: str, graph_bucket: int = 64, max_graphs: int = 8):
        self.mode = mode  # ForgeConfig.cuda_graph, graph_bucket, max_graphs
        self.graph_bucket, self.max_graphs = graph_bucket, max_graphs
        self.window: list = []  # the raw micro-batches of the optimizer step under way (start_window)
        self.windows_run = 0  # optimizer steps begun with accumulation, eager ones included
        self._position = 0  # the next micro-batch's place in its window
        self._plan: tuple | None = None  # (the window's shapes, each micro-batch's inputs); None: eager
        self.off: str | None = "cuda_graph=false" if mode == "false" else None  # why no graph, for the run
        self.steps: dict[tuple, GraphedStep] = {}  # by the shapes of the batches each replays
        self.grad_norms: dict[tuple, torch.Tensor] = {}  # each captured step's grad-norm output
        self.eager: dict[tuple, str] = {}  # shapes whose capture failed, and why
        self._retried: set[tuple] = set()  # shapes whose capture at their first batch failed once
        self.pool = None  # the memory pool every step captures into
        self.steps_run = 0  # steps seen, eager ones included
        self.capture_seconds: list[float] = []  # the host time of each capture (and its first replay)
        self._launched: GraphedStep | None = None  # the last replay, until joined
        self._warned: set[str] = set()

    @property
    def captured(self) -> list[GraphedStep]:
        """The steps captured so far, one per batch shape."""
        return [step for step in self.steps.values() if step.graph is not None]

    # ------------------------------------------------------------------ decisions

    def _static_reason(self, trainer, model: nn.Module) -> str | None:
        """Why no step of this run can be captured (checked until the first capture)."""
        optimizer = trainer.forge_optimizer
        if optimizer is None:
            return "the optimizer is not a ForgeOptimizer"
        if optimizer.stop_on_nonfinite:
            return "stop_on_nonfinite=true reads a count on the host inside every step"
        return sharded_factored(_forward_module(model))

    def _disable(self, reason: str, warn: bool = True) -> None:
        """No graph for the rest of the run, said once."""
        if self.mode == "true":
            raise RuntimeError(f"optim_args cuda_graph=true, but the step cannot be captured: {reason}. "
                               "Use cuda_graph=auto (captures where it can) or false")
        self.off = reason
        self.steps, self.grad_norms, self.pool = {}, {}, None
        if warn:
            warnings.warn(f"forge: training steps run eagerly, without a CUDA graph: {reason}", stacklevel=3)

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"forge: a step runs eagerly: {reason}", stacklevel=3)

    # ------------------------------------------------------------------ the step

    def join(self) -> None:
        """Order the current stream after the last replay, before anything on it reads or
        writes what the step touched. A replay runs on a side stream and lets the loss out as
        soon as the forward is done, so that the host's work between steps overlaps the
        backward; the wait is the GPU's, the host goes on."""
        if self._launched is not None:
            self._launched.join()
            self._launched = None

    def start_window(self, batches: list) -> None:
        """The micro-batches of the next optimizer step, as the Trainer fetched them
        (get_batch_samples): with accumulation they are brought to one shape together."""
        self.window, self._position, self._plan = list(batches), 0, None

    def run(self, trainer, model: nn.Module, inputs: dict | None, num_items_in_batch) -> torch.Tensor | None:
        """This training step (with accumulation: this micro-batch) through a graph (its loss),
        or None: run it eagerly (after the last replay). ``inputs`` is the batch for the model
        (the trainer's _forge_model_inputs); with accumulation the window's micro-batches are
        taken in order instead (start_window). The next replay joins the last one itself: until
        then the new batch's checks and copies run beside the last backward."""
        self.steps_run += 1
        if micro_batches(trainer) > 1:
            loss = self._run_micro(trainer, model, num_items_in_batch)
        else:
            loss = self._run(trainer, model, inputs, num_items_in_batch)
        if loss is None:
            self.join()
        return loss

    def _ready(self, trainer, model: nn.Module) -> bool:
        """Whether this run may capture at all (else said once, with the reason)."""
        if self.off is not None:
            return False
        device = next(model.parameters()).device
        if device.type != "cuda":  # auto on a CPU: eager is simply the way, nothing to warn about
            self._disable(f"the model is on {device}, and CUDA graphs need a CUDA device", warn=False)
            return False
        if not self.captured:
            reason = self._static_reason(trainer, model)
            if reason is not None:
                self._disable(reason)
                return False
        return True

    def _prepared(self, trainer, model: nn.Module, inputs: dict, num_items_in_batch, at_least: int = 0) -> dict:
        """The batch on the device, padded to its bucket (and to ``at_least``), with the loss's normaliser."""
        inputs = trainer._prepare_inputs(inputs)
        inputs, why_not_padded = pad_to_bucket(inputs, self.graph_bucket, at_least)
        if why_not_padded is not None:
            self._warn_once(f"a batch kept its length ({why_not_padded}): it is captured at that length")
        if num_items_in_batch is not None:
            device = next(model.parameters()).device
            inputs = {**inputs, NUM_ITEMS: torch.as_tensor(num_items_in_batch, device=device)}
        return inputs

    def _step_for(self, trainer, model: nn.Module, shapes: tuple | None) -> GraphedStep | None:
        """The captured step of these shapes, a new one, or None: eager (said once)."""
        if shapes is None:
            self._disable("a batch holds values that are not tensors")
            return None
        if shapes in self.eager:
            return None
        step = self.steps.get(shapes)
        if step is None:
            if len(self.steps) >= self.max_graphs:
                self._warn_once(f"its batch shapes ({self._describe(shapes)}) would be graph {len(self.steps) + 1}, "
                                f"past max_graphs={self.max_graphs}: raise max_graphs or graph_bucket in optim_args")
                return None
            # the first step's warm-up has run: later shapes capture at their first batch
            step = self._new_step(trainer, model, shapes, warmup_steps=1 if not self.steps else 0)
        return step

    def _run(self, trainer, model: nn.Module, inputs: dict, num_items_in_batch) -> torch.Tensor | None:
        if not self._ready(trainer, model):
            return None
        if self.steps_run < EAGER_STEPS:  # the Trainer's own first step
            return None
        if not model.training:  # a walk over every module: only after an evaluation switched it off
            model.train()
        inputs = self._prepared(trainer, model, inputs, num_items_in_batch)
        shapes = _shapes(inputs)
        step = self._step_for(trainer, model, shapes)
        if step is None:
            return None
        try:
            return self._through_graph(trainer, step, shapes, inputs)
        except StaleGraph:  # a checkpoint was loaded into the optimizer (or the model moved): capture again
            self.steps, self.grad_norms, self.pool = {}, {}, None
            return None

    def _run_micro(self, trainer, model: nn.Module, num_items_in_batch) -> torch.Tensor | None:
        """One micro-batch of an accumulated step: the window's plan, made at its first."""
        position = self._position
        self._position += 1
        if position == 0:
            self.windows_run += 1
            self._plan = self._plan_window(trainer, model, num_items_in_batch)
        if self._plan is None:
            return None
        shapes, inputs = self._plan
        step = self.steps.get(shapes)  # a capture that failed earlier in the window dropped it
        if step is None:
            self._plan = None
            return None
        last = position == step.accumulation_steps - 1
        try:
            loss = self._through_graph(trainer, step, shapes, inputs[position], last=last)
        except StaleGraph:  # checked at a window's first micro-batch: this window runs eagerly
            self.steps, self.grad_norms, self.pool = {}, {}, None
            loss = None
        if loss is None:
            self._plan = None  # the rest of the window eagerly, from what the graphs before held
        return loss

    def _plan_window(self, trainer, model: nn.Module, num_items_in_batch) -> tuple | None:
        """The window's GraphedStep and its micro-batches brought to one shape, or None: the
        whole window runs eagerly."""
        if not self._ready(trainer, model) or self.windows_run < EAGER_STEPS:  # the Trainer's own first step
            return None
        window, count = self.window, micro_batches(trainer)
        if len(window) != count:
            self._warn_once(f"a step of {len(window)} micro-batches, not gradient_accumulation_steps="
                            f"{count} (an epoch's last), runs eagerly")
            return None
        if not model.training:
            model.train()
        batches = [trainer._forge_model_inputs(batch, captured=True) for batch in window]
        lengths = [n for n in map(sequence_length, batches) if n is not None]
        at_least = bucket_length(max(lengths), max(self.graph_bucket, 1)) if lengths else 0
        inputs = [self._prepared(trainer, model, batch, num_items_in_batch, at_least) for batch in batches]
        shapes = {_shapes(batch) for batch in inputs}
        if len(shapes) != 1:
            self._warn_once("the micro-batches of a step have different keys or shapes after padding: "
                            "such a step runs eagerly")
            return None
        (shapes,) = shapes
        return None if self._step_for(trainer, model, shapes) is None else (shapes, inputs)

    def _new_step(self, trainer, model: nn.Module, shapes: tuple, warmup_steps: int) -> GraphedStep:
        if self.pool is None:
            self.pool = new_pool()
        step = self.steps[shapes] = GraphedStep(_forward_module(model), trainer.forge_optimizer,
                                                loss_fn=self._loss_fn(trainer, model), warmup_steps=warmup_steps,
                                                pool=self.pool)
        return step

    @staticmethod
    def _describe(shapes) -> str:
        return ", ".join(f"{k} {list(s)}" for k, s, _, _ in shapes)

    def _through_graph(self, trainer, step: GraphedStep, shapes: tuple, inputs: dict,
                       last: bool = True) -> torch.Tensor | None:
        """``inputs`` through ``step``; ``last``: the micro-batch whose graph steps (always, without
        accumulation)."""
        optimizer = trainer.forge_optimizer
        capturing = step.capturing
        first = step.calls % step.accumulation_steps == 0  # a step's first micro-batch
        started = time.perf_counter()
        try:
            loss = step.launch(inputs)
            self._launched = step  # the step to join, even after a stale graph drops it
            if not self.overlap:
                self.join()
        except RuntimeError as e:
            if not capturing or isinstance(e, StaleGraph):
                raise
            # something in the step reads the GPU on the host or copies host data to it
            # (a custom compute_loss, eager attention's mask, ...): nothing was executed, and what
            # the micro-batches before it held is as their replays left it (GraphedStep._capture)
            if step.warmup_steps == 0 and shapes not in self._retried:
                # captured at its first batch, it needed what only an eager step of these shapes makes
                # (a kernel variant for its token count): this batch warms it up, the next one captures
                self._retried.add(shapes)
                if first:
                    step = self._new_step(trainer, step.model, shapes, warmup_steps=1)
                    return self._through_graph(trainer, step, shapes, inputs, last)
                del self.steps[shapes]  # a later micro-batch's (the step's own token count): the rest of
                return None  # this step runs eagerly, and the next step of these shapes captures again
            reason = f"capturing it failed ({str(e).splitlines()[0][:300]})"
            del self.steps[shapes]
            if not self.captured:
                self._disable(reason)
            else:  # other shapes replay: these run eagerly
                self.eager[shapes] = reason
                self._warn_once(f"batches of shapes {self._describe(shapes)}: {reason}")
            return None
        if capturing:
            self.capture_seconds.append(time.perf_counter() - started)
        if not last:
            return loss
        if step.graph is not None:
            if capturing:
                self.grad_norms[shapes] = optimizer.last_grad_norm
            optimizer.last_grad_norm = self.grad_norms[shapes]  # another step replaced it
        optimizer.skip_next_step()  # the Trainer's optimizer.step(): already part of this step
        return loss

    @staticmethod
    def _loss_fn(trainer, model: nn.Module):
        forward = _forward_module(model)

        def loss_fn(module, batch: dict) -> torch.Tensor:  # run at warm-ups and captures only
            batch = skip_packing_check(forward, batch)
            num_items = batch.pop(NUM_ITEMS, None)
            with trainer.compute_loss_context_manager():
                loss = captured_loss(trainer)[0](forward, batch, num_items_in_batch=num_items)
            if not loss_is_scaled_for_accumulation(trainer, num_items):  # as Trainer.training_step scales it
                loss = loss / trainer.current_gradient_accumulation_steps
            return loss

        return loss_fn


def micro_batches(trainer) -> int:
    """The micro-batches of each optimizer step: the ForgeOptimizer's count (ForgeTrainer
    builds it with gradient_accumulation_steps, or agrees a given one with it)."""
    optimizer = trainer.forge_optimizer
    return 1 if optimizer is None else max(optimizer.accumulation_steps, 1)


def loss_is_scaled_for_accumulation(trainer, num_items_in_batch) -> bool:
    """Whether the loss is already a share of the whole step's (Trainer.training_step's test):
    normalised by ``num_items_in_batch`` in the model or by a compute_loss_func. Else the
    Trainer divides it by the step's micro-batches."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is not None:
        return scaled
    return (getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) \
        or getattr(trainer, "compute_loss_func", None) is not None
