"""patch_model's part for the input embedding (the ``fuse_embedding`` option): which
nn.Embedding becomes a ForgeEmbedding (nn/embedding.py), which stays plain and why, and the
report's lines about it.

The candidate is the model's input embedding (``get_input_embeddings()``), or, for a module
without one, each nn.Embedding in it. It is left plain, and ``fuse_embedding=true`` refuses,
where the compact step would not be the dense one or would save nothing: a weight shared with
another module (tied input and output embeddings: the output head's gradient fills every
row, so it is dense anyway and the ordinary path steps the tied weight once), a subclass with
its own forward (Gemma's scaled embedding), ``max_norm`` (the lookup writes the weight),
``scale_grad_by_freq``, ``sparse=True``, a weight neither float32 nor bfloat16, a DTensor.
Several processes are checked when a ForgeOptimizer takes the layer (optim/embedding_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from ..core.config import ForgeConfig
from ..core.state import ForgeState
from ..nn.embedding import ForgeEmbedding

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class EmbeddingEntry:
    """An input embedding as patch_model left it: ``reason`` None when it is a ForgeEmbedding."""

    name: str
    shape: tuple[int, int]
    gradient_bytes: int  # its dense gradient, which a ForgeEmbedding never allocates
    reason: str | None
    precisions: tuple[str, str]  # its states' precision (compact step, ordinary path)

    def reason_now(self, model: nn.Module | None) -> str | None:
        """Why it takes the ordinary path now, or None: a ForgeOptimizer may have put it there
        for good since patch_model (several processes)."""
        module = dict(model.named_modules()).get(self.name) if model is not None else None
        if self.reason is None and isinstance(module, ForgeEmbedding):
            return module.forge_off_reason
        return self.reason


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    get = getattr(model, "get_input_embeddings", None)
    if get is None:
        return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    try:
        module = get()
    except NotImplementedError:
        return []
    return [(names[id(module)], module)] if isinstance(module, nn.Embedding) and id(module) in names else []


def _skip_reason(name: str, module: nn.Embedding, owners: dict) -> str | None:
    w = module.weight
    others = [n for n, m in owners[id(w)] if m is not module]
    if others:
        return (f"its weight is also {', '.join(others)} (tied input and output embeddings): that head's "
                "gradient fills every row, so a compact gradient saves nothing")
    if type(module) not in (nn.Embedding, ForgeEmbedding):
        return f"{type(module).__name__} is a subclass with a forward of its own"
    if "forward" in module.__dict__:
        return "forward is replaced on the instance (an accelerate/offload hook?)"
    if module.max_norm is not None:
        return "max_norm renormalises the looked-up rows in place"
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq scales the gradient by the batch's counts"
    if module.sparse:
        return "sparse=True: it has a sparse gradient already"
    if parametrize.is_parametrized(module):
        return "the weight is parametrized"
    if isinstance(w, DTensor):
        return "its weight is a DTensor (tensor parallel): the compact rows would be of the whole vocabulary"
    if w.dtype not in WEIGHT_DTYPES:
        return f"weight dtype {w.dtype}: the step needs float32 or bfloat16 weights"
    return None


def plan_embeddings(model: nn.Module, config: ForgeConfig, owners: dict) -> list[tuple[str, nn.Module, str | None]]:
    """(name, module, why it stays plain or None) of each trainable candidate; raises, before
    anything changes, where ``fuse_embedding=true`` cannot be met."""
    mode = config.fuse_embedding
    candidates = [(n, m) for n, m in _candidates(model) if m.weight.requires_grad]
    if mode == "true" and not candidates:
        raise ValueError(f"fuse_embedding=true but {type(model).__name__} has no trainable input embedding "
                         "(nn.Embedding): use fuse_embedding=auto or false")
    plan = []
    for name, module in candidates:
        reason = "fuse_embedding=false" if mode == "false" else _skip_reason(name, module, owners)
        if mode == "true" and reason is not None:
            raise ValueError(f"fuse_embedding=true but {name} cannot be stepped from its compact rows: {reason}; "
                             "use fuse_embedding=auto (it then takes the ordinary path) or false")
        plan.append((name, module, reason))
    return plan


# The compact rows are stepped a chunk of rows a launch: a factored second moment's sums span
# every row of the matrix, so the embedding keeps the same precision's codes unfactored.
UNFACTORED = {"log4_factored": "log4"}


def compact_precision(precision: str) -> str:
    """The precision an embedding stepped from its compact rows keeps under ``precision``."""
    return UNFACTORED.get(precision, precision)


def state_precisions(config: ForgeConfig, dtype: torch.dtype) -> tuple[str, str]:
    """The states' precision of an embedding of ``dtype`` stepped from its compact rows (the
    layer precision, embedding_step.py) and on the ordinary path (16-bit under 8-bit), as
    ForgeState stores them."""
    precision = config.state_precision_for(dtype)
    return (ForgeState(config.rule, compact_precision(precision), False).stored_precision,
            ForgeState(config.rule, precision, None).stored_precision)


def apply_embeddings(plan, config: ForgeConfig) -> list[EmbeddingEntry]:
    """Make the plan so: a ForgeEmbedding where it has no reason, a plain nn.Embedding elsewhere."""
    entries = []
    for name, module, reason in plan:
        if reason is None and not isinstance(module, ForgeEmbedding):
            ForgeEmbedding.forge_adopt(module, name)
        elif reason is not None and isinstance(module, ForgeEmbedding):
            module.forge_release()
        w = module.weight
        entries.append(EmbeddingEntry(name, tuple(w.shape), w.numel() * w.element_size(), reason,
                                      state_precisions(config, w.dtype)))
    return entries


def release_embeddings(model: nn.Module) -> list[str]:
    """Every ForgeEmbedding back to a plain nn.Embedding; their names."""
    names = [n for n, m in model.named_modules() if isinstance(m, ForgeEmbedding)]
    for name in names:
        model.get_submodule(name).forge_release()
    return names
