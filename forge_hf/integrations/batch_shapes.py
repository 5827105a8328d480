"""Bringing a causal-LM batch to a shape a captured step can replay, without changing what the
model learns from it.

Two facts make this exact for a decoder whose attention is causal:

- A right-padded batch needs no attention mask for its real tokens: none of them attends to a
  later position, and the loss skips padding (labels -100). So a mask that only marks right
  padding may be dropped, which sends attention down its unmasked path and lets one graph
  serve every such batch. The check reads the mask, so it runs on the host, in the training
  collator (``PaddingMaskCheck``), before the batch moves to the GPU.
- Padding a batch further on the right (input 0, label -100, mask 0) leaves every real token's
  loss and gradient as they were; a padding-free row (``position_ids`` restarting at each
  example) gets its padding as one more sequence, positions from 0, that nothing attends across.
  ``pad_to_bucket`` does it on the device: it needs the shapes only.

Left padding, a mask with holes, labels that are not -100 under the padding, and models whose
attention is not causal keep their mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
# Set by PaddingMaskCheck on a batch whose mask marks right padding only (a Python bool: the
# device placement leaves it alone); taken out before the batch reaches the model.
MASK_DROPPABLE = "forge_mask_marks_right_padding_only"
# What the sequence dimension of each key is padded with; a batch with any other key of the
# sequence's length keeps its shape.
PAD_VALUES = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0, "token_type_ids": 0}


def bucket_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def mask_reason(mask: torch.Tensor, labels: torch.Tensor | None) -> str | None:
    """Why ``mask`` must stay (None: it only marks right padding under labels -100, and may go).
    Host tensors: this reads them."""
    if labels is None:
        return "the batch has no labels, so nothing shows the padding is out of the loss"
    if mask.dim() != 2 or labels.shape != mask.shape:
        return f"an attention_mask of shape {list(mask.shape)} beside labels of {list(labels.shape)}"
    kept = mask.bool()
    if not bool((kept[:, 1:] <= kept[:, :-1]).all()):
        return "its attention_mask has padding before a real token (left padding, or a hole)"
    if bool((labels[~kept] != IGNORE_INDEX).any()):
        return "some padded positions have labels other than -100"
    return None


def causal_reason(model: nn.Module) -> str | None:
    """Why ``model``'s padding mask must stay whatever it marks (None: every attention module
    of this decoder says ``is_causal``). A walk over the modules: callers keep the answer."""
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder"
    flags = [bool(m.is_causal) for m in model.modules()
             if isinstance(getattr(m, "is_causal", None), bool) and "attention" in type(m).__name__.lower()]
    if not flags:
        return f"{name} has no attention module that says it is causal"
    if not all(flags):
        return f"{name} has attention that is not causal (it needs its mask)"
    return None


class PaddingMaskCheck:
    """The training collator, followed by the host-side check of each batch's mask: a batch
    whose mask marks right padding only is marked ``MASK_DROPPABLE``. Picklable, for
    dataloader workers."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        mask = batch.get("attention_mask") if hasattr(batch, "get") else None
        if isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and \
                mask_reason(mask, batch.get("labels")) is None:
            batch[MASK_DROPPABLE] = True
        return batch


def take_mark(batch: dict) -> tuple[dict, bool]:
    """The batch without PaddingMaskCheck's mark, and whether it marked the mask droppable."""
    batch = dict(batch)
    return batch, batch.pop(MASK_DROPPABLE, False) is True


def without_mask(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "attention_mask"}


# What a padding-free collator adds for varlen attention kernels (TRL's, transformers' with
# return_flash_attn_kwargs): SDPA and eager attention never read them (they take the sequences
# from position_ids), and the lengths are host integers a replay could not change.
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
MASKED_ATTENTION = ("sdpa", "eager")


def without_varlen_keys(batch: dict, model: nn.Module) -> dict:
    """The batch without the varlen kernels' keys where the model's attention ignores them."""
    if not any(k in batch for k in VARLEN_KEYS):
        return batch
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attention not in MASKED_ATTENTION:
        return batch
    return {k: v for k, v in batch.items() if k not in VARLEN_KEYS}


def sequence_length(batch: dict) -> int | None:
    """The length of the batch's sequence dimension (input_ids' second), None without one."""
    ids = batch.get("input_ids")
    return ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def pad_to_bucket(batch: dict, multiple: int, at_least: int = 0) -> tuple[dict, str | None]:
    """The batch with its sequence dimension padded to a multiple of ``multiple``, and to
    ``at_least`` (exactly, as the module says), and why it was left as it is (None: padded,
    or already that long)."""
    length = sequence_length(batch)
    if length is None or (multiple <= 1 and at_least <= length):
        return batch, None
    extra = max(bucket_length(length, max(multiple, 1)), at_least) - length
    if extra == 0:
        return batch, None
    if "labels" not in batch:
        return batch, "the batch has no labels, so padding it could change the loss"
    padded = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != length:
            padded[key] = value
        elif key == "position_ids":
            # one more sequence, positions 0, 1, ...: the model keeps it apart from the others
            tail = torch.arange(extra, device=value.device, dtype=value.dtype).expand(value.shape[0], extra)
            padded[key] = torch.cat([value, tail], dim=1)
        elif key in PAD_VALUES and value.dim() == 2:
            padded[key] = F.pad(value, (0, extra), value=PAD_VALUES[key])
        else:
            return batch, f"batch[{key!r}] has the sequence's length and no known padding value"
    return padded, None
