"""ForgeLinear: an nn.Linear whose weight is stepped inside its own backward.

The module keeps the original Parameter objects (state_dict keys, save_pretrained, PEFT
and tying detection keep working). Its hyperparameters live in ``forge_group``, a
param-group-like dict read at every backward, so an optimizer facade can own it and a
scheduler can drive it. Its optimizer state lives with it (``forge_state``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .reference import mix32, reference_fused_update
from .rules import NUM_SCALARS, get_rule, make_group
from .state import ForgeState, check_rounding

BACKENDS = ("auto", "triton", "reference")
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def _triton_launcher():
    try:
        from .kernels.fused_update import launch_fused_update
    except ImportError:  # no Triton on this platform
        return None
    return launch_fused_update


def resolve_backend(backend: str, device: torch.device):
    """The function that performs the fused step for a weight on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend={backend!r}: choose one of {list(BACKENDS)}")
    if backend == "reference":
        return reference_fused_update
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and device.type == "cpu"
    launcher = _triton_launcher() if (device.type == "cuda" or interpreted) else None
    if launcher is None:
        if backend == "triton":
            raise RuntimeError(
                f"backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                f"the weight is on {device}: use backend='auto' or 'reference'"
            )
        return reference_fused_update
    return launcher


def layer_salt(seed: int, layer_index: int) -> int:
    """32-bit key of a layer's stochastic-rounding stream."""
    return mix32((int(seed) & 0xFFFFFFFF) ^ mix32((layer_index * 0x9E3779B1 + 1) & 0xFFFFFFFF))


def pack_args(scalars: list[float], step: int, salt: int, device: torch.device) -> torch.Tensor:
    """The kernel's argument tensor: fp32 bit patterns of the constants, step, salt."""
    floats = torch.tensor(scalars, dtype=torch.float32).view(torch.int32)
    ints = torch.tensor([step & 0xFFFFFFFF, salt], dtype=torch.int64).to(torch.int32)
    return torch.cat([floats, ints]).to(device, non_blocking=True)


class FusedWeightFunction(torch.autograd.Function):
    """y = x W^T + b; backward returns dX and db and steps W in place (no W.grad)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)  # not the weight: it is overwritten during backward
        return F.linear(x, layer.forge_weight_view().to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        layer = ctx.layer
        w = layer.forge_weight_view()
        n_out, n_in = w.shape
        # dX must be formed from the weight before this step's update (paper Remark 1).
        dx = dy @ w.to(dy.dtype) if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, n_out)
        db = dy2.float().sum(0).to(layer.bias.dtype) if ctx.needs_input_grad[2] else None
        dw = layer.forge_consume_gradient(x.reshape(-1, n_in), dy2) if ctx.needs_input_grad[1] else None
        return dx, dw, db, None


class FusedWeightMixin:
    """The forge machinery shared by ForgeLinear and the Conv1D variant."""

    forge_transposed = False  # Conv1D stores its weight as (in, out)

    def forge_setup(self, optimizer="adamw", state_precision="fp32", rounding="stochastic",
                    seed=0, layer_index=0, backend="auto", **hyperparameters):
        if self.weight.dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight dtype {self.weight.dtype} is not supported by forge: use float32 weights "
                "(with autocast for mixed precision) or bfloat16 weights"
            )
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend={backend!r}: choose one of {list(BACKENDS)}")
        self.forge_rule = get_rule(optimizer)
        self.forge_group = make_group(self.forge_rule, hyperparameters)
        self.forge_state = ForgeState(self.forge_rule, state_precision)
        self.forge_rounding = check_rounding(rounding)
        self.forge_seed = int(seed)
        self.forge_layer_index = int(layer_index)
        self.forge_backend = backend
        self.forge_enabled = True  # False: gradients flow to W.grad for an ordinary optimizer
        self.forge_stats = torch.zeros(2, dtype=torch.float32, device=self.weight.device)

    def forge_weight_view(self) -> torch.Tensor:
        """The weight as (out_features, in_features), a view of the parameter."""
        return self.weight.t() if self.forge_transposed else self.weight

    def forge_consume_gradient(self, x2: torch.Tensor, dy2: torch.Tensor):
        """Step the weight with G = dy2^T x2; returns the weight gradient only when fusion
        is off for this layer (then the ordinary optimizer steps it)."""
        if not self.forge_enabled:
            g = dy2.float().t() @ x2.float()
            return (g.t() if self.forge_transposed else g).to(self.weight.dtype)
        with torch.no_grad():
            self.forge_fused_step(x2, dy2)
        return None

    @torch.no_grad()
    def forge_fused_step(self, x2: torch.Tensor, dy2: torch.Tensor) -> None:
        rule, group, state = self.forge_rule, self.forge_group, self.forge_state
        state.allocate(self.weight, group)
        scalars = rule.prepare(group, state.host)
        assert len(scalars) == NUM_SCALARS
        device = self.weight.device
        if self.forge_stats.device != device:
            self.forge_stats = self.forge_stats.to(device)
        args = pack_args(scalars, state.step, layer_salt(self.forge_seed, self.forge_layer_index), device)
        t = (lambda s: s.t()) if self.forge_transposed else (lambda s: s)
        slots = [t(s) if s is not None else None for s in state.slots]
        run = resolve_backend(self.forge_backend, device)
        run(x2, dy2, t(self.weight.data), slots, args, self.forge_stats, rule.name,
            self.forge_rounding == "stochastic")

    def forge_active(self) -> bool:
        return self.training and torch.is_grad_enabled() and self.weight.requires_grad

    def forge_forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # autocast does not reach inside a custom Function: cast as it would for linear
            x = x.to(torch.get_autocast_dtype(dev))
            with torch.autocast(dev, enabled=False):
                return FusedWeightFunction.apply(x, self.weight, self.bias, self)
        return FusedWeightFunction.apply(x, self.weight, self.bias, self)

    def forge_extra_repr(self) -> str:
        return (f"optimizer={self.forge_rule.name}, state_precision={self.forge_state.precision}, "
                f"rounding={self.forge_rounding}")


class ForgeLinear(FusedWeightMixin, nn.Linear):
    """nn.Linear with the FORGE fused backward-and-optimizer step."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, **forge_options):
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.forge_setup(**forge_options)

    @classmethod
    def from_linear(cls, linear: nn.Linear, optimizer: str = "adamw", state_precision: str = "fp32",
                    rounding: str = "stochastic", seed: int = 0, **hyperparameters) -> "ForgeLinear":
        """A ForgeLinear that shares ``linear``'s Parameter objects (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.train(linear.training)
        for hook_dict in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            getattr(layer, hook_dict).update(getattr(linear, hook_dict))
        layer.forge_setup(optimizer=optimizer, state_precision=state_precision, rounding=rounding,
                          seed=seed, **hyperparameters)
        return layer

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear with the same Parameter objects."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight, linear.bias = self.weight, self.bias
        linear.train(self.training)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.forge_active():
            return F.linear(x, self.weight, self.bias)
        return self.forge_forward(x)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, {self.forge_extra_repr()}"
