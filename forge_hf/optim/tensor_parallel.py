"""FORGE under tensor parallelism: fused layers whose weight is a DTensor sharded by its
output rows (colwise, ``Shard(0)``) or its input columns (rowwise, ``Shard(1)``), as
transformers' ``tp_plan`` and torch's ``parallelize_module`` lay them out.

Each rank's local dY^T X is then the exact gradient of its shard: colwise, the replicated
input and this rank's columns of the output gradient; rowwise, this rank's columns of the
input and the replicated output gradient. So a rank steps its shard, with its states, from
its local tensors: no gradient is formed and the step makes no collective. The layer's forward
computes on the local tensors and returns what F.linear on the DTensors would (a DTensor in,
a DTensor out), so the plan's own input and output redistributions (sequence parallelism's
gathers and reduce-scatters included) stay as they are. A layout whose local product is not
the shard's gradient, a replicated weight above all, is left to the ordinary optimizer
(patch_model's report says why). Usage and costs: docs/parallelism.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ..core.factored import refuse_sharded

# transformers' TensorParallelLayer.install_forward replaces a module's forward by this closure
TRANSFORMERS_TP_FORWARD = "TensorParallelLayer.install_forward.<locals>.tp_forward"


def _shard_dim(placement, ndim: int) -> int | None:
    """The tensor dimension ``placement`` shards (transformers' packed styles use _StridedShard), or None."""
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim % ndim
    return None


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def skip_detail(module) -> str | None:
    """Why a linear with a DTensor weight cannot be stepped from its local shard, or None."""
    w, bias = module.weight, getattr(module, "bias", None)
    where = f"{w.device_mesh.ndim}-d mesh, placed {w.placements}"
    if getattr(module, "forge_transposed", False) or type(module).__name__ == "Conv1D":
        return f"a Conv1D weight (stored (in, out)) sharded on a {where}: forge steps tensor-parallel nn.Linear only"
    if w.device_mesh.ndim != 1:
        return (f"its weight is a DTensor on a {where}: forge steps tensor-parallel shards of a 1-d mesh (for TP "
                "with FSDP2, patch the model after the tensor-parallel plan and before fully_shard)")
    dim = _shard_dim(w.placements[0], 2)
    if dim is None:
        return (f"its weight is a DTensor on a {where}: on each rank dY^T X may be only a partial sum of a replicated "
                "weight's gradient, so the ordinary optimizer steps it (its gradient reduced by DTensor)")
    if bias is not None and isinstance(bias, DTensor):
        want = (w.placements[0] if type(w.placements[0]) is Shard else None) if dim == 0 else Replicate()
        if bias.device_mesh != w.device_mesh or (want is not None and bias.placements != (want,)):
            return f"its bias is placed {bias.placements} against a weight placed {w.placements}"
    forward = module.__dict__.get("forward")
    if forward is not None and not isinstance(forward, TensorParallelForward) and not _is_transformers_tp(forward):
        return "forward is replaced on the instance by something other than transformers' tensor-parallel forward"
    return None


def _is_transformers_tp(forward) -> bool:
    return getattr(forward, "__qualname__", "") == TRANSFORMERS_TP_FORWARD


class TensorParallelWeight:
    """The tensor-parallel layout of a fused layer's weight (``layer.forge_tp``, set by
    ``attach``): its mesh and placement, this rank's piece, and the fused forward on the local
    tensors."""

    def __init__(self, layer):
        w = layer.weight
        self.mesh, self.placements = w.device_mesh, tuple(w.placements)
        self.group = self.mesh.get_group()
        self.norm_groups = (self.group,)  # the shards' squared sums add up over the mesh
        self.rows = _shard_dim(self.placements[0], 2) == 0  # colwise: output rows; else rowwise: input columns
        self.shape = tuple(w.shape)
        local_shape, offset = compute_local_shape_and_global_offset(w.shape, self.mesh, self.placements)
        # stochastic rounding's element index: a block of whole rows keeps its rows' place in
        # the weight (the unsharded kernel's bits); other layouts (columns, packed rows) get rows
        # apart from every other rank's, so no two elements of the weight share a stream
        contiguous_rows = self.rows and type(self.placements[0]) is Shard
        self.row0 = offset[0] if contiguous_rows else dist.get_rank(self.group) * local_shape[0]

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``param`` (the weight, or a gathered FSDP2 copy of it)."""
        return param.to_local() if isinstance(param, DTensor) else param

    def local_bias(self, layer) -> torch.Tensor | None:
        """The bias the local product takes: this rank's piece of a colwise bias; none for
        rowwise, whose replicated bias is added once to the summed output (``forward``)."""
        bias = layer._parameters.get("bias")
        if bias is None or not self.rows:
            return None
        return bias.to_local() if isinstance(bias, DTensor) else bias

    def as_gradient(self, g: torch.Tensor) -> DTensor:
        """A local (out, in) gradient as the weight's DTensor gradient (the ordinary path)."""
        return DTensor.from_local(g, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape),
                                  stride=_contiguous_stride(self.shape))

    def forward(self, layer, x: torch.Tensor) -> torch.Tensor:
        """F.linear(x, weight, bias) on this rank's pieces. A DTensor ``x`` is first laid out as
        the local product needs it (colwise: replicated, rowwise: split by features; a
        sequence-parallel input is gathered here if the plan did not), and the output is a
        DTensor: colwise split by features, rowwise a partial sum plus the bias. A local ``x``
        (transformers' local paths) gives the local output, a rowwise one without its bias, as
        the module's forward on local parameters would."""
        as_dtensor = isinstance(x, DTensor)
        if as_dtensor:
            if x.device_mesh != self.mesh:
                raise RuntimeError(f"{layer.forge_name}'s input is a DTensor on another mesh than its weight's: "
                                   "apply one tensor-parallel plan over the layers")
            want = Replicate() if self.rows else Shard(x.dim() - 1)
            if x.placements != (want,):
                x = x.redistribute(placements=[want])
            # colwise: each rank's dX is its columns' share of the whole, summed by DTensor
            x = x.to_local(grad_placements=[Partial()] if self.rows else None)
        if layer.forge_active():
            y = layer.forge_forward(x)
        else:
            y = F.linear(x, self.local(layer.weight), self.local_bias(layer))
        if not as_dtensor:
            return y
        if self.rows:
            placement = self.placements[0]
            out = Shard(y.dim() - 1) if type(placement) is Shard else \
                _StridedShard(y.dim() - 1, split_factor=placement.split_factor)
            shape = (*y.shape[:-1], self.shape[0])
            return DTensor.from_local(y, self.mesh, [out], run_check=False, shape=torch.Size(shape),
                                      stride=_contiguous_stride(shape))
        out = DTensor.from_local(y, self.mesh, [Partial()], run_check=False)
        bias = layer._parameters.get("bias")
        if bias is None:
            return out
        if not isinstance(bias, DTensor):
            bias = DTensor.from_local(bias, self.mesh, [Replicate()], run_check=False)
        return out + bias


