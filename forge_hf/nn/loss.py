"""A causal-LM cross-entropy that keeps no fp32 copy of the logits.

Hugging Face's loss casts the whole (tokens x vocabulary) logits to fp32 before the
cross-entropy, and autograd then holds that copy and its gradient: at 512 tokens and
Llama-3's 128K vocabulary, 0.25 GiB each, next to a peak that forge has otherwise brought
down to weights, states and activations. Here the fp32 work is done a block of rows at a
time, the gradient is written over the logits (which nothing needs after the loss), and
nothing is read back to the host, so a CUDA graph can capture it (Liger's cross-entropy
reads the token count with ``.item()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 24  # fp32 temporaries of one block of rows: 64 MiB


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``logits`` (N, V) against ``targets`` (N,) over the rows whose
    target is not ``ignore_index``; the logits' gradient replaces the logits."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, chunk_rows):
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        count = valid.sum().clamp_min(1)  # stays on the device
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        picked = torch.empty_like(lse)
        for r0 in range(0, logits.shape[0], chunk_rows):
            rows = slice(r0, r0 + chunk_rows)
            block = logits[rows].float()
            lse[rows] = torch.logsumexp(block, dim=-1)
            picked[rows] = block.gather(1, safe[rows, None]).squeeze(1)
            del block  # before the next block is made, not after
        ctx.save_for_backward(logits, safe, valid, lse, count)
        ctx.chunk_rows = chunk_rows
        return torch.where(valid, lse - picked, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        if getattr(ctx, "logits_overwritten", False):
            raise RuntimeError("backward ran twice through forge_hf's cross-entropy (retain_graph=True?), whose "
                               "first backward wrote the gradient over the logits: use "
                               "torch.nn.functional.cross_entropy to differentiate the loss more than once")
        ctx.logits_overwritten = True
        logits, safe, valid, lse, count = ctx.saved_tensors
        scale = torch.where(valid, grad / count, 0.0)
        for r0 in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(r0, r0 + ctx.chunk_rows)
            # in place: one fp32 block alive, not three (0.12 GiB at a Llama-3 step's peak,
            # which falls here, with every activation still saved)
            block = logits[rows].float().sub_(lse[rows, None]).exp_()  # softmax
            block.scatter_add_(1, safe[rows, None], torch.full_like(block[:, :1], -1.0))
            block *= scale[rows, None]
            logits[rows] = block
            del block
        return logits, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets, ignore_index=...)`` (mean) for 2-D logits,
    without the fp32 copy; the logits are overwritten by their gradient in backward."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits of shape {tuple(logits.shape)} and targets of shape {tuple(targets.shape)}: "
                         "expected (tokens, vocabulary) and (tokens,)")
    if not torch.is_grad_enabled() or not logits.requires_grad:
        return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)
    chunk_rows = max(1, CHUNK_ELEMENTS // max(logits.shape[1], 1))
    return ChunkedCrossEntropy.apply(logits, targets, ignore_index, chunk_rows)


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
    logits = model(**inputs).logits
    targets = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[..., 1:]
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device))
