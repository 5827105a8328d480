"""A factored second moment (state_precision="log4_factored"): a fused layer's never-negative
state v (N, K) kept as a row vector R (N), a column vector C (K) and their total S, all fp32,
read as v_ij ~ R_i C_j / S (Adafactor's rank-1 estimate; S = sum R = sum C). 4 (N + K + 1)
bytes a vector set instead of N K states: ~0 bytes a parameter.

Tile-local by a one-step lag (docs/architecture.md, "Factored second moment"): at step t each
tile reads the history V_{t-1} from the vectors accumulated through step t-1, the rule forms
v = b2 V_{t-1} + (1 - b2) g**2 elementwise (its own code, unchanged: the current gradient
enters exactly), and the tile adds v's row sums, column sums and total into the vectors of
step t with atomics. Row sums of V_{t-1} are R_{t-1} exactly, so the sums are
R_t = b2 R_{t-1} + (1 - b2) rowsum(g_t**2): the EMA of the squared gradient's row sums, with
no pass of its own. A skipped (non-finite) tile adds its V_{t-1} unchanged.

Three vector sets rotate by the step count t (the kernels' step word, so a CUDA graph's
replay rotates too): set (t - 1) % 3 is read, set t % 3 is summed into (zero at the start of
the step), set (t + 1) % 3 (read at step t - 1, summed into at step t + 1) is cleared by the
tiles of the first tile column (its rows), of the first tile row (its columns) and tile (0, 0)
(the total). No host work a step, no launch of its own.

Row-sharded (data_parallel="sharded", FSDP2): each rank keeps R of its own rows and C, S of
the whole weight. Its launch sums its rows' share into C and S; ``reduce_columns`` then adds
the shares over the ranks (an all-reduce of K + 1 floats a layer and step) before the next
step reads them. Each rank reads R_i C_j / S of one process, the column sums added in another
order (as the kernel's atomics add them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

SETS = 3  # vector sets: read, summed into, cleared


def read_set(step: int) -> int:
    """The set step ``step`` (1-based, the rule's count after prepare) reads."""
    return (step - 1) % SETS


def sum_set(step: int) -> int:
    return step % SETS


def clear_set(step: int) -> int:
    return (step + 1) % SETS


def rank1(rows: torch.Tensor, cols: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """R_i C_j / S (0 where S is 0), the products in the Triton kernel's order."""
    inverse = torch.where(total > 0, 1.0 / total, 0.0)  # 1 / S correctly rounded: a quotient of tensors
    return rows[:, None] * cols[None, :] * inverse


def reduce_factored_columns(slots, step: int, group) -> int:
    """Row-sharded: each factored slot among ``slots`` adds every rank's share of its column sums
    (FactoredSlot.reduce_columns); the bytes this rank sent."""
    return sum(s.reduce_columns(step, group) for s in slots if isinstance(s, FactoredSlot))


def whole_keys(slot_names) -> set[str]:
    """The state_dict keys of factored moments that every rank of a row-sharded layer holds
    whole (column sums and total): not split by rows in checkpoints."""
    return {f"{name}_{part}" for name in slot_names for part in ("col", "total")}


def refuse_sharded(precision: str, name: str, how: str, fix: str) -> None:
    """A factored moment kept whole-row and whole-column: refuse ``how`` (a sharding of
    columns) for fused layer ``name``."""
    if precision == "log4_factored":
        raise ValueError(f"state_precision='log4_factored' keeps whole-row and whole-column sums of fused layer "
                         f"{name}, which {how} splits: {fix}, or use state_precision='log4'")


@dataclass
class FactoredSlot:
    """``vectors`` fp32 (SETS, N + K + 1): each set R (N), C (K), S, in logical (out, in)
    coordinates whatever the parameter's layout."""

    vectors: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def empty(cls, out_features: int, in_features: int, device, fill: float = 0.0,
              whole_rows: int | None = None) -> FactoredSlot:
        """Every element ``fill`` (Adagrad's initial accumulator): set 0, which step 1 reads.
        ``whole_rows``: the whole weight's rows when this slot holds a row shard of it."""
        vectors = torch.zeros(SETS, out_features + in_features + 1, dtype=torch.float32, device=device)
        slot = cls(vectors, out_features, in_features)
        if fill != 0.0:
            rows = out_features if whole_rows is None else whole_rows  # C and S are the whole weight's
            slot.set_vectors(0, torch.full((out_features,), fill * in_features),
                             torch.full((in_features,), fill * rows),
                             torch.tensor(fill * rows * in_features))
        return slot

    def parts(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(R, C, S) of set ``index``, views."""
        n = self.out_features
        v = self.vectors[index]
        return v[:n], v[n:-1], v[-1]

    def set_vectors(self, index: int, rows: torch.Tensor, cols: torch.Tensor, total: torch.Tensor) -> None:
        r, c, s = self.parts(index)
        r.copy_(rows)
        c.copy_(cols)
        s.copy_(total)

    def read(self, step: int, rows=slice(None), cols=slice(None)) -> torch.Tensor:
        """V_{step-1} on (rows, cols): R_i C_j / S, the products in the Triton kernel's order."""
        r, c, s = self.parts(read_set(step))
        return rank1(r[rows], c[cols], s)

    def add(self, step: int, value: torch.Tensor, rows=slice(None), cols=slice(None)) -> None:
        """A tile's new v into step ``step``'s sums: its row sums, column sums and total (the
        sum of its row sums, as the kernel takes it)."""
        r, c, s = self.parts(sum_set(step))
        row_sums = value.sum(1)
        r[rows] += row_sums
        c[cols] += value.sum(0)
        s += row_sums.sum()

    def clear(self, step: int) -> None:
        """The set step ``step + 1`` sums into."""
        self.vectors[clear_set(step)].zero_()

    def carry(self, step: int, sharded: bool = False) -> None:
        """A step skipped whole (a non-finite gradient where codes cannot be masked): the
        moment carries on unchanged into the set the next step reads. ``sharded``: this
        slot's rows are a shard, so C and S take their share only (reduce_columns adds them)."""
        self.clear(step)
        self.vectors[sum_set(step)].copy_(self.vectors[read_set(step)])
        if sharded:
            r, c, s = self.parts(sum_set(step))
            share = r.sum()
            c.mul_(torch.where(s > 0, share / s, 0.0))
            s.copy_(share)

    def reduce_columns(self, step: int, group) -> int:
        """Row-sharded: add every rank's share of step ``step``'s column sums and total (a rank
        with no rows stepped nothing: its share is zero). Returns the bytes a ring all-reduce
        puts on the wire from this rank: 2 (W - 1) chunks of (K + 1) / W."""
        tail = self.vectors[sum_set(step), self.out_features:]  # C then S, contiguous
        if self.out_features == 0:
            tail.zero_()
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("state_precision='log4_factored' on row shards sums its column vectors over the "
                               "ranks at a set picked on the host, which a CUDA graph would replay unchanged: "
                               "train this layer without a graph or use state_precision='log4'")
        dist.all_reduce(tail, group=group)
        world = dist.get_world_size(group)
        return 2 * (world - 1) * -(-tail.numel() // world) * tail.element_size()

    def current(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(R, C, S) after step ``step``: what step ``step + 1`` reads, and a checkpoint keeps."""
        return self.parts(sum_set(step))

    def nbytes(self) -> int:
        return self.vectors.untyped_storage().nbytes()
