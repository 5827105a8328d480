"""The loss function a captured training step calls.

A captured step runs the trainer's ``compute_loss``, which must not read the GPU on the host.
TRL's ``SFTTrainer.compute_loss`` does (its entropy, token-accuracy and token-count metrics are
read with ``.item()`` at every step), so with its default loss (``loss_type="nll"``, no label
smoothing, no MoE auxiliary loss) a captured step computes the same loss as ``Trainer.compute_loss``
does: the summed token log-likelihood over ``num_items_in_batch`` (or the mean over the labelled
tokens), scaled for ``average_tokens_across_devices`` alike. Those metrics are then logged only for
the steps that run eagerly. Any other loss is captured as the trainer defines it, or runs eagerly
where the capture fails.
"""

from __future__ import annotations

import functools

from transformers import Trainer


def loss_owner(trainer) -> type:
    """The class whose ``compute_loss`` the trainer runs."""
    return next(c for c in type(trainer).__mro__ if "compute_loss" in c.__dict__)


def _is_trl_sft(cls: type) -> bool:
    return cls.__name__ == "SFTTrainer" and cls.__module__.startswith("trl.")


def sft_reason(trainer) -> str | None:
    """Why an SFTTrainer's loss is not the plain token log-likelihood (None: it is)."""
    args = trainer.args
    if getattr(args, "loss_type", "nll") != "nll":
        return f"loss_type={args.loss_type!r}"
    if getattr(trainer, "label_smoother", None) is not None:
        return "label smoothing"
    if getattr(trainer, "aux_loss_enabled", False):
        return "the MoE auxiliary loss"
    return None


def captured_loss(trainer):
    """``compute_loss(model, inputs, num_items_in_batch=...)`` for the captured step, and
    whether it is ``Trainer.compute_loss`` (which reads no input but the model's)."""
    owner = loss_owner(trainer)
    if owner is Trainer:
        return trainer.compute_loss, True
    if _is_trl_sft(owner) and sft_reason(trainer) is None:
        return functools.partial(Trainer.compute_loss, trainer), True
    return trainer.compute_loss, False
