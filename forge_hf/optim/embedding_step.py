"""ForgeOptimizer's step of the ForgeEmbeddings (nn/embedding.py) from their compact rows:
every row of the weight is stepped, each chunk of rows from a dense gradient of that chunk
alone, which the compact rows are copied into (zero on the rows the batch did not touch).

Why chunks of the existing rule pass, not a kernel reading the gradient through a row map:
the pass each chunk takes is the one the ordinary path takes over the whole dense gradient
(the Triton kernel's tiles, or ``reference_rule_rows``), with the same constants, salt and
element indices (a chunk's first row goes in its arguments, as an FSDP2 shard's does), so
the step is bit for bit the dense one, with no second copy of the rule's arithmetic to keep
in step. Chunks are whole 64-row tiles, so the kernel's tiles and its skipping of a
non-finite tile are the dense path's too.

States: in the layer precision, 8-bit and 4-bit included (the ForgeState is marked a
row-major weight's, ``transposed=False``), as a fused layer's weight on the ordinary path
keeps them: codes along each row in blocks, so a chunk of whole rows holds whole blocks. The
kernel takes a chunk's codes as a view and its metadata staged (core/row_slots.py).

Memory: the compact rows (at most one row a token of the step, in the weight's dtype, and
an int64 id each) and one chunk buffer of (rows + 1) x hidden in the weight's dtype,
about ``CHUNK`` elements, reused by every chunk and step (with codes, a chunk's metadata
a slot too: at most 1/16 of the chunk's elements in bytes); the reference backend adds
the chunk in fp32, as the dense path does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.codecs import QuantisedSlot, slot_codec
from ..core.row_slots import RowSlots, Staging
from ..core.state import slots_key
from ..kernels import ARGS_LEN, ROW_STRIDE, BoundLaunch, next_launch_args, reference_rule_rows
from ..nn.compact_rows import add_into_dense, chunk_gradient
from ..nn.embedding import ForgeEmbedding
from .embedding_patch import compact_precision

TILE_ROWS = 64  # the Triton kernel's tile height (fused_update.default_config)


def embedding_off_reason(weight: torch.Tensor) -> str | None:
    """Why a ForgeEmbedding's weight cannot be stepped from its compact rows here, or None."""
    if isinstance(weight, DTensor):
        return ("its weight is a DTensor (FSDP2 or tensor parallel): each rank's compact rows are not "
                "gathered over the ranks yet, so the sharded weight gets its dense gradient")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ("several processes (DDP or forge's data parallelism): each rank's compact rows are not "
                "gathered over the ranks yet, so the weight gets its dense gradient, averaged as usual")
    return None


