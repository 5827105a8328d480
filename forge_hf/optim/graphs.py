"""A whole training step of a patched model replayed as one CUDA graph.

A forge step launches a few hundred small kernels from Python inside backward; at batch
sizes that fit a big model on one GPU the host cannot queue them as fast as the GPU runs
them. Captured once, the step (forward, backward with the fused updates, and
``ForgeOptimizer.step``) replays with one launch. What changes from step to step comes in
through tensors the graph reads: the batch (copied into the captured inputs) and every
launch's arguments (``kernels/runtime/launch_args.ArgsTable``: learning rate, bias corrections, step count,
refreshed on the host before each replay). The fused updates of a replay are those of the
eager step, bit for bit, given the same inputs; the model's own matmuls may round
differently under capture (cuBLAS chooses its algorithms with another workspace).

    step = GraphedStep(model, optimizer)
    for batch in batches:          # every batch the same shapes (packed sequences)
        loss = step(batch)         # a 0-dim tensor; .item() when you want to print it
        scheduler.step()

    step = GraphedStep(model, ForgeOptimizer(model, accumulate=4, max_grad_norm=1.0))
    for i, batch in enumerate(micro_batches):
        loss = step(batch)         # the 4th, 8th, ... call clips and steps
        if i % 4 == 3:
            scheduler.step()

Data parallel (``enable_data_parallel``): give every rank's GraphedStep the model itself, not
DDP(model). The step averages the non-fused gradients itself (``distributed.average_gradients``;
DDP's reducer is not captured), takes rank 0's weights at construction as DDP does, and
captures the layers' token and row all-gathers with everything else. Each rank's batches
must keep one shape, as on one GPU: the token counts exchanged in the warm-up are then
the counts of every replay.

Gradient accumulation (a ForgeOptimizer built with ``accumulate=k``, or with ``accumulate=True``
and ``GraphedStep(..., accumulation_steps=k)``): each call is one micro-batch, and the k-th call
of each step steps.
The step is captured as k graphs, one per micro-batch, in one memory pool and replayed in the
order they were captured: what the fused layers hold between micro-batches (their token stash
or gradient buffer, held_gradient.py) and the other parameters' gradients stay at the
addresses the captures gave them, written by the first micro-batch's graph, added to by the
next, read by the last one, which clips and steps.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

from ..core.state import slots_key
from ..kernels import ArgsTable, grow_reserved_scratch
from ..nn.loss import causal_lm_loss
from .distributed import average_gradients, broadcast_parameters
from .optimizer import ForgeOptimizer, fused_layers


def check_tensors(batch: dict) -> None:
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"batch[{key!r}] is a {type(value).__name__}: a graphed step takes tensors only")


def check_batch(captured: dict, batch: dict) -> None:
    """A replay reads the captured input tensors: a batch must match them key for key,
    in shape, dtype and device."""
    if set(batch) != set(captured):
        raise ValueError(f"the step was captured with batch keys {sorted(captured)}, this batch has "
                         f"{sorted(batch)}: give every step the same keys")
    check_tensors(batch)
    for key, value in batch.items():
        ref = captured[key]
        if (value.shape, value.dtype, value.device) != (ref.shape, ref.dtype, ref.device):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}, {value.dtype} on {value.device}; the step "
                f"was captured with {tuple(ref.shape)}, {ref.dtype} on {ref.device}: pad or pack every "
                "batch to one shape (a fixed sequence length, drop_last=True), or train eagerly")


class StaleGraph(RuntimeError):
    """A replay refused before it ran: what the graph writes was replaced since its capture."""


class CapturedAddresses:
    """What a captured step reads and writes outside its own memory pool, by address: the
    parameters, every optimizer-state tensor and the fused layers' statistics; and the
    param-group dicts its argument table reads. A replay is only valid while these stay.
    ``moved()`` reads them again before every replay, so the module tree is walked once, here:
    each check reads the parameters through their modules' own dicts (a replaced Parameter
    is seen, as is one whose data moved)."""

    def __init__(self, model: nn.Module, optimizer: ForgeOptimizer):
        self._params = [(m._parameters, name) for m in model.modules() for name in m._parameters]
        self._fused = list(fused_layers(model).values())
        self._optimizer = optimizer
        self.captured = self.read()

    def read(self) -> tuple:
        ptrs = [0 if (p := params.get(name)) is None else p.data_ptr() for params, name in self._params]
        ptrs += [slots_key(state.slots) for state in self._optimizer.state.values()]
        ptrs += [m.forge_stats.data_ptr() for m in self._fused]
        return tuple(ptrs), tuple(id(g) for g in self._optimizer.param_groups)

    def moved(self) -> bool:
        return self.read() != self.captured


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One warm-up stream per device for every GraphedStep: libraries cache per-stream
    state (cuBLAS its workspace), which a new stream per step would pile up."""
    return torch.cuda.Stream(device)


