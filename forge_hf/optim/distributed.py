"""Exact FORGE under data parallelism (the FORGE paper, §4).

Each fused layer all-gathers its saved input and output gradient over the ranks in backward
instead of reducing a weight gradient, and steps with the full gradient:
``mode="replicated"`` on every rank, or ``mode="sharded"`` (default) each rank its band of
rows and their states, the updated rows all-gathered. Non-fused parameters keep DDP's
all-reduce (``enable_data_parallel`` before wrapping in DDP). The design:
docs/architecture.md, "Data parallelism".
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..core.config import DATA_PARALLEL_MODES, did_you_mean
from ..nn.linear import FusedWeightMixin


def padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (all-gathers need equal pieces); ``t``
    itself when it already has them and is contiguous."""
    if t.shape[0] == rows and t.is_contiguous():
        return t
    padded = t.new_zeros((rows, *t.shape[1:]))
    padded[: t.shape[0]] = t
    return padded


class TokenCounts:
    """Every rank's token count of each fused forward call, exchanged in one collective
    when a backward first needs one, not one collective per call: a forward then makes no
    collective at all, and backward waits for the GPU once per exchange.

    Shared by the fused layers of a model (enable_data_parallel). Like every collective
    here it needs the ranks to make the same fused calls in the same order, so their
    queues of announced calls have equal lengths; a call announced again (a checkpointed
    segment recomputed in backward) is exchanged again."""

    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.pending: list[tuple[TokenGather, int]] = []  # announced, not yet exchanged
        self.is_frozen = False

    @contextlib.contextmanager
    def frozen(self):
        """Inside: every call reuses the counts its layer last exchanged, with no collective
        and no read on the host - what a CUDA graph capture needs. Valid when every rank's
        batches keep their shapes (GraphedStep checks each rank's own against its capture):
        the counts then cannot change. A call with another local count raises."""
        self.is_frozen = True
        try:
            yield
        finally:
            self.is_frozen = False

    def announce(self, owner: TokenGather, t_local: int) -> None:
        if self.is_frozen:
            owner.frozen_counts(t_local)
            return
        owner.counted = None
        self.pending.append((owner, t_local))

    def exchange(self, device: torch.device) -> None:
        """Every rank's counts of the pending calls, handed to their owners. The queues'
        lengths go first: ranks that made different fused calls get an error, not a hang."""
        calls, self.pending = self.pending, []
        lengths = self._all_gather(torch.tensor([len(calls)]), device)
        if len(set(lengths)) > 1:
            raise RuntimeError(
                f"data-parallel ranks made different numbers of fused forward calls since the last "
                f"backward (per rank: {lengths}): every rank must run the same fused layers in the same "
                "order; exclude data-dependent layers (e.g. routed experts) from patch_model")
        counts = self._all_gather(torch.tensor([t for _, t in calls]), device)
        calls[0][0].bytes_sent += (self.world - 1) * 8  # the queue's length
        for i, (owner, t_local) in enumerate(calls):
            owner.counted = (t_local, counts[i::len(calls)])
            owner.bytes_sent += (self.world - 1) * 8

    def _all_gather(self, mine: torch.Tensor, device: torch.device) -> list[int]:
        """Every rank's int64 values, rank after rank, on the host (a wait for the GPU)."""
        mine = mine.to(device=device, dtype=torch.int64, non_blocking=True)
        every = torch.empty(self.world * mine.numel(), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        return every.tolist()


class TokenGather:
    """All-gathers (T_r, C) tensors along the token axis, ranks in order, any T_r."""

    def __init__(self, group=None, counts: TokenCounts | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.counts = TokenCounts(group) if counts is None else counts
        self.bytes_sent = 0  # what this rank puts on the wire (ring all-gather: world - 1 chunks)
        self.counted = None  # (local count, every rank's count) of the last exchanged call

    def announce(self, t_local: int) -> None:
        """Queue this forward call's token count for the next exchange (no collective)."""
        if self.world > 1:
            self.counts.announce(self, t_local)

    def frozen_counts(self, t_local: int) -> list[int]:
        """Every rank's count of this call as last exchanged (TokenCounts.frozen)."""
        if self.counted is None or self.counted[0] != t_local:
            before = "none" if self.counted is None else f"{self.counted[0]} tokens"
            raise RuntimeError(
                f"a fused layer saw {t_local} tokens while the token counts are frozen for a CUDA graph "
                f"capture; its last exchanged count was {before}: run the eager warm-up steps with "
                "batches of the captured shape (every rank the same shapes at every step)")
        return self.counted[1]

    def _counts(self, t_local: int, device: torch.device) -> list[int]:
        if self.counts.is_frozen:
            return self.frozen_counts(t_local)
        if self.counted is None or self.counted[0] != t_local:
            if not any(owner is self for owner, _ in self.counts.pending):
                # not announced in forward: announce now (every rank takes this branch: all
                # ran the same forward calls, and a call's backward sees its forward's tokens)
                self.counts.announce(self, t_local)
            self.counts.exchange(device)
        return self.counted[1]

    def gather(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's rows of each (T_r, C_i) tensor. Tensors of one dtype travel packed
        side by side as one (T, sum C_i) tensor: one collective, so one meeting of the
        ranks, per call instead of one per tensor; the results are column views of it."""
        if self.world == 1:
            return list(tensors)
        t_local = tensors[0].shape[0]
        counts = self._counts(t_local, tensors[0].device)
        longest = max(counts)
        if len({t.dtype for t in tensors}) == 1:
            widths = [t.shape[1] for t in tensors]
            packed = self._all_gather(padded_rows(torch.cat(tensors, dim=1), longest), counts, longest)
            return list(packed.split(widths, dim=1))
        return [self._all_gather(padded_rows(t, longest), counts, longest) for t in tensors]

    def _all_gather(self, padded: torch.Tensor, counts: list[int], longest: int) -> torch.Tensor:
        buf = padded.new_empty((self.world * longest, padded.shape[1]))
        dist.all_gather_into_tensor(buf, padded, group=self.group)
        self.bytes_sent += (self.world - 1) * padded.numel() * padded.element_size()
        if all(c == longest for c in counts):
            return buf
        keep = torch.cat([torch.arange(r * longest, r * longest + c, device=buf.device)
                          for r, c in enumerate(counts)])
        return buf.index_select(0, keep)


def average_gradients(model: torch.nn.Module, group=None) -> None:
    """Average every gradient the model holds over the group's ranks, in place: the
    non-fused parameters' share of a data-parallel step (fused weights never hold one).
    DDP's reducer does this inside backward; a captured step (GraphedStep) calls this
    between backward and the optimizer instead. Like DDP, divides before it sums."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(world)
            dist.all_reduce(p.grad, group=group)


def broadcast_parameters(model: torch.nn.Module, group=None) -> None:
    """Every rank takes the group's first rank's parameters and buffers, as DDP's
    constructor does: data-parallel ranks must start from the same weights."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def row_band(n_rows: int, block_n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) owned by ``rank``: whole groups of ``block_n`` rows, balanced."""
    tiles = -(-n_rows // block_n)
    per_rank = -(-tiles // world)
    start = min(rank * per_rank * block_n, n_rows)
    stop = min(start + per_rank * block_n, n_rows)
    return start, stop


class TokenExchange:
    """The token half of a fused layer's data-parallel seam (nn/linear.DataParallelSeam): its
    x and dy gathered over the ranks by ``self.gather``, the output gradient divided by the
    world size, as DDP and FSDP2 average the other gradients."""

    gather: TokenGather
    world: int

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has put on the wire for this layer."""
        return self.gather.bytes_sent

    def count_sent(self, n_bytes: int) -> None:
        """Bytes this layer sent besides its tokens and rows (a factored moment's column sums)."""
        self.gather.bytes_sent += n_bytes

    def announce_tokens(self, t_local: int) -> None:
        self.gather.announce(t_local)

    def gather_tokens(self, x2, dy2):
        if self.world == 1:
            return x2, dy2
        x_all, dy_all = self.gather.gather(x2, dy2)
        return x_all, dy_all / self.world


class DataParallelFusion(TokenExchange):
    """The data-parallel context of one fused layer (``layer.forge_dp``: nn/linear.DataParallelSeam)."""

    # Bands are whole multiples of 8 rows: fine enough to balance the states of small
    # layers; a band needs no alignment to the kernel's tiles (a slice is launched as is).
    # ``row_group``: the process group (same ranks) that carries the updated rows. A
    # communicator runs its collectives in order, so on ``group`` itself the next layer's
    # token gather, which its step waits for, would queue behind this layer's rows.
    def __init__(self, mode: str = "sharded", group=None, block_n: int = 8, row_group=None,
                 counts: TokenCounts | None = None):
        if mode not in DATA_PARALLEL_MODES:
            raise ValueError(f"unknown data-parallel mode={mode!r}: choose one of {list(DATA_PARALLEL_MODES)}"
                             f"{did_you_mean(mode, DATA_PARALLEL_MODES)}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "forge data parallelism needs an initialised torch.distributed process group: "
                "launch with torchrun or accelerate launch, or call torch.distributed.init_process_group first"
            )
        self.mode = mode
        self.gather = TokenGather(group, counts)
        self.group = group
        self.row_group = group if row_group is None else row_group
        self.world, self.rank = self.gather.world, self.gather.rank
        self.block_n = block_n
        self.pending = None  # the async all-gather of updated rows, waited on before next read

    def rows(self, n_rows: int) -> tuple[int, int]:
        if self.mode == "replicated":
            return 0, n_rows
        return row_band(n_rows, self.block_n, self.world, self.rank)


    def _bands(self, n_rows: int) -> list[tuple[int, int]]:
        return [row_band(n_rows, self.block_n, self.world, r) for r in range(self.world)]

    def _start_band_gather(self, mine: torch.Tensor, n_rows: int):
        """All-gather every rank's band (``mine``: this rank's rows, rows first), each
        padded to the longest band, on the row group. Returns (work, buffer, bands, longest)."""
        bands = self._bands(n_rows)
        longest = max(b - a for a, b in bands)
        padded = padded_rows(mine, longest)
        buf = mine.new_empty((self.world * longest, *mine.shape[1:]))
        work = dist.all_gather_into_tensor(buf, padded, group=self.row_group, async_op=True)
        self.gather.bytes_sent += (self.world - 1) * padded.numel() * padded.element_size()
        return work, buf, bands, longest

    @staticmethod
    def _band(buf: torch.Tensor, r: int, longest: int, band: tuple[int, int]) -> torch.Tensor:
        return buf[r * longest: r * longest + (band[1] - band[0])]

    def gather_rows(self, t: torch.Tensor, n_rows: int) -> torch.Tensor:
        """Every rank's band of a row-sharded tensor (rows first), as the whole (n_rows, ...)."""
        work, buf, bands, longest = self._start_band_gather(t, n_rows)
        work.wait()
        return torch.cat([self._band(buf, r, longest, band) for r, band in enumerate(bands)])

    def shard_rows(self, t: torch.Tensor, n_rows: int) -> torch.Tensor:
        start, stop = self.rows(n_rows)
        return t[start:stop].clone()

    def share_rows(self, weight_view: torch.Tensor) -> None:
        """Start the all-gather of every rank's updated rows into ``weight_view`` (N, K)."""
        if self.mode == "replicated" or self.world == 1:
            return
        n_rows = weight_view.shape[0]
        start, stop = self.rows(n_rows)
        if n_rows == self.world * (stop - start) and weight_view.is_contiguous():
            # equal bands, in rank order: gather in place, straight into the weight
            work = dist.all_gather_into_tensor(weight_view, weight_view[start:stop], group=self.row_group,
                                               async_op=True)
            self.gather.bytes_sent += (self.world - 1) * weight_view[start:stop].nbytes
            self.pending = (work, None, None, None, weight_view)
            return
        self.pending = (*self._start_band_gather(weight_view[start:stop], n_rows), weight_view)

    def wait(self) -> None:
        """Complete the pending row gather (before the weight is read again)."""
        if self.pending is None:
            return
        work, buf, bands, longest, weight_view = self.pending
        self.pending = None
        work.wait()
        if buf is None:  # gathered in place
            return
        with torch.no_grad():
            for r, (a, b) in enumerate(bands):
                if r != self.rank and b > a:
                    weight_view[a:b].copy_(self._band(buf, r, longest, (a, b)))


def enable_data_parallel(model: torch.nn.Module, mode: str = "sharded", group=None) -> list[str]:
    """Give every fused layer of ``model`` a data-parallel context and keep its weight out
    of DDP's gradient reducer. Call after patch_model and before wrapping in DDP (or
    accelerate's prepare). Returns the fused weights' parameter names."""
    names = []
    fused = [(n, m) for n, m in model.named_modules() if isinstance(m, FusedWeightMixin)]
    # one communicator more for the updated rows (DataParallelFusion); every rank calls this
    row_group = None
    if fused and mode == "sharded" and dist.is_initialized() and dist.get_world_size(group) > 1:
        row_group = (dist.new_group() if group is None else
                     dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True))
    counts = TokenCounts(group) if fused and dist.is_initialized() else None  # one exchange per backward
    for module_name, module in fused:
        # a transposed (Conv1D) weight's rows are strided columns: replicate it
        layer_mode = "replicated" if module.forge_transposed else mode
        module.forge_dp = DataParallelFusion(layer_mode, group, row_group=row_group, counts=counts)
        names.append(f"{module_name}.weight" if module_name else "weight")
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no fused layers: call forge_hf.patch_model(model, ...) before "
            "enable_data_parallel"
        )
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    model._ddp_params_and_buffers_to_ignore = sorted(ignored | set(names))
    return names