class EmbeddingSteps:
    """The ForgeEmbeddings of one ForgeOptimizer's model, by weight."""

    CHUNK = 1 << 24  # elements a chunk: as ForgeOptimizer.CHUNK bounds the dense path's temporaries

    def __init__(self, model: nn.Module, owner, mode: str, rule, stochastic: bool, kernel: bool):
        self.rule, self.stochastic, self.kernel = rule, stochastic, kernel
        self.layers: dict[torch.Tensor, ForgeEmbedding] = {}
        for module in model.modules():
            if not isinstance(module, ForgeEmbedding) or module.forge_off_reason is not None:
                continue
            reason = embedding_off_reason(module.weight)
            if reason is not None:
                if mode == "true":
                    raise ValueError(f"fuse_embedding=true but {module.forge_name} cannot be stepped from its "
                                     f"compact rows: {reason}; use fuse_embedding=auto or false")
                module.forge_off(reason)
                continue
            module.forge_take(owner)
            self.layers[module.weight] = module
            state = owner.state.get(module.weight)
            if state is not None and slot_codec(compact_precision(state.precision), True) is not None:
                # a (vocab, hidden) weight stepped row-major: its codes in the layer precision, as
                # a fused layer's weight keeps them (ForgeState.stored_precision), unfactored.
                # 16-bit and fp32 states stay the ordinary path's, whose checkpoints they share.
                state.transposed = False
                state.precision = compact_precision(state.precision)
        self._buffers: dict[tuple, torch.Tensor] = {}  # (device, dtype, hidden) -> the chunk buffer
        self._staging = Staging()  # a chunk's 8-bit metadata, in the kernel's layout
        self._launches: dict[tuple, tuple] = {}  # (weight, first row) -> (its layout, BoundLaunch, RowSlots)
        self._args: dict[torch.Tensor, torch.Tensor] = {}  # weight -> its chunks' argument rows

    def pending(self, param_groups):
        """(group, weight) of every embedding holding rows, in param_groups' order."""
        for group in param_groups:
            for p in group["params"]:
                layer = self.layers.get(p)
                if layer is not None and layer.forge_rows is not None:
                    yield group, p

    def add_to_dense(self) -> None:
        """A weight that also got a dense gradient (read outside the module, a tied head): its
        rows go into it, and the ordinary path steps the sum."""
        for p, layer in self.layers.items():
            if layer.forge_rows is not None and p.grad is not None:
                add_into_dense(layer.forge_rows, p.grad)
                layer.forge_rows = None

    def squared_norm(self, device) -> torch.Tensor:
        """The squared norm of the held compact rows (the dense gradients' alike: zero elsewhere)."""
        sq = torch.zeros((), device=device)
        for layer in self.layers.values():
            if layer.forge_rows is not None:
                sq += torch.linalg.vector_norm(layer.forge_rows.rows, dtype=torch.float32).square().to(device)
        return sq

    def scale(self, scale: torch.Tensor) -> None:
        """Clip: each row times ``scale``, as ``grad.mul_(scale)``."""
        for layer in self.layers.values():
            if layer.forge_rows is not None:
                layer.forge_rows.rows.mul_(scale.to(layer.forge_rows.rows.device))

    def clear(self) -> None:
        for layer in self.layers.values():
            layer.forge_rows = None

    def snapshot(self) -> dict:
        return {layer: layer.forge_rows for layer in self.layers.values()}

    def restore(self, snapshot: dict) -> None:
        for layer, rows in snapshot.items():
            layer.forge_rows = rows

    def chunk_rows(self, hidden: int) -> int:
        return max(TILE_ROWS, self.CHUNK // max(hidden, 1) // TILE_ROWS * TILE_ROWS)

    def step(self, p: torch.Tensor, group: dict, state, salt: int,
             stats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One rule step of every row of ``p`` from its layer's compact rows, which are then
        let go: as ForgeOptimizer._step_tensor on the dense gradient, with the same result."""
        layer = self.layers[p]
        held, layer.forge_rows = layer.forge_rows, None
        state.allocate(p, group)
        slots = state.kernel_slots()
        n, hidden = p.shape
        chunk = self.chunk_rows(hidden)
        key = (p.device, held.rows.dtype, hidden)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < min(chunk, n) + 1:
            buffer = self._buffers[key] = held.rows.new_empty(min(chunk, n) + 1, hidden)
        starts = range(0, n, chunk)
        if self.kernel:
            given = stats is not None
            if not given:
                stats = torch.zeros(2, dtype=torch.float32, device=p.device)
            args = self._chunk_args(p, next_launch_args(self.rule, group, state, salt, p.device), starts)
            for i, r0 in enumerate(starts):
                m = min(chunk, n - r0)
                g = chunk_gradient(held, r0, buffer[:m + 1])
                launch, rows = self._launch_for(p, r0, m, slots)
                rows.load()
                launch(g, g, args[i, :ARGS_LEN], stats)
                rows.store()
            return None if given else (stats[0], stats[1])
        consts = torch.tensor(self.rule.prepare(group, state.host), dtype=torch.float32).to(p.device).unbind()
        ok = torch.isfinite(held.rows).all()  # the dense gradient's test: it is zero elsewhere
        if any(isinstance(s, QuantisedSlot) for s in slots) and not ok:
            zero = torch.zeros((), device=p.device)  # codes cannot be masked: skipped whole, as the dense path
            return zero, zero + 1
        sq = torch.zeros((), device=p.device)
        for r0 in starts:
            m = min(chunk, n - r0)
            g = chunk_gradient(held, r0, buffer[:m + 1]).float()
            sq += reference_rule_rows(self.rule.name, p, g, slots, slice(r0, r0 + m), consts, ok, salt,
                                      state.step, self.stochastic)
        return torch.where(ok, sq, 0.0), (~ok).float()

    def _chunk_args(self, p: torch.Tensor, args: torch.Tensor, starts: range) -> torch.Tensor:
        """One argument row a chunk: this step's words, each with its chunk's first row. The
        rows are 64 bytes apart, as the step rows are (Triton compiles per alignment)."""
        table = self._args.get(p)
        if table is None or table.shape[0] != len(starts) or table.device != args.device:
            table = self._args[p] = torch.zeros(len(starts), ROW_STRIDE, dtype=torch.int32, device=args.device)
            table[:, ARGS_LEN - 1] = torch.tensor(list(starts), dtype=torch.int32)
        table[:, :ARGS_LEN - 1].copy_(args[:ARGS_LEN - 1].expand(len(starts), -1))  # device to device
        return table

    def _launch_for(self, p, r0: int, m: int, slots) -> tuple[BoundLaunch, RowSlots]:
        """The rule pass bound to rows [r0, r0 + m) of ``p`` and its slots, and those rows of
        the slots, made again when the weight or a slot moved (a load, an allocation, ``model.to``)."""
        key = (p.data_ptr(), tuple(p.shape), p.dtype, *slots_key(slots))
        bound = self._launches.get((p, r0))
        if bound is None or bound[0] != key:
            rows = RowSlots(slots, slice(r0, r0 + m), p.shape[1], self._staging)
            launch = BoundLaunch(p.detach()[r0:r0 + m], rows.slots, self.rule.name, self.stochastic, grad_given=True)
            bound = self._launches[(p, r0)] = (key, launch, rows)
        return bound[1], bound[2]