class _Micro:
    """One captured micro-batch of a step: its graph, inputs, loss and the event after the loss."""

    def __init__(self, inputs: dict):
        self.inputs = inputs
        self.graph = torch.cuda.CUDAGraph()
        self.loss: torch.Tensor | None = None
        self.loss_ready = torch.cuda.Event(external=True)  # recorded inside the graph, after the loss


def sharded_factored(model: nn.Module) -> str | None:
    """Why a step of ``model`` cannot be captured for its factored moments on row shards, or None:
    their column sums are added over the ranks in the set the host's step count picks, which a
    replay would not move (core/factored.py)."""
    for name, m in fused_layers(model).items():
        if m.forge_dp is not None and m.forge_dp.mode != "replicated" and m.forge_state.precision == "log4_factored":
            return (f"state_precision='log4_factored' on data_parallel='sharded' rows ({name}) adds its column "
                    "sums over the ranks in a set the host picks each step, which a CUDA graph cannot")
    return None


class GraphedStep:
    """``GraphedStep(model, optimizer, loss_fn=causal_lm_loss, warmup_steps=2, accumulation_steps=None)``.

    ``loss_fn(model, batch)`` returns the loss; the default is ``loss.causal_lm_loss``
    (Hugging Face's causal-LM loss without its fp32 copy of the logits, and without a read
    on the host). The model's own path must not read the GPU on the host or copy host
    tensors to it either: SDPA or flash attention without a padding mask is fine, eager
    attention (its mask comes from the host) is not.

    The first ``warmup_steps`` steps are ordinary eager steps (they compile the kernels and
    allocate the optimizer state); the next one is captured and every one from then on
    replayed. Each call is one training step on its batch (with ``accumulation_steps``, one
    micro-batch of it), warm-up included; a replay
    runs on a side stream, and the call orders the current stream after it. ``launch(batch)``
    is the call without that order: its loss is ready once the forward is done, and ``join()``
    orders the current stream after the rest (ForgeTrainer launches, and joins only before
    what touches the step's tensors, so that its work between steps overlaps the backward).
    Clipping (the ForgeOptimizer's ``max_grad_norm``) is part of ``optimizer.step()``, and so
    of the captured step. Changing a learning rate (a scheduler) needs no new capture; loading
    a checkpoint into the optimizer or moving the model does (a replay checks and refuses):
    build a new GraphedStep.

    Args:
        model: the patched model (not a DDP wrapper), on a CUDA device, in train mode.
        optimizer: its ForgeOptimizer.
        loss_fn: ``loss_fn(model, batch)`` returns the step's loss (default: causal_lm_loss).
        warmup_steps: eager steps before the capture (default 2); 0 where another step of this
            model and optimizer has warmed up already (its kernels compiled, its states allocated).
        pool: a memory pool (``torch.cuda.graph_pool_handle()``) shared with the steps of the
            model's other batch shapes; None: the step's own.
        accumulation_steps: micro-batches a step (each call one of them; each keeps the shapes
            of the micro-batch at its place in the captured step); default: the optimizer's
            count (its ``accumulate``), which a number given here must equal, unless it was
            built with ``accumulate=True``. Each micro-batch's loss is backpropagated as
            ``loss_fn`` returns it: divide it by k there for the mean over the step.
    """

    def __init__(self, model: nn.Module, optimizer: ForgeOptimizer,
                 loss_fn: Callable[[nn.Module, dict], torch.Tensor] = causal_lm_loss, warmup_steps: int = 2,
                 pool: tuple | None = None, accumulation_steps: int | None = None):
        if not isinstance(optimizer, ForgeOptimizer):
            raise TypeError(f"GraphedStep needs the model's ForgeOptimizer, got {type(optimizer).__name__}")
        if warmup_steps < 0 or (warmup_steps == 0 and not any(s.allocated for s in optimizer.state.values())):
            raise ValueError(f"warmup_steps={warmup_steps}: an eager step of this model and optimizer must compile "
                             "the kernels and allocate the states before a capture: give warmup_steps >= 1")
        if accumulation_steps is None:  # the optimizer's (one micro-batch where it leaves the count to the loop)
            accumulation_steps = max(optimizer.accumulation_steps, 1)
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps!r}: give the micro-batches a step, an int >= 1")
        conflict = optimizer.agree_accumulation(accumulation_steps)
        if conflict is not None:
            raise ValueError(conflict)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise TypeError("GraphedStep takes the model DDP wraps, not the DDP wrapper: DDP's gradient reducer "
                            "is not captured; the graphed step averages the non-fused gradients itself")
        dps = [m.forge_dp for m in fused_layers(model).values() if m.forge_dp is not None]
        if len({id(dp.group) for dp in dps}) > 1:
            raise ValueError("the fused layers run data parallel over different process groups: a graphed step "
                             "averages the other gradients over one; call enable_data_parallel once, with one group")
        reason = sharded_factored(model)
        if reason is not None:
            raise ValueError(f"{reason}: use data_parallel='replicated' or state_precision='log4' for a graphed step")
        if optimizer.stop_on_nonfinite:
            raise ValueError("stop_on_nonfinite=True reads a count on the host inside step(), which a graph "
                             "cannot: check optimizer.pop_nonfinite_tiles() between steps instead")
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise RuntimeError(f"the model is on {device}: CUDA graphs need a CUDA device; call the "
                               "eager step (loss.backward(); optimizer.step()) elsewhere")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.data_parallel = bool(dps)
        self.dp_group = dps[0].group if dps else None
        self.token_counts = list({id(dp.gather.counts): dp.gather.counts for dp in dps}.values())
        if self.data_parallel:
            broadcast_parameters(model, self.dp_group)
        self.warmup_steps = int(warmup_steps)
        self.pool = pool
        self.calls = 0  # micro-batches seen (calls), warm-up included
        self.micros: list[_Micro] = []  # the captured micro-batches of a step, in order
        self.table: ArgsTable | None = None
        self.addresses: CapturedAddresses | None = None  # set by the capture of the step's last micro-batch
        self._device = device
        self._replaying = False  # a replay the current stream has not been ordered after

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches a step: the optimizer's count."""
        return self.optimizer.accumulation_steps

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The graph of the step's last micro-batch (the one that steps) once every micro-batch
        is captured; None before."""
        return self.micros[-1].graph if self.addresses is not None else None

    @property
    def loss(self) -> torch.Tensor | None:
        """The loss output of the last captured micro-batch's graph."""
        return self.micros[-1].loss if self.micros else None

    @property
    def capturing(self) -> bool:
        """Whether the next call captures (its micro-batch's graph is not captured yet)."""
        return self.graph is None and self.calls >= self.warmup_steps * self.accumulation_steps

    def __call__(self, batch: dict) -> torch.Tensor:
        loss = self.launch(batch)
        self.join()
        return loss

    def launch(self, batch: dict) -> torch.Tensor:
        """This step, its loss ready on the current stream as soon as the forward is done: a
        replay runs on the side stream, which the current stream waits for only up to the
        loss. Call ``join()`` before the current stream reads or writes anything else the step
        touches (weights, states, gradients, the grad norm); the next ``launch`` joins first."""
        index = self.calls % self.accumulation_steps  # this micro-batch's place in its step
        last = index == self.accumulation_steps - 1
        if not self.capturing and self.graph is None:
            loss = self._eager(batch, last)
        else:
            if self.graph is None:
                self._capture(batch, index, last)
            elif index == 0 and self.addresses.moved():
                raise StaleGraph(
                    "the model's parameters, the optimizer's state tensors or its param groups were replaced "
                    "since the step was captured (optimizer.load_state_dict, model.to, ...): the graph would "
                    "write to memory they no longer own. Build a new GraphedStep after loading or moving.")
            micro = self.micros[index]
            check_batch(micro.inputs, batch)
            self.join()  # the last replay has read its inputs and arguments: they may be overwritten
            current, side = torch.cuda.current_stream(self._device), _side_stream(self._device)
            for key, value in batch.items():
                micro.inputs[key].copy_(value, non_blocking=True)
            if last:
                self.table.refresh()  # the step's arguments: read by the graph that steps
            side.wait_stream(current)
            with torch.cuda.stream(side):
                micro.graph.replay()
            self._replaying = True
            current.wait_event(micro.loss_ready)  # the loss, not the backward
            loss = micro.loss.clone()  # the next replay overwrites the captured loss
        self.calls += 1
        return loss

    def join(self) -> None:
        """Order the current stream after the last replay (on the GPU: the host does not wait)."""
        if self._replaying:
            torch.cuda.current_stream(self._device).wait_stream(_side_stream(self._device))
            self._replaying = False

    def _eager(self, batch: dict, last: bool) -> torch.Tensor:
        # on a side stream, as before any capture (torch.cuda.graphs' warm-up rule)
        side = _side_stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            loss = self._step(batch, last)
            if last:
                self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream(self._device).wait_stream(side)
        return loss

    def _step(self, batch: dict, last: bool = True, loss_ready: torch.cuda.Event | None = None) -> torch.Tensor:
        """What is captured: forward, backward (the fused updates, or what the fused layers
        hold), and at a step's last micro-batch the non-fused gradients' average over the
        ranks and the optimizer step (which clips and steps what was held)."""
        loss = self.loss_fn(self.model, batch)
        if loss_ready is not None:
            loss_ready.record()  # a node of the graph: its replays let the loss be read early
        loss.backward()
        if last:
            if self.data_parallel:
                average_gradients(self.model, self.dp_group)
            self.optimizer.step()
        return loss.detach()

    def _capture(self, batch: dict, index: int, last: bool) -> None:
        """Capture micro-batch ``index`` of the step. The micro-batches before it were captured
        and replayed just before: what they hold (the fused layers' stash, the gradients) is
        where this graph reads and adds to it."""
        check_tensors(batch)
        if index == 0:
            self.micros = []
            capacity = sum(len(group["params"]) for group in self.optimizer.param_groups)
            self.table = ArgsTable(capacity, self._device)
            if self.pool is None and self.accumulation_steps > 1:
                self.pool = torch.cuda.graph_pool_handle()  # one pool for the step's graphs
            self.optimizer.zero_grad(set_to_none=True)  # the graph allocates the gradients it writes
        micro = _Micro({key: value.clone() for key, value in batch.items()})
        grow_reserved_scratch()  # for layers whose captured steps take the two-pass path, eager ones not
        held = self.optimizer.held_snapshot()
        torch.cuda.synchronize(self._device)
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            # the eager steps' streams keep a cuBLAS workspace each (64 MiB on Hopper), idle while
            # the graph replays on its own: freed here, allocated again should an eager step come
            torch._C._cuda_clearCublasWorkspaces()
        # Data parallel: NCCL's watchdog thread may still query events of the warm-up's
        # collectives, which a process-wide capture mode would forbid.
        mode = "thread_local" if self.data_parallel else "global"
        try:
            with contextlib.ExitStack() as frozen:
                for counts in self.token_counts:
                    frozen.enter_context(counts.frozen())
                with self.table.recording(), torch.cuda.graph(micro.graph, pool=self.pool, capture_error_mode=mode):
                    micro.loss = self._step(micro.inputs, last, micro.loss_ready)
        except BaseException:
            # nothing ran: what the earlier micro-batches hold (written by their replays) is what
            # an eager step goes on from, without what this capture would have added
            self.optimizer.held_restore(held)
            raise
        self.micros.append(micro)
        if last:
            if self.pool is not None:
                # the gradients the graphs write, in the shared pool: the next step's capture may reuse them
                self.optimizer.zero_grad(set_to_none=True)
            self.addresses = CapturedAddresses(self.model, self.optimizer)
