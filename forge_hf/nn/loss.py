"""A causal-LM cross-entropy that keeps no fp32 copy of the logits.

Hugging Face's loss casts the whole (tokens x vocabulary) logits to fp32 before the
cross-entropy, and autograd then holds that copy and its gradient: at 512 tokens and
Llama-3's 128K vocabulary, 0.25 GiB each, next to a peak that forge has otherwise brought
down to weights, states and activations. Here the fp32 work is done in registers by the row
kernels of kernels/triton/cross_entropy.py on a CUDA device (elsewhere by torch, a block of rows at
a time), the gradient is written over the logits (which nothing needs after the loss), and
nothing is read back to the host, so a CUDA graph can capture it (Liger's cross-entropy
reads the token count with ``.item()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import row_grad_, row_lse

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 24  # fp32 temporaries of one block of rows: 64 MiB
ROW_KERNELS = True  # False: torch's kernels on every device (what benchmarks compare the row kernels with)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``logits`` (N, V) against ``targets`` (N,) over the rows whose
    target is not ``ignore_index`` or, given ``num_items_in_batch``, their sum divided by it;
    the logits' gradient replaces the logits."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, chunk_rows, num_items_in_batch=None):
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        count = _divisor(num_items_in_batch, logits.device)
        if count is None:
            count = valid.sum().clamp_min(1)  # stays on the device
        if _on_row_kernels(logits):
            lse, picked = row_lse(logits, safe)
        else:
            lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
            picked = torch.empty_like(lse)
            for r0 in range(0, logits.shape[0], chunk_rows):
                rows = slice(r0, r0 + chunk_rows)
                block = logits[rows].float()
                lse[rows] = torch.logsumexp(block, dim=-1)
                picked[rows] = block.gather(1, safe[rows, None]).squeeze(1)
                del block  # before the next block is made, not after
        counted = torch.is_tensor(count)  # else a Python number, kept as it is
        ctx.save_for_backward(logits, safe, valid, lse, *([count] if counted else []))
        ctx.chunk_rows, ctx.number = chunk_rows, None if counted else count
        return torch.where(valid, lse - picked, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        if getattr(ctx, "logits_overwritten", False):
            raise RuntimeError("backward ran twice through forge_hf's cross-entropy (retain_graph=True?), whose "
                               "first backward wrote the gradient over the logits: use "
                               "torch.nn.functional.cross_entropy to differentiate the loss more than once")
        ctx.logits_overwritten = True
        logits, safe, valid, lse, *count = ctx.saved_tensors
        scale = torch.where(valid, grad / (count[0] if count else ctx.number), 0.0)
        if _on_row_kernels(logits):
            row_grad_(logits, safe, lse, scale)
            return logits, None, None, None, None
        for r0 in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(r0, r0 + ctx.chunk_rows)
            # in place: one fp32 block alive, not three (0.12 GiB at a Llama-3 step's peak,
            # which falls here, with every activation still saved)
            block = logits[rows].float().sub_(lse[rows, None]).exp_()  # softmax
            block.scatter_add_(1, safe[rows, None], torch.full_like(block[:, :1], -1.0))
            block *= scale[rows, None]
            logits[rows] = block
            del block
        return logits, None, None, None, None


def _on_row_kernels(logits: torch.Tensor) -> bool:
    """Whether the fused row kernels (kernels/triton/cross_entropy.py) take these logits: on a CUDA
    device, rows contiguous; elsewhere torch's kernels a block of rows at a time."""
    return ROW_KERNELS and logits.is_cuda and logits.stride(1) == 1


def _divisor(num_items_in_batch, device):
    """Hugging Face's divisor of a summed loss (transformers' fixed_cross_entropy): a tensor
    is moved to the loss's device (no copy, no host read, when it is there already), a
    number is used as it is; None: none given."""
    if torch.is_tensor(num_items_in_batch):
        return num_items_in_batch.to(device)
    return num_items_in_batch


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                  num_items_in_batch: torch.Tensor | int | float | None = None) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets, ignore_index=...)`` (mean) for 2-D logits,
    without the fp32 copy; the logits are overwritten by their gradient in backward.

    Given ``num_items_in_batch`` (the Trainer's count of targets over a whole, possibly
    accumulated or gathered, batch: an int or a tensor), the loss is Hugging Face's
    ``reduction="sum"`` divided by it instead, as transformers' ``ForCausalLMLoss`` computes
    it; a tensor stays on the device. (With gradients, the mean of a batch whose every target
    is ignored is 0 here, where torch's is nan; a sum divided by a zero count is nan in both.)"""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits of shape {tuple(logits.shape)} and targets of shape {tuple(targets.shape)}: "
                         "expected (tokens, vocabulary) and (tokens,)")
    if not torch.is_grad_enabled() or not logits.requires_grad:
        if num_items_in_batch is None:
            return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)
        total = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")
        return total / _divisor(num_items_in_batch, total.device)
    chunk_rows = max(1, CHUNK_ELEMENTS // max(logits.shape[1], 1))
    return ChunkedCrossEntropy.apply(logits, targets, ignore_index, chunk_rows, num_items_in_batch)


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                          num_items_in_batch: torch.Tensor | int | float | None = None,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Hugging Face's causal-LM loss from a model's ``logits`` (..., V) and the batch's
    ``labels`` (...): each position predicts the next label, the last predicts nothing, -100
    is ignored, and ``num_items_in_batch`` divides the sum as in ``ForCausalLMLoss``; by
    ``cross_entropy`` above, so the logits are overwritten by their gradient in backward."""
    targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device),
                         ignore_index, num_items_in_batch)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def causal_lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The loss Hugging Face's causal LMs compute from ``batch["labels"]`` (each position
    predicts the next label; -100 is ignored), by ``cross_entropy`` above."""
    if "labels" not in batch:
        raise ValueError(f"the batch has no 'labels' (keys: {sorted(batch)}): a causal-LM loss needs them")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if getattr(getattr(model, "config", None), "use_cache", None) is not None and not _capturing():
        # no key/value cache in an eager training forward: it would only hold memory (64 MB
        # alive at the peak of a Llama-3.1-8B step at 512 tokens). Not while a CUDA graph is
        # captured: without a cache, transformers checks position_ids for packed sequences,
        # cannot while capturing, and builds a 4-D causal mask; SDPA's masked path then keeps
        # the expanded keys and values (+0.2 GiB at that peak).
        inputs.setdefault("use_cache", False)
    return shifted_cross_entropy(model(**inputs).logits, batch["labels"])
