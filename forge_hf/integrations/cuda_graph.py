"""CUDA graphs inside ForgeTrainer: ``optim_args="cuda_graph=auto|true|false"``.

Once three batches in a row have had the same shapes, the training step is captured by
optim/graphs.GraphedStep and replayed for every later batch of those shapes. ``auto`` (the
default) captures on a CUDA device where the step can be captured and warns once why not;
``true`` refuses to train eagerly; ``false`` never captures. Varying shapes release the
graph for the rest of the run. The design: docs/architecture.md, "CUDA graphs in the
Trainer".
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from torch import nn

from ..optim.graphs import GraphedStep, StaleGraph

STABLE_STEPS = 3  # batches of one shape in a row before a capture: two eager warm-ups, then capture
UNSETTLED_STEPS = 8  # steps without STABLE_STEPS batches of one shape in a row: the shapes vary
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


class TrainerGraph:
    """The graph state of one ForgeTrainer: counts batches of one shape, captures, replays,
    and gives each step that runs eagerly its reason."""

    overlap = True  # False: the loss waits for the whole step (what benchmarks compare the overlap with)

    def __init__(self, mode: str):
        self.mode = mode  # ForgeConfig.cuda_graph
        self.off: str | None = "cuda_graph=false" if mode == "false" else None  # why no graph, for the run
        self.step: GraphedStep | None = None
        self.shapes: tuple | None = None
        self.same_shapes = 0  # consecutive batches with self.shapes
        self.waiting = 0  # steps run eagerly while waiting for batches of one shape
        self.grad_norm: torch.Tensor | None = None  # the captured step's grad-norm output
        self._launched: GraphedStep | None = None  # the last replay, until joined
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ decisions

    def _static_reason(self, trainer, model: nn.Module) -> str | None:
        """Why no step of this run can be captured (checked until the first capture)."""
        if trainer.args.gradient_checkpointing or getattr(model, "is_gradient_checkpointing", False):
            return ("gradient checkpointing recomputes the forward inside backward with host-side RNG "
                    "bookkeeping a capture cannot hold")
        optimizer = trainer.forge_optimizer
        if optimizer is None:
            return "the optimizer is not a ForgeOptimizer"
        if optimizer.stop_on_nonfinite:
            return "stop_on_nonfinite=true reads a count on the host inside every step"
        return None

    def _disable(self, reason: str, warn: bool = True) -> None:
        """No graph for the rest of the run, said once."""
        if self.mode == "true":
            raise RuntimeError(f"optim_args cuda_graph=true, but the step cannot be captured: {reason}. "
                               "Use cuda_graph=auto (captures where it can) or false")
        self.off, self.step, self.grad_norm = reason, None, None
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

    def run(self, trainer, model: nn.Module, inputs: dict, num_items_in_batch) -> torch.Tensor | None:
        """This training step through the graph (its loss), or None: run it eagerly (after
        the last replay). The next replay joins the last one itself: until then the new
        batch's checks and copies run beside the last backward."""
        loss = self._run(trainer, model, inputs, num_items_in_batch)
        if loss is None:
            self.join()
        return loss

    def _run(self, trainer, model: nn.Module, inputs: dict, num_items_in_batch) -> torch.Tensor | None:
        if self.off is not None:
            return None
        device = next(model.parameters()).device
        if device.type != "cuda":  # auto on a CPU: eager is simply the way, nothing to warn about
            self._disable(f"the model is on {device}, and CUDA graphs need a CUDA device", warn=False)
            return None
        if self.step is None:
            reason = self._static_reason(trainer, model)
            if reason is not None:
                self._disable(reason)
                return None
        if not model.training:  # a walk over every module: only after an evaluation switched it off
            model.train()
        inputs = trainer._prepare_inputs(inputs)
        if num_items_in_batch is not None:
            inputs = {**inputs, NUM_ITEMS: torch.as_tensor(num_items_in_batch, device=device)}
        shapes = _shapes(inputs)
        if shapes is None:
            self._disable("a batch holds values that are not tensors")
            return None
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            # the capture took the unpadded path of the attention: a padded batch would replay it
            self._warn_once("its attention_mask pads some positions, which a captured step does not see")
            return None
        if self.step is not None and shapes != self.shapes:
            if self.step.graph is not None:
                return self._mismatch(shapes)
            self.step = None  # not captured yet: wait for batches of one shape again
        if self.step is None:
            self.same_shapes = self.same_shapes + 1 if shapes == self.shapes else 1
            self.shapes = shapes
            if self.same_shapes < STABLE_STEPS - 1:
                self.waiting += 1
                if self.waiting >= UNSETTLED_STEPS:
                    self._disable(f"batch shapes vary from step to step ({self._describe(shapes)} in the last): "
                                  "pack or pad batches to one length to replay a graph")
                return None
            self.step = GraphedStep(_forward_module(model), trainer.forge_optimizer,
                                    loss_fn=self._loss_fn(trainer, model), warmup_steps=1)
        try:
            loss = self._through_graph(trainer, inputs)
        except StaleGraph:  # a checkpoint was loaded into the optimizer (or the model moved): capture again
            self.step, self.grad_norm, self.same_shapes = None, None, 1
            return None
        if self.step is not None and self.step.graph is not None:
            self.waiting = 0  # captured: STABLE_STEPS batches of one shape came in a row
        return loss

    def _mismatch(self, shapes) -> None:
        """A batch of other shapes after the capture: eager once; twice in a row, release."""
        if self.same_shapes == 0:
            self._disable(f"batch shapes vary from step to step ({self._describe(self.shapes)} captured, "
                          f"then {self._describe(shapes)}): pack or pad batches to one length to replay a graph")
            return None
        self.same_shapes = 0
        self._warn_once(f"its batch has other shapes ({self._describe(shapes)}) than the captured step "
                        f"({self._describe(self.shapes)})")
        return None

    @staticmethod
    def _describe(shapes) -> str:
        return ", ".join(f"{k} {list(s)}" for k, s, _, _ in shapes)

    def _through_graph(self, trainer, inputs: dict) -> torch.Tensor:
        optimizer = trainer.forge_optimizer
        capturing = self.step.graph is None and self.step.calls >= self.step.warmup_steps
        try:
            loss = self.step.launch(inputs)
            self._launched = self.step  # the step to join, even after a stale graph drops it
            if not self.overlap:
                self.join()
        except RuntimeError as e:
            if not capturing:
                raise
            # something in the step reads the GPU on the host or copies host data to it
            # (a custom compute_loss, eager attention's mask, ...): nothing was executed
            self._disable(f"capturing it failed ({str(e).splitlines()[0][:300]})")
            return None
        if self.step.graph is not None:
            if capturing:
                self.grad_norm = optimizer.last_grad_norm
            optimizer.last_grad_norm = self.grad_norm  # an eager step in between replaced it
            self.same_shapes = max(self.same_shapes, 1)
        optimizer.skip_next_step()  # the Trainer's optimizer.step(): already part of this step
        return loss

    @staticmethod
    def _loss_fn(trainer, model: nn.Module):
        forward = _forward_module(model)

        def loss_fn(module, batch: dict) -> torch.Tensor:
            batch = skip_packing_check(forward, batch)
            num_items = batch.pop(NUM_ITEMS, None)
            with trainer.compute_loss_context_manager():
                return trainer.compute_loss(forward, batch, num_items_in_batch=num_items)

        return loss_fn