class TensorParallelForward:
    """transformers' tensor-parallel forward of a fused layer: the plan's input and output
    transforms around the layer's own forward. Not inside the plan's local-parameter context:
    the fused layer reads its local pieces itself (TensorParallelWeight.forward) and must keep
    its Parameter in place for the step."""

    def __init__(self, layer, plain_forward):
        cells = dict(zip(plain_forward.__code__.co_freevars, (c.cell_contents for c in plain_forward.__closure__)))
        self.style, self.mesh, self.config = cells["self"], cells["mesh"], cells["config"]
        self.layer, self.plain_forward = layer, plain_forward

    def __call__(self, *args, **kwargs):
        layer, style = self.layer, self.style
        args, kwargs = style.transform_inputs_pre_forward(layer, args, kwargs, self.mesh)
        output = type(layer).forward(layer, *args, **kwargs)
        return style.transform_output_post_forward(layer, output, self.mesh, config=self.config)


def attach(layer) -> None:
    """Give a fused layer with a DTensor weight its tensor-parallel layout (patch_model); a
    transformers plan's forward is installed again around the fused forward."""
    if not isinstance(layer.weight, DTensor) or layer.forge_tp is not None:
        return
    refuse_sharded(layer.forge_state.precision, layer.forge_name, "tensor parallelism",
                   "exclude it in patch_model(exclude=[...])")
    layer.forge_tp = TensorParallelWeight(layer)
    forward = layer.__dict__.get("forward")
    if forward is not None and _is_transformers_tp(forward):
        layer.forge_plain_forward = forward  # unpatch_model puts it back (release)
        layer.__dict__["forward"] = TensorParallelForward(layer, forward)


