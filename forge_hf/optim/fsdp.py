"""FORGE inside FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2's row shard of a fused weight plays the part of data-parallel ``mode="sharded"``'s
band: backward gathers the layer's tokens across the shard group and steps this rank's rows
and their states in place, so FSDP2 reduce-scatters no gradient for fused weights.
ForgeTrainer runs this under accelerate's FSDP2 (integrations/trainer.py); its sharded
optimizer checkpoints go through save_sharded_optimizer / load_sharded_optimizer below. The
design: docs/architecture.md, "forge inside FSDP2"; usage and costs: docs/fsdp.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..nn.held_buffer import HELD_ADDS
from ..nn.linear import FusedWeightMixin
from .distributed import TokenCounts, TokenExchange, TokenGather
from .tensor_parallel import MeshShards


def chunk_rows(n_rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) that FSDP2 (torch.chunk) gives ``rank`` of ``world``."""
    per_rank = -(-n_rows // world)
    start = min(rank * per_rank, n_rows)
    return start, min(start + per_rank, n_rows)


class RowShards:
    """A tensor's rows split over ``group`` as FSDP2 splits them: which rows this rank holds,
    and the whole tensor back from every rank's rows (optimizer checkpoints hold whole states,
    so they load into any world size)."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    @property
    def norm_groups(self) -> tuple:
        """The groups the rows' squared sums add over (tensor_parallel.MeshShards' interface)."""
        return (self.group,)

    def rows(self, n_rows: int) -> tuple[int, int]:
        return chunk_rows(n_rows, self.world, self.rank)

    def gather_rows(self, t: torch.Tensor, n_rows: int) -> torch.Tensor:
        """The whole (n_rows, ...) tensor from every rank's rows ``t``: each rank's rows are
        padded to a full chunk, and the chunks lie in rank order, so the first n_rows rows of
        the gathered buffer are the whole tensor."""
        per_rank = -(-n_rows // self.world)
        padded = t.new_zeros((per_rank, *t.shape[1:]))
        padded[: t.shape[0]] = t
        buf = t.new_empty((self.world * per_rank, *t.shape[1:]))
        dist.all_gather_into_tensor(buf, padded, group=self.group)
        return buf[:n_rows]

    def shard_rows(self, t: torch.Tensor, n_rows: int) -> torch.Tensor:
        start, stop = self.rows(n_rows)
        return t[start:stop].clone()


def param_shards(p: torch.Tensor) -> RowShards | MeshShards | None:
    """How a DTensor parameter is split: by rows on a 1-d mesh (FSDP2's shards, a colwise
    tensor-parallel piece), or any other way (tensor_parallel.MeshShards); None for a whole tensor."""
    if not isinstance(p, DTensor):
        return None
    if p.device_mesh.ndim != 1 or p.placements != (Shard(0),):
        return MeshShards(p)
    return RowShards(p.device_mesh.get_group())


class FsdpFusion(TokenExchange, RowShards):
    """The FSDP2 context of one fused layer (``layer.forge_dp``, nn/linear.ShardedWeightSeam)."""

    mode = "fsdp"

    def __init__(self, layer: FusedWeightMixin, fsdp_param, param_group, counts: TokenCounts):
        group = param_group.mesh_info.shard_process_group
        super().__init__(group)
        self.name = layer.forge_name
        self.fsdp_param, self.param_group = fsdp_param, param_group
        self.gather = TokenGather(group, counts)

    def local_shard(self) -> torch.Tensor:
        """This rank's rows of the weight, the sharded parameter's own storage (what FSDP2
        all-gathers at the next forward), to be stepped in place."""
        if not self.param_group.reshard_after_backward:
            raise RuntimeError(
                f"{self.name} is fused but its FSDP2 module keeps the gathered weight after backward "
                "(set_reshard_after_backward(False)), so the next forward would not see this step's update: "
                "leave reshard_after_backward=True (a fused layer accumulates no gradient between steps)")
        return self.fsdp_param.sharded_param.to_local()

    def share_rows(self, weight: torch.Tensor) -> None:
        """Nothing to share: FSDP2 all-gathers the updated shards before the next forward."""

    def wait(self) -> None:
        pass


def _fsdp_params(model: torch.nn.Module) -> dict[tuple[int, str], tuple]:
    """(id(module), parameter name) -> (its FSDPParam, its FSDPParamGroup), for every
    parameter that a ``fully_shard`` call inside ``model`` manages."""
    from torch.distributed.fsdp import FSDPModule

    found = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        param_group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in param_group.fsdp_params if param_group is not None else ():
            info = fsdp_param._module_info
            found[(id(info.module), info.param_name)] = (fsdp_param, param_group)
    return found


def enable_fsdp(model: torch.nn.Module) -> list[str]:
    """Give every fused layer of ``model`` its FSDP2 context. Call after ``fully_shard``
    (on the layers' modules and the root) and before the first forward; ForgeOptimizer
    calls it when it finds fused weights sharded by FSDP2. Returns the fused weights' names."""
    fused = [(n, m) for n, m in model.named_modules() if isinstance(m, FusedWeightMixin)]
    if not fused:
        raise ValueError(
            f"{type(model).__name__} has no fused layers: call forge_hf.patch_model(model, ...) before "
            "fully_shard and enable_fsdp")
    managed = _fsdp_params(model)
    counts: dict[int, TokenCounts] = {}  # one exchange of token counts per backward and shard group
    names = []
    for name, layer in fused:
        entry = managed.get((id(layer), "weight"))
        if entry is None:
            raise ValueError(
                f"fused layer {name} is not sharded by FSDP2: call fully_shard on it or on a module "
                "containing it (and on the root) before enable_fsdp, or exclude it in patch_model")
        fsdp_param, param_group = entry
        mesh_info = param_group.mesh_info
        if getattr(mesh_info, "replicate_mesh_dim", None) is not None:
            raise ValueError(
                f"fused layer {name} is under HSDP (a 2-d mesh, replicated across one dimension): forge "
                "gathers tokens over one shard group only; use fully_shard with a 1-d mesh")
        if fsdp_param.fsdp_placement != Shard(0):
            raise ValueError(
                f"fused layer {name} is sharded {fsdp_param.fsdp_placement} by shard_placement_fn: forge "
                "steps whole rows of the weight; shard fused weights Shard(0) (the default)")
        if fsdp_param.offload_to_cpu:
            raise ValueError(
                f"fused layer {name} has its shard offloaded to the CPU (CPUOffloadPolicy): the fused step "
                "runs on the weight's device; drop offload_policy or exclude the layer in patch_model")
        if layer.forge_transposed:
            raise ValueError(
                f"fused layer {name} stores its weight (in, out) (Conv1D): FSDP2's row shards are then "
                "input features, which forge does not step; exclude it in patch_model(exclude=[...])")
        if layer.forge_dp is not None and not isinstance(layer.forge_dp, FsdpFusion):
            raise ValueError(
                f"fused layer {name} already has forge data parallelism (enable_data_parallel): under "
                "fully_shard forge shards by FSDP2's shards instead; do not call enable_data_parallel")
        group = mesh_info.shard_process_group
        shared = counts.setdefault(id(group), TokenCounts(group))
        layer.forge_dp = FsdpFusion(layer, fsdp_param, param_group, shared)
        names.append(f"{name}.weight" if name else "weight")
    return names


def fsdp_needed(model: torch.nn.Module) -> bool:
    """Whether ``model`` has fused layers whose weights FSDP2 shards and no FSDP2 context yet
    (a DTensor weight outside fully_shard is a tensor-parallel piece: optim/tensor_parallel.py)."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return False
    return any(isinstance(m.weight, DTensor) and not isinstance(m.forge_dp, FsdpFusion)
               for m in model.modules() if isinstance(m, FusedWeightMixin))


# ------------------------------------------------------------ sharded checkpoints
# ForgeOptimizer.state_dict() gathers every rank's rows into whole tensors on every rank: one
# format for any world size, but the whole state in each rank's memory, which FSDP2 exists to
# avoid. These two save and load each rank's own rows through torch.distributed.checkpoint
# (DCP) instead: every state tensor is put in a DTensor placed as its parameter is (Shard(0)
# on the parameter's mesh), so each rank writes and reads its rows only, and DCP reshards a
# checkpoint into another world size. Keys: "state.<i>.<name>" for parameter i of the
# optimizer's param_groups (ForgeOptimizer's own numbering), "param_groups", and the held bf16
# buffers' count of backwards (HELD_ADDS).

_GROUPS = "param_groups"
_NOT_STATES = (_GROUPS, HELD_ADDS)  # the keys that are not a parameter's "state.<i>.<name>"


def _row_dtensor(local: torch.Tensor, p: DTensor, n_rows: int) -> DTensor:
    """``local``, this rank's rows of an (n_rows, ...) state of the FSDP2 parameter ``p``,
    as the whole tensor's DTensor (torch.chunk's uneven layout, as FSDP2 places ``p``); a
    parameter placed otherwise (tensor parallel), placed as ``p``."""
    if p.device_mesh.ndim != 1 or p.placements != (Shard(0),):
        return MeshShards(p).as_dtensor(local)
    shape = torch.Size((n_rows, *local.shape[1:]))
    return DTensor.from_local(local, p.device_mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def save_sharded_optimizer(optimizer, checkpoint_dir) -> None:
    """Save a ForgeOptimizer over an FSDP2 model into ``checkpoint_dir`` with DCP (every rank
    calls): each rank writes its rows of each state; whole states (a parameter FSDP2 does not
    shard: every rank holds the same) once."""
    import torch.distributed.checkpoint as dcp

    groups = torch.optim.Optimizer.state_dict(optimizer)[_GROUPS]  # hyperparameters and parameter indices
    sd = {_GROUPS: tuple(groups), HELD_ADDS: optimizer.held_adds.value()}  # a tuple of dicts: one entry for DCP
    for i, p in enumerate(optimizer.params()):
        state = optimizer.state[p]
        if not state.allocated:
            continue
        whole = state.whole_keys  # a factored moment's column sums: the same on every rank
        for name, value in state.state_dict().items():
            if torch.is_tensor(value) and isinstance(p, DTensor) and name not in whole:
                value = _row_dtensor(value, p, p.shape[0])
            sd[f"state.{i}.{name}"] = value
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(checkpoint_dir)))


def load_sharded_optimizer(optimizer, checkpoint_dir) -> None:
    """Load what ``save_sharded_optimizer`` saved into ``optimizer``, a ForgeOptimizer over the
    same model under FSDP2 in any world size (every rank calls): each rank reads its own rows
    of each state; a parameter without a saved state starts fresh, as in ForgeOptimizer.load_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    params = optimizer.params()
    reader = dcp.FileSystemReader(str(checkpoint_dir))
    # DCP fills a state dict of the right shapes in place: built from what the checkpoint holds
    template = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        index = int(key.split(".")[1]) if key not in _NOT_STATES else -1
        if index >= len(params):
            raise ValueError(f"{checkpoint_dir} holds a state of parameter {index}, but the optimizer has "
                             f"{len(params)} parameters: it was saved for another model")
        if not isinstance(meta, TensorStorageMetadata):
            template[key] = None  # a Python value (step, precision, the param_groups): DCP puts it in
            continue
        p = params[index]
        size, dtype = tuple(meta.size), meta.properties.dtype
        whole = key.split(".", 2)[2] in optimizer.state[p].whole_keys
        if isinstance(p, DTensor) and not whole and isinstance(shards := param_shards(p), MeshShards):
            local = torch.empty(shards.local_shape_of(size), dtype=dtype, device=p.device)
            template[key] = shards.as_dtensor(local)
        elif isinstance(p, DTensor) and not whole:
            start, stop = RowShards(p.device_mesh.get_group()).rows(size[0])
            template[key] = _row_dtensor(torch.empty((stop - start, *size[1:]), dtype=dtype, device=p.device),
                                         p, size[0])
        else:
            template[key] = torch.empty(size, dtype=dtype, device=p.device)
    dcp.load(template, storage_reader=reader)

    saved: dict[int, dict] = {}
    for key, value in template.items():
        if key not in _NOT_STATES:
            _, i, name = key.split(".", 2)
            saved.setdefault(int(i), {})[name] = value.to_local() if isinstance(value, DTensor) else value
    optimizer.load_local_state_dict({"state": saved, _GROUPS: list(template[_GROUPS]),
                                     HELD_ADDS: template.get(HELD_ADDS, 0)})
