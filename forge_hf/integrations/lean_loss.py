"""``lean_loss`` (on by default for causal LMs): the Trainer's causal-LM loss without an fp32 copy of the logits.

``lean_causal_lm_loss`` is set as the Trainer's ``compute_loss_func``: Hugging Face's
ForCausalLMLoss computed by nn/loss.py's chunked cross-entropy. Under mixed precision
(``bf16=True``) accelerate wraps the model's forward to return its outputs in fp32, which
for a causal LM is an fp32 copy of the logits (1 GiB at 2048 tokens of a 128k vocabulary),
the copy the lean loss exists to avoid: ``keep_logits_in_model_dtype`` takes that wrapper off
(autocast stays). The loss is the same either way: the chunks are upcast to fp32 inside.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn

from ..nn.loss import shifted_cross_entropy


def lean_loss_conflict(args, compute_loss_func=None, accelerator=None,
                       option="optim_args lean_loss=true") -> str | None:
    """Why lean_loss cannot train with these arguments, naming the value and the fix, or None
    (``option``: how the setting is named to the user)."""
    if compute_loss_func is not None:
        name = getattr(compute_loss_func, "__qualname__", type(compute_loss_func).__name__)
        return (f"{option} with compute_loss_func={name}: lean_loss is itself the Trainer's "
                "compute_loss_func (Hugging Face's causal-LM loss without an fp32 copy of the logits), so yours "
                "would be replaced: set lean_loss=false to train with your compute_loss_func, or drop "
                "compute_loss_func")
    config = getattr(args, "liger_kernel_config", None) or {}
    if getattr(args, "use_liger_kernel", False) and config.get("fused_linear_cross_entropy", True):
        # Liger's lce_forward computes the loss from the hidden states and lm_head.weight and
        # never builds the logits; with the labels taken out of the model's inputs (as a
        # compute_loss_func takes them) it builds them again, and patch_model leaves lm_head
        # unfused for Liger: more memory than Liger's loss alone
        return (f"{option} with use_liger_kernel=True: Liger's fused linear cross-entropy replaces "
                "the model's loss and never builds the logits, so the two losses exclude each other: set "
                "lean_loss=false (Liger's loss keeps no logits at all), or keep lean_loss and turn Liger's loss off "
                "with liger_kernel_config={'fused_linear_cross_entropy': False} (its other kernels stay) or "
                "use_liger_kernel=False")
    smoothing = getattr(args, "label_smoothing_factor", 0)
    if smoothing:
        return (f"{option} with label_smoothing_factor={smoothing}: the lean loss is the plain "
                "cross-entropy, and the Trainer smooths no loss that a compute_loss_func computes: set "
                "label_smoothing_factor=0 or lean_loss=false")
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and (getattr(pc, "cp_enabled", False) or getattr(pc, "sp_enabled", False)):
        return (f"{option} with context or sequence parallelism (accelerate's parallelism_config): "
                "each rank holds a slice of the sequence, whose labels the lean loss would shift within the slice "
                "(the model's loss reads shift_labels cut from whole sequences): set lean_loss=false")
    return None


def check_lean_loss(args, compute_loss_func=None, accelerator=None, option="optim_args lean_loss=true") -> None:
    """Refuse, naming the value and the fix, what lean_loss=true cannot do."""
    conflict = lean_loss_conflict(args, compute_loss_func, accelerator, option)
    if conflict is not None:
        raise ValueError(conflict)


def is_causal_lm(model: nn.Module) -> bool:
    """Whether the Trainer computes ``model``'s loss as a causal LM's (the class names it
    shifts labels for; a PEFT model by its base model's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    return type(base).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def lean_causal_lm_loss(outputs, labels, num_items_in_batch=None) -> torch.Tensor:
    """ForgeTrainer's ``compute_loss_func`` under lean_loss: Hugging Face's
    ForCausalLMLoss (labels shifted inside, -100 ignored, the sum divided by
    ``num_items_in_batch`` when the Trainer passes it, else the mean) from the model's
    logits, by nn/loss.py's chunked cross-entropy: no fp32 copy of the logits, and their
    gradient written over them. Nothing is read back to the host, so a CUDA graph captures it."""
    if labels is None:
        raise ValueError(
            "lean_loss computes the loss from the batch's 'labels', and this batch has none: "
            "give each batch labels (input_ids for causal-LM pretraining, e.g. "
            "DataCollatorForLanguageModeling(tokenizer, mlm=False)), or set optim_args lean_loss=false"
        )
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    return shifted_cross_entropy(logits, labels, num_items_in_batch)


def keep_logits_in_model_dtype(model: nn.Module) -> None:
    """Take accelerate's fp32 conversion of the outputs off ``model.forward``, where
    accelerate's mixed precision put it, keeping its autocast. Cheap to call at every step."""
    forward = model.__dict__.get("forward")  # only an instance attribute: accelerate sets one
    if forward is None:
        return
    function = getattr(forward, "__func__", forward)
    convert = getattr(function, "__wrapped__", None)  # accelerate's convert_outputs_to_fp32 marks it so
    from accelerate.utils.operations import ConvertOutputsToFp32

    if not isinstance(convert, ConvertOutputsToFp32):
        return
    inner = convert.model_forward
    model.forward = MethodType(inner, model) if hasattr(forward, "__func__") else inner
