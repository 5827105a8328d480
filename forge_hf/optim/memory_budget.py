"""What a patched model keeps on its device between steps, predicted from its shapes: the
bytes, and bytes a parameter, of the weights, the optimizer states, the gradients that still
exist, and the most the fused layers hold under gradient accumulation or clipping.

States are allocated on the meta device by the ForgeState the optimizer will use, so each
format's codes and scales count exactly as they will be stored. Activations, the loss's
temporaries and the allocator's workspace depend on the batch and are not counted: the
difference between this and a measured peak is theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.config import ForgeConfig
from ..core.state import ForgeState
from ..nn.held_gradient import trainer_bytes
from ..nn.linear import FusedWeightMixin
from .embedding_patch import compact_precision


@dataclass(frozen=True)
class BudgetRow:
    part: str
    params: int
    bytes: int
    note: str = ""

    @property
    def per_param(self) -> float:
        return self.bytes / self.params if self.params else 0.0


def _state_bytes(config: ForgeConfig, shape: tuple, dtype: torch.dtype, precision: str,
                 transposed: bool | None) -> int:
    state = ForgeState(config.rule, precision, transposed=transposed)
    state.allocate(torch.empty(shape, dtype=dtype, device="meta"), config.group())
    return state.nbytes()


def _local(p: torch.Tensor) -> torch.Tensor:
    """This process's piece of a sharded (DTensor) parameter: what its device holds."""
    return p.to_local() if isinstance(p, DTensor) else p


def _bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def memory_budget(model: nn.Module, config: ForgeConfig, compact_embeddings: set[str]) -> list[BudgetRow]:
    """The rows for ``model`` as patch_model left it, on this process (a sharded parameter: its
    piece); ``compact_embeddings``: the names of the input embeddings stepped from compact rows
    (fuse_embedding), which keep no dense gradient."""
    layers = [m for m in model.modules() if isinstance(m, FusedWeightMixin)]
    fused_ids = {id(m.weight) for m in layers}
    fused = [(_local(m.weight), m) for m in layers]
    embedding_ids = {id(m.weight) for name, m in model.named_modules() if name in compact_embeddings}
    params = {id(p): p for p in model.parameters()}  # a tied Parameter once
    every = [_local(p) for p in params.values()]
    others = [(i, _local(p)) for i, p in params.items() if p.requires_grad and i not in fused_ids]
    embeddings = [p for i, p in others if i in embedding_ids]
    ordinary = [p for i, p in others if i not in embedding_ids]
    fused_params = sum(w.numel() for w, _ in fused)
    rows = [
        BudgetRow("weights", sum(p.numel() for p in every), sum(_bytes(p) for p in every),
                  "every parameter, frozen ones too"),
        BudgetRow("states, fused layers", fused_params,
                  sum(_state_bytes(config, tuple(w.shape), w.dtype, m.forge_state.precision, m.forge_transposed)
                      for w, m in fused),
                  ", ".join(sorted({m.forge_state.precision for _, m in fused}))),
    ]
    if embeddings:
        # in the layer precision: stepped row-major, as embedding_step.py marks its ForgeState
        rows.append(BudgetRow("states, embedding", sum(p.numel() for p in embeddings),
                              sum(_state_bytes(config, tuple(p.shape), p.dtype,
                                               compact_precision(config.state_precision_for(p.dtype)), False)
                                  for p in embeddings),
                              "its gradient: the rows a batch touches, no dense gradient"))
    rows += [
        BudgetRow("states, other parameters", sum(p.numel() for p in ordinary),
                  sum(_state_bytes(config, tuple(p.shape), p.dtype, config.state_precision_for(p.dtype), None)
                      for p in ordinary), "16-bit states under an 8- or 4-bit precision"),
        BudgetRow("gradients, other parameters", sum(p.numel() for p in ordinary), sum(_bytes(p) for p in ordinary),
                  "the fused layers' weight gradients never exist"),
    ]
    if config.accumulation == "stash":
        held, note = 0, "grows with the tokens held: the stash keeps every micro-batch's rows"
    elif config.accumulation == "buffer":
        held, note = 4 * fused_params, "an fp32 buffer a fused layer"
    else:
        held = sum(trainer_bytes(w.shape[1], w.shape[0], w.dtype) for w, _ in fused)
        note = "at most the Trainer's gradient for each fused layer"
    rows.append(BudgetRow("held, accumulation or clipping", fused_params, held, note))
    return rows


def budget_table(rows: list[BudgetRow]) -> list[tuple[str, ...]]:
    """The rows as text cells: part, parameters, GiB, bytes a parameter, note."""
    return [(r.part, f"{r.params:,}", f"{r.bytes / 2**30:.2f}", f"{r.per_param:.3g}", r.note) for r in rows]
