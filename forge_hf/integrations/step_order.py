"""When the Trainer's own work must wait for a replayed step's backward.

A replayed step (cuda_graph.py) lets its loss out as soon as the forward is done and runs
its backward, the fused updates, on a side stream: the host goes on to the Trainer's work
between steps (scheduler, callbacks, the next batch and its copy to the GPU) while the GPU
is still busy. Whatever then reads or writes the model or the optimizer must be ordered
after that backward. The Trainer's logging, evaluation and checkpoints join in
ForgeTrainer's overrides; callbacks are ordered here: before an event that a callback other
than the Trainer's own host-only ones handles, the current stream waits for the step (on the
GPU: the host does not wait). A callback that reads no tensor of the model or the optimizer
can say so with ``forge_host_only = True``, and then orders nothing.
"""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback

HOST_ONLY = (DefaultFlowCallback, PrinterCallback, ProgressCallback)  # the Trainer's: flags, progress, printing


class StepOrder(TrainerCallback):
    """First in the Trainer's callbacks: joins the last replay before an event that a later
    callback may use to touch the step's tensors, and at every epoch's and the run's end."""

    forge_host_only = True

    def __init__(self, trainer):
        self._trainer = trainer

    def _join_for(self, event: str) -> None:
        if any(_touches_tensors(callback, event) for callback in self._trainer.callback_handler.callbacks):
            self._trainer.forge_graph.join()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._join_for("on_pre_optimizer_step")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._join_for("on_optimizer_step")

    def on_step_end(self, args, state, control, **kwargs):
        self._join_for("on_step_end")

    def on_epoch_end(self, args, state, control, **kwargs):
        # the loop's end: the best model's load, the caller's reads after train() follow
        self._trainer.forge_graph.join()

    def on_train_end(self, args, state, control, **kwargs):
        self._trainer.forge_graph.join()


def _touches_tensors(callback, event: str) -> bool:
    """Whether ``callback`` handles ``event`` and may read or write tensors there."""
    if getattr(callback, "forge_host_only", False) or isinstance(callback, HOST_ONLY):
        return False
    handler = getattr(type(callback), event, None)
    return handler is not None and handler is not getattr(TrainerCallback, event)