def release(layer, plain) -> None:
    """unpatch_model: the plain module gets the plan's own forward back."""
    forward = layer.__dict__.get("forge_plain_forward")
    if forward is not None:
        plain.__dict__["forward"] = forward


# ------------------------------------------------------------ parameters the optimizer steps


class MeshShards:
    """A DTensor parameter of any placements (tensor parallelism, TP inside FSDP2) as
    ForgeOptimizer sees it, the interface of fsdp.RowShards: this rank's piece, its state's
    whole tensor back from every rank's pieces, and the process groups its squared sums add
    over (its sharded mesh dimensions; a replicated piece counts once)."""

    def __init__(self, p: DTensor):
        self.mesh, self.placements, self.shape = p.device_mesh, tuple(p.placements), tuple(p.shape)
        self.norm_groups = tuple(self.mesh.get_group(i) for i, pl in enumerate(self.placements)
                                 if _shard_dim(pl, max(p.dim(), 1)) is not None)
        self.local_shape, offset = compute_local_shape_and_global_offset(p.shape, self.mesh, self.placements)
        rows_only = all(type(pl) is Replicate or (type(pl) is Shard and pl.dim % max(p.dim(), 1) == 0)
                        for pl in self.placements)
        # the rounding streams' first row, as for a fused layer (TensorParallelWeight.row0): the
        # replicas of a piece (its coordinates on the replicated dimensions) draw the same bits
        piece = 0
        for i, pl in enumerate(self.placements):
            if _shard_dim(pl, max(p.dim(), 1)) is not None:
                piece = piece * self.mesh.size(i) + self.mesh.get_local_rank(i)
        first = offset[0] if p.dim() else 0
        self.row0 = first if rows_only else piece * (self.local_shape[0] if p.dim() else 1)

    def rows(self, n_rows: int) -> tuple[int, int]:
        """(first row of the rounding streams, one past): fsdp.RowShards' interface."""
        return self.row0, self.row0 + (self.local_shape[0] if self.local_shape else 1)

    def _whole_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """The whole shape of a state piece ``t``: the parameter's, or for 8-bit block metadata
        (in / 64 columns) the same blocks over the whole width."""
        if tuple(t.shape) == tuple(self.local_shape):
            return self.shape
        whole = []
        for n, local, full in zip(t.shape, self.local_shape, self.shape):
            factor = local // n if n else 0
            if local == full:
                whole.append(n)
            elif n and local % n == 0 and full % factor == 0:
                whole.append(full // factor)
            else:
                raise ValueError(f"a {tuple(t.shape)} state of a {self.shape} parameter placed {self.placements} "
                                 "does not split as its parameter: 8-bit states of a weight sharded by input "
                                 "columns need a multiple of 64 columns on every rank")
        return tuple(whole)

    def as_dtensor(self, t: torch.Tensor) -> DTensor:
        """``t``, this rank's piece of a state, as the whole state's DTensor placed as the parameter."""
        shape = self._whole_shape(t)
        whole = DTensor.from_local(t, self.mesh, self.placements, run_check=False, shape=torch.Size(shape),
                                   stride=_contiguous_stride(shape))
        if any(isinstance(p, _StridedShard) for p in self.placements):
            # the placement as written (transformers' packed halves), not an encoding of a shard
            # order, as torch 2.11 reads it and then cannot redistribute
            spec = whole._spec
            whole._spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=spec.tensor_meta,
                                      use_strided_shard_as_shard_order=False)
        return whole

    def local_shape_of(self, shape) -> tuple[int, ...]:
        """This rank's piece of a whole state of ``shape`` (a checkpoint's)."""
        return tuple(compute_local_shape_and_global_offset(shape, self.mesh, self.placements)[0])

    def gather_rows(self, t: torch.Tensor, n_rows: int) -> torch.Tensor:
        return self.as_dtensor(t).full_tensor()

    def shard_rows(self, t: torch.Tensor, n_rows: int) -> torch.Tensor:
        return distribute_tensor(t, self.mesh, self.placements, src_data_rank=None).to_local().clone()


def all_reduce_over(t: torch.Tensor, groups) -> torch.Tensor:
    """``t`` summed over each of ``groups`` in turn (mesh dimensions: their product's ranks)."""
    for group in groups:
        dist.all_reduce(t, group=group)
    return t


def settle_gradients(params) -> None:
    """Each DTensor gradient placed as its parameter (a Partial one summed): what the local
    step of the parameter's piece needs. Every rank calls, in the same order."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(placements=p.placements)

