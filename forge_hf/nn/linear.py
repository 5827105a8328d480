"""ForgeLinear: an nn.Linear whose weight is stepped inside its own backward.

The module keeps the original Parameter objects (state_dict keys, save_pretrained, PEFT
and tying detection keep working). Its options are a ForgeConfig (``forge_config``); its
hyperparameters are read at every backward from ``forge_group``: the ForgeOptimizer param
group holding its weight, or a group of its own when no optimizer owns it. Its optimizer
state lives with it (``forge_state``).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..core.config import ForgeConfig, resolve_config
from ..core.factored import reduce_factored_columns
from ..core.rounding import layer_salt
from ..core.state import ForgeState
from ..kernels import bind_fused_update, next_launch_args
from .backward_checks import as_dtype, input_gradient, refuse_second_backward
from .compiled_linear import compiled_forward, new_anchor

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


class DataParallelSeam(Protocol):
    """What a fused layer asks of data parallelism (optim/distributed.py provides it): the
    tokens of every rank for its weight gradient, the band of rows this rank steps, and
    the updated rows of the others."""

    mode: str  # "sharded": this rank keeps and steps its band of rows; "replicated": all rows;
    # "fsdp": FSDP2 shards the weight by rows, its band is this rank's shard (ShardedWeightSeam)
    group: object  # the process group of the layer's replicas

    def announce_tokens(self, n_tokens: int) -> None: ...
    def gather_tokens(self, x2: torch.Tensor, dy2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rows(self, n_rows: int) -> tuple[int, int]: ...
    def count_sent(self, n_bytes: int) -> None: ...
    def share_rows(self, weight: torch.Tensor) -> None: ...
    def wait(self) -> None: ...


class TensorParallelSeam(Protocol):
    """A weight that is a DTensor sharded by tensor parallelism (optim/tensor_parallel.py):
    the layer steps this rank's piece from its local tensors."""

    row0: int  # the piece's first row for the rounding streams

    def local(self, param: torch.Tensor) -> torch.Tensor: ...
    def local_bias(self, layer) -> torch.Tensor | None: ...
    def as_gradient(self, g: torch.Tensor) -> torch.Tensor: ...
    def forward(self, layer, x: torch.Tensor) -> torch.Tensor: ...


class ShardedWeightSeam(DataParallelSeam, Protocol):
    """Mode "fsdp" (optim/fsdp.py): the layer's weight in backward is a gathered copy; the
    rows to step live in this rank's shard of the parameter."""

    def local_shard(self) -> torch.Tensor: ...


def _in_this_backward(node) -> bool:
    """Whether the running backward will execute ``node`` (graph membership; under
    ``autograd.grad(inputs=...)`` also whether it is needed)."""
    return torch._C._will_engine_execute_node(node)


def _check_one_process(layer) -> None:
    """A fused step without forge's data-parallel mode is exact only if no other rank trains
    these weights: DDP has no fused gradient to reduce, so each rank would step from its own
    batch alone and the replicas drift apart. Tensor parallelism's ranks hold different pieces
    of the weight: its mesh's ranks are one process. Checked once per layer (``_forge_one_process``)."""
    tp = layer.forge_tp
    pieces = tp.mesh.size() if tp is not None else 1
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > pieces:
        raise RuntimeError(
            f"{layer.forge_name} ran a fused backward in a process group of {dist.get_world_size()} ranks "
            "without forge data parallelism: each rank would step its fused weights from its own batch "
            "only (DDP, find_unused_parameters=True included, never reduces them) and the ranks would "
            "drift apart. Call forge_hf.distributed.enable_data_parallel(model) after patch_model and "
            "before wrapping the model in DistributedDataParallel, or train with forge_hf.ForgeTrainer "
            "under `accelerate launch` or torchrun, which enables it itself")
    layer.__dict__["_forge_one_process"] = True


_APPLY = torch._C._FunctionBase.__dict__["apply"]  # Function.apply without its Python wrapper


def apply_function(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``. Function.apply's Python wrapper (signature binding,
    functorch's dead-wrapper unwrapping) costs a few microseconds a call, a fused layer's
    forward every step; it is needed only while a functorch transform is active."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return _APPLY.__get__(None, function)(*args)


class ForgeFallbackWarning(UserWarning):
    """A fused layer switched to the ordinary optimizer path (the message names it)."""


class FusedWeightFunction(torch.autograd.Function):
    """y = x W^T + b; backward returns dX and db and steps W in place (no W.grad).

    W is not an input of this node: it is read through ``layer``, so no edge of the node
    leads to W's AccumulateGrad and any edge that does belongs to another consumer of W
    (FusedWeightMixin.forge_conflict). ``anchor``, an empty leaf that requires grad, keeps
    the output in the graph when neither x nor b needs a gradient (LoRA on a frozen base).
    """

    # its forward's ops (linear) give the same result with autocast on as off when every
    # input is in autocast's dtype already (FusedWeightMixin.forge_apply)
    forge_autocast_neutral = True

    @staticmethod
    def forward(ctx, x, anchor, bias, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)  # not the weight: it is overwritten during backward
        layer.forge_track(ctx)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return F.linear(x, as_dtype(layer.forge_weight_view(), x.dtype), bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx, db = fused_backward(ctx, x, dy, anchor_index=1, need_dx=ctx.needs_input_grad[0])
        return dx, None, db, None


def fused_backward(ctx, x, dy, anchor_index, need_dx):
    """dX (when ``need_dx``) and db of ``ctx``'s layer for the output gradient ``dy``, and
    its weight stepped with dY^T X: the backward of a fused Function whose inputs were
    (..., anchor at ``anchor_index``, bias, layer) and whose layer input is ``x``."""
    layer = ctx.layer
    refuse_second_backward(layer, getattr(ctx, "forge_stepped", False))
    dx = input_gradient(layer, dy) if need_dx else None
    dy2 = _rows(dy)
    db = dy2.float().sum(0).to(layer.bias.dtype) if ctx.needs_input_grad[anchor_index + 1] else None
    # The anchor's AccumulateGrad stands for the weight: not executed under
    # autograd.grad(outputs, inputs) that leaves the weight out, so no step then.
    if layer._parameters["weight"].requires_grad and _in_this_backward(ctx.next_functions[anchor_index][0]):
        ctx.forge_stepped = layer.forge_consume_gradient(_rows(x), dy2, functools.partial(layer.forge_conflict, ctx))
    return dx, db


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (tokens, features); a reshape costs host time even when ``t`` is 2-D already."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


class FusedWeightMixin:
    """The forge machinery shared by ForgeLinear and the Conv1D variant."""

    forge_transposed = False  # Conv1D stores its weight as (in, out)
    forge_dp: DataParallelSeam | None = None  # set by optim/distributed.enable_data_parallel
    forge_held = None  # a HeldGradient while a ForgeOptimizer holds the updates to its step (held_gradient.py)
    forge_tp: TensorParallelSeam | None = None  # set by patch_model for a tensor-parallel DTensor weight

    def forge_setup(self, config: ForgeConfig, layer_index: int = 0):
        if self.weight.dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight dtype {self.weight.dtype} is not supported by forge: use float32 weights "
                "(with autocast for mixed precision) or bfloat16 weights"
            )
        self.forge_config = config
        self.forge_rule = config.rule
        # its own one-group holder; a ForgeOptimizer replaces it by the param group holding the weight
        self.forge_group = config.group()
        precision = config.state_precision_for(self.weight.dtype)
        self.forge_state = ForgeState(self.forge_rule, precision, transposed=self.forge_transposed)
        self.forge_layer_index = int(layer_index)
        self.forge_enabled = True  # False: gradients flow to W.grad for an ordinary optimizer, for good
        self.forge_fallback_reason = None  # why the last step sent the gradient to W.grad (forge_fall_back)
        self.forge_name = self.__dict__.get("forge_name", type(self).__name__)  # patch_model: the module name
        self.forge_stats = torch.zeros(2, dtype=torch.float32, device=self.weight.device)
        self._forge_anchor = new_anchor(self)  # made before any trace: torch.compile finds the layer by it
        self.forge_arm()

    def forge_weight_view(self) -> torch.Tensor:
        """The weight as (out_features, in_features), a view of the parameter (tensor parallel:
        of this rank's piece)."""
        weight = self._parameters["weight"]  # not through nn.Module.__getattr__: called a few times a step
        if self.forge_tp is not None:
            weight = self.forge_tp.local(weight)
        return weight.t() if self.forge_transposed else weight

    def forge_consume_gradient(self, x2: torch.Tensor, dy2: torch.Tensor, conflict=None) -> bool:
        """Step the weight with G = dy2^T x2, or, when this step is not fused (forge_fuses;
        ``conflict``: its check for other consumers of the weight), add G to ``weight.grad``
        for the ordinary optimizer. Returns whether the weight was stepped."""
        if torch.is_grad_enabled():  # a backward with create_graph=True: the step is not differentiable
            with torch.no_grad():
                return self.forge_consume_gradient(x2, dy2, conflict)
        weight = self._parameters["weight"]
        if not self.forge_fuses(conflict):
            g = dy2.float().t() @ x2.float()
            g = (g.t() if self.forge_transposed else g).to(weight.dtype)
            if self.forge_tp is not None:  # this rank's piece of the DTensor weight's gradient
                g = self.forge_tp.as_gradient(g)
            if weight.grad is None:
                weight.grad = g.contiguous()
            else:
                weight.grad.add_(g)
            return False
        d = self.__dict__
        held = d.get("forge_held")
        if held is not None:  # the optimizer steps it (held_gradient.py)
            dp = self.forge_dp
            if dp is not None:  # gathered now, as a step would take them (FSDP2: its shard's rows)
                x2, dy2 = self.forge_gather(x2, dy2)
            held.add(x2, dy2, gathered=dp is not None)
            d["_forge_updates"] = d.get("_forge_updates", 0) + 1
            return True
        self.forge_fused_step(x2, dy2)
        # A node that saved the weight and runs later must fail, not use the new value.
        torch.autograd.graph.increment_version(weight)
        d["_forge_updates"] = d.get("_forge_updates", 0) + 1  # plain attributes, past nn.Module.__setattr__
        return True

    # ------------------------------------------------------------ consumers
    # One fused step per weight per backward is exact only if this module's single call
    # is the weight's only consumer (paper Remark 1). Checked in backward, before the
    # step, against the running graph: another call of the module or another reader of
    # the weight in this backward means the ordinary path for all of them in this step
    # (forge_fuses). A gradient that shows up from elsewhere (another backward, Liger
    # reading lm_head.weight) is caught by the weight's post-accumulate-grad hook: before
    # the step, the same; after it, a permanent fallback.

    def forge_track(self, node) -> None:
        """Called by each fused forward: remember the node weakly (forge_conflict)."""
        d = self.__dict__
        nodes = d.get("_forge_nodes")
        if nodes is None or (len(nodes) == 1 and nodes[0]() is None):  # the usual case: last step's node is gone
            d["_forge_nodes"] = [weakref.ref(node)]
        else:
            d["_forge_nodes"] = [*(r for r in nodes if r() is not None), weakref.ref(node)]
        hook = d.get("_forge_hook")
        if hook is None or hook[0]() is not d["_parameters"]["weight"]:
            self.forge_arm()

    def forge_arm(self) -> None:
        """Hook the weight's gradient accumulation (once per Parameter object)."""
        hook = self.__dict__.get("_forge_hook")
        if hook is not None and hook[0]() is self.weight:
            return
        me = weakref.ref(self)

        def on_gradient(param):
            layer = me()
            if layer is not None:
                layer.forge_on_gradient(param)

        self._forge_hook = (weakref.ref(self.weight), self.weight.register_post_accumulate_grad_hook(on_gradient))

    def forge_fuses(self, conflict=None) -> bool:
        """Whether this backward steps the weight; if not, its gradient goes to ``weight.grad``.
        ``conflict()`` names another consumer of the weight in this step, or None. Such a
        fallback lasts while the weight holds the gradient it started: once that gradient is
        consumed (``weight.grad`` is None again, as after ``zero_grad()``) the layer fuses again."""
        if not self.forge_enabled:
            return False
        d = self.__dict__
        if d.get("forge_fallback_reason") is not None:
            if d["_parameters"]["weight"].grad is not None:
                return False  # this step is on the ordinary path already: add to its gradient
            d["forge_fallback_reason"] = None
        reason = conflict() if conflict is not None else None
        if reason:
            self.forge_fall_back(reason)
            return False
        return True

    def forge_conflict(self, node) -> str | None:
        """Why the weight must not be stepped in ``node``'s backward, or None."""
        weight = self._parameters["weight"]
        if weight.grad is not None:
            return "its weight already holds a gradient (.grad was set outside the module)"
        nodes = self.__dict__.get("_forge_nodes", ())
        if len(nodes) > 1:  # one: ``node`` itself, tracked by its forward
            for ref in nodes:
                other = ref()
                if other is not None and other is not node and _in_this_backward(other):
                    return "the module is called more than once in this step"
        if _in_this_backward(self.forge_weight_accumulator(weight)):
            return "its weight is also used outside the module in this step (tied or read directly)"
        return None

    def forge_weight_accumulator(self, weight: torch.Tensor):
        """The weight's AccumulateGrad node, held so that autograd keeps using this one (it
        holds its own weakly and makes a new one when none is alive)."""
        cached = self.__dict__.get("_forge_accumulator")
        if cached is None or cached[0]() is not weight:
            cached = self.__dict__["_forge_accumulator"] = (
                weakref.ref(weight), torch.autograd.graph.get_gradient_edge(weight).node)
        return cached[1]

    def forge_on_gradient(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: a gradient of a fused weight materialised."""
        d = self.__dict__
        if not self.forge_enabled or param is not self.weight or d.get("forge_fallback_reason") is not None:
            return  # not fused, or this step is on the ordinary path already: the gradient joins it
        if d.get("_forge_updates", 0):
            # Stepped already with only its own share; stepping again would be worse.
            param.grad = None
            self.forge_fall_back(
                "its weight received a gradient from outside the module after this step had "
                "already updated it (a consumer in another backward or checkpoint segment); that "
                "gradient was dropped, so this step's update used only the module's own share", for_good=True)
        else:
            self.forge_fall_back(
                "its weight received a gradient from outside the module (it is read directly: "
                "tied, or by Liger's fused linear cross-entropy, ...)")

    def forge_fall_back(self, reason: str, for_good: bool = False) -> None:
        """Send this layer's weight gradient to ``weight.grad``, where an ordinary optimizer
        steps it (ForgeOptimizer does, with the same ForgeState): for this step (forge_fuses
        says when it fuses again), or ``for_good``. Warns once per layer and reason."""
        if not self.forge_enabled:
            return
        d = self.__dict__
        d["forge_fallback_reason"] = reason
        if for_good:
            self.forge_enabled = False
            # the ordinary path accumulates through this node: autograd then makes it on the
            # stream of the step that runs it (a captured one's too), not on the one it was looked up on
            d.pop("_forge_accumulator", None)
        warned = d.setdefault("_forge_warned", set())
        if (reason, for_good) in warned:  # a layer with this cause in every step: correct, and told once
            return
        warned.add((reason, for_good))
        if for_good:
            what = (f" for good: {reason}. Its weight gradient is materialised from now on; an optimizer "
                    "over all trainable parameters steps it")
        else:
            what = (f": {reason}. Its weight gradient in this step is materialised for an optimizer over all "
                    "trainable parameters (ForgeOptimizer steps it with the layer's own state); the layer "
                    "fuses again in the first step without this cause, once that gradient is consumed "
                    "(weight.grad is None again, as after zero_grad()). Told once per layer and cause")
        warnings.warn(f"forge: {self.forge_name} falls back to the ordinary optimizer{what}. Exclude it in "
                      "patch_model(exclude=[...]) to keep it on the ordinary path silently.",
                      ForgeFallbackWarning, stacklevel=2)

    def forge_fallback(self) -> str | None:
        """Why this layer's weight gradient goes to ``weight.grad``: for good, or in its last
        step; None while it fuses."""
        reason = self.__dict__.get("forge_fallback_reason")
        if not self.forge_enabled:
            return reason or "fusion was switched off"
        return reason

    def forge_note_call(self) -> None:
        """A forward call: outside a backward (not a checkpoint recomputation) it starts a
        new step for the bookkeeping of forge_on_gradient. Data parallel: the weight's
        rows updated by other ranks arrive first."""
        self.forge_ready()
        if torch._C._current_graph_task_id() == -1:
            d = self.__dict__
            d["_forge_updates"] = 0
            if (d.get("forge_fallback_reason") is not None and d["forge_enabled"]
                    and d["_parameters"]["weight"].grad is None):
                d["forge_fallback_reason"] = None  # last step's fallback: its gradient was consumed

    def __getstate__(self):
        # Weak references and hook handles belong to this object: a copy makes its own.
        state = dict(self.__dict__)
        for key in ("_forge_nodes", "_forge_hook", "_forge_anchor", "forge_dp", "_forge_one_process",
                    "_forge_launch", "_forge_accumulator", "_forge_warned"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        nn.Module.__setstate__(self, state)
        self.forge_arm()
        self._forge_anchor = new_anchor(self)  # a copy's own key for the compiled ops

    def forge_fused_step(self, x2: torch.Tensor, dy2: torch.Tensor, gathered: bool = False) -> None:
        """Step the weight with dy2^T x2 (in no-grad mode: forge_consume_gradient). Data
        parallel: ``gathered``, x2 holds every rank's tokens already and dy2 this rank's rows."""
        d = self.__dict__
        rule, group, state = d["forge_rule"], d["forge_group"], d["forge_state"]
        param = d["_parameters"]["weight"]
        tp = self.forge_tp
        if tp is not None:  # tensor parallel: this rank's piece, whose local dy2^T x2 is its exact gradient
            param = tp.local(param)
        weight = param.t() if self.forge_transposed else param
        dp = self.forge_dp
        if dp is None and not d.get("_forge_one_process", False):
            _check_one_process(self)
        start, whole_rows, sharded = 0, weight.shape[0], False
        if dp is not None:  # data parallel: every rank's tokens, then this rank's rows only
            start, stop = dp.rows(weight.shape[0])
            sharded = dp.mode != "replicated"
            if not gathered:
                x2, dy2 = self.forge_gather(x2, dy2)
            if dp.mode == "fsdp":  # not a band of the gathered copy: the update must land in the shard
                weight = param = dp.local_shard()
            else:  # the same band of the parameter itself: its columns when stored (in, out)
                weight = weight[start:stop]
                param = param[:, start:stop] if self.forge_transposed else param[start:stop]
        if not state.allocated:
            state.allocate(param, group, transposed=self.forge_transposed, whole_rows=whole_rows)
        device = weight.device
        stats = d["forge_stats"]
        if stats.device != device:
            stats = self.forge_stats = stats.to(device)
        args = next_launch_args(rule, group, state, self.forge_salt(), device, start + (0 if tp is None else tp.row0))
        if weight.shape[0] > 0:  # a rank may own no rows of a small layer
            self.forge_launcher(weight, state)(x2, dy2, args, stats)
        if sharded and state.stored_precision == "log4_factored":  # its column sums: every rank's rows' share
            dp.count_sent(reduce_factored_columns(state.slots, state.step, dp.group))
        if dp is not None:
            dp.share_rows(self.forge_weight_view().data)

    def forge_gather(self, x2: torch.Tensor, dy2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Data parallel: every rank's tokens, and of dy2 the columns of the rows this rank steps."""
        dp = self.forge_dp
        x2, dy2 = dp.gather_tokens(x2, dy2)
        start, stop = dp.rows(self.forge_weight_view().shape[0])
        return x2, dy2[:, start:stop]

    def forge_step_held(self, step_gradient, scale: torch.Tensor | None = None, joined: dict | None = None) -> None:
        """Step the weight from what it held since the last step (held_gradient.py), times
        ``scale`` (clipping's factor), and hold nothing after: a token stash through the fused
        kernel over every held token; an fp32 buffer through ``step_gradient(g)``, the
        optimizer's step of a whole gradient in the weight's layout (the one a fallback's
        ``weight.grad`` takes), whose (squared sum, skipped) join this layer's statistics as a
        fused backward's sums do. ``joined`` as for HeldGradient.tokens_and_gradients."""
        hold = self.forge_held
        if hold.buffer is not None:
            # scaled in place, as clip_grad_norm_ scales a gradient: no second buffer (cleared below)
            g = hold.buffer if scale is None else hold.buffer.mul_(scale.to(hold.buffer.device))
            p_sq, p_bad = step_gradient(g.t() if self.forge_transposed else g)
            self.forge_stats += torch.stack([p_sq.float(), p_bad.float()]).to(self.forge_stats.device)
        else:
            x2, dy2 = hold.tokens_and_gradients(joined, scale)
            self.forge_fused_step(x2, dy2, gathered=hold.gathered)
        hold.clear()

    def forge_salt(self) -> int:
        """The 32-bit key of this layer's stochastic-rounding stream."""
        key = (self.forge_config.seed, self.forge_layer_index)
        cached = self.__dict__.get("_forge_salt")
        if cached is None or cached[0] != key:
            cached = self._forge_salt = (key, layer_salt(*key))
        return cached[1]

    def forge_launcher(self, weight: torch.Tensor, state: ForgeState):
        """The bound fused step of this layer (kernels/dispatch.bind_fused_update), built again
        when the weight, a state slot, the statistics or the backend moved."""
        config = self.__dict__["forge_config"]
        key = (config.backend, config.rounding, weight.data_ptr(), tuple(weight.shape),
               self.forge_stats.data_ptr(), *map(id, state.slots))
        bound = self.__dict__.get("_forge_launch")
        if bound is None or bound[0] != key:
            launch = bind_fused_update(config.backend, weight, state.kernel_slots(), self.forge_stats,
                                       self.forge_rule.name, config.rounding == "stochastic")
            bound = self._forge_launch = (key, launch)
        return bound[1]

    def forge_ready(self) -> None:
        """Finish a pending data-parallel gather of updated rows before the weight is read."""
        dp = self.forge_dp
        if dp is not None:
            dp.wait()

    def forge_active(self) -> bool:
        """Whether a forward goes through the fused Function. Not ``self.training``: a
        backward in eval mode steps the weight as in train mode (dropout is the model's)."""
        return self.forge_enabled and torch.is_grad_enabled() and self._parameters["weight"].requires_grad

    def forge_forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # custom ops torch.compile traces (compiled_linear.py)
            return compiled_forward(self, x)
        return self.forge_apply(FusedWeightFunction, x)

    def forge_apply(self, function, *inputs: torch.Tensor) -> torch.Tensor:
        """``function.apply(*inputs, anchor, bias, self)``: a fused Function whose first
        input has the layer's tokens along its leading dimensions."""
        if torch.compiler.is_compiling():
            # torch.compile then runs this call eagerly at a graph break (fullgraph=True: the error)
            raise RuntimeError(
                f"{self.forge_name}: only the fused linear has a torch.compile form, not other fused "
                "Functions: give yours custom ops as nn/compiled_linear.py does, or allow a graph break")
        x = inputs[0]
        anchor = self.__dict__.get("_forge_anchor")
        if anchor is None or anchor.device != x.device:
            anchor = self._forge_anchor = new_anchor(self)
        dp = self.forge_dp
        if dp is not None:
            dp.announce_tokens(x.numel() // max(x.shape[-1], 1))
        bias = self._parameters.get("bias") if self.forge_tp is None else self.forge_tp.local_bias(self)
        # one call for the usual case, no autocast at all; then the device's own check
        dev = None if not torch._C._is_any_autocast_enabled() else "cuda" if x.is_cuda else x.device.type
        if dev is not None and torch.is_autocast_enabled(dev):
            dtype = torch.get_autocast_dtype(dev)
            if not (getattr(function, "forge_autocast_neutral", False) and self._forge_all_in(dtype, inputs, bias)):
                # autocast does not reach inside a custom Function: cast as it would for linear
                inputs = [t.to(dtype) for t in inputs]
                with torch.autocast(dev, enabled=False):
                    return function.apply(*inputs, anchor, bias, self)
        return apply_function(function, *inputs, anchor, bias, self)

    def _forge_all_in(self, dtype: torch.dtype, inputs, bias) -> bool:
        """Whether the tokens, weight and bias are all in ``dtype`` already: autocast would
        then cast nothing in a neutral Function's forward, and leaving it on there saves
        entering and leaving its context (~10 us a fused layer's forward)."""
        return (self._parameters["weight"].dtype == dtype and (bias is None or bias.dtype == dtype)
                and all(t.dtype == dtype for t in inputs))

    @classmethod
    def forge_adopt(cls, module: nn.Module, config: ForgeConfig, layer_index: int = 0):
        """A fused twin of ``module`` that shares its state dicts: the same Parameter
        objects, hooks (their handles keep working) and attributes."""
        layer = cls.__new__(cls)
        layer.__dict__.update(module.__dict__)
        layer.forge_setup(config, layer_index)
        return layer

    def forge_release(self, plain_cls: type) -> nn.Module:
        """The plain ``plain_cls`` module back, sharing the same state, forge parts removed."""
        hook = self.__dict__.get("_forge_hook")
        if hook is not None and hook[0]() is self.weight:
            hook[1].remove()
        plain = plain_cls.__new__(plain_cls)
        plain.__dict__.update({k: v for k, v in self.__dict__.items() if not k.lstrip("_").startswith("forge_")})
        return plain

    def forge_extra_repr(self) -> str:
        return (f"optimizer={self.forge_rule.name}, state_precision={self.forge_state.precision}, "
                f"rounding={self.forge_config.rounding}")


class ForgeLinear(FusedWeightMixin, nn.Linear):
    """nn.Linear with the FORGE fused backward-and-optimizer step."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, config: ForgeConfig | None = None, **options):
        config = resolve_config(config, options)
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.forge_setup(config)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: ForgeConfig | None = None, **options) -> ForgeLinear:
        """A ForgeLinear that shares ``linear``'s Parameter objects (no copy) and hooks.

        Args:
            linear: the ``nn.Linear`` to fuse; it is left as it is.
            config: a ForgeConfig (default: every option's default).
            **options: ForgeConfig options (``optimizer``, ``state_precision``, ``rounding``,
                ``backend``, ``seed``) and the rule's hyperparameters (``lr``, ``betas``,
                ``weight_decay``, ...), applied over ``config``. Without a ForgeOptimizer the
                layer steps with these hyperparameters (``layer.forge_group``); a
                ForgeOptimizer built over it makes its param group the layer's.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        return cls.forge_adopt(linear, resolve_config(config, options))

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear with the same Parameter objects and hooks."""
        return self.forge_release(nn.Linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # compiled: the fused op notes the call when it runs
            self.forge_note_call()
        if self.forge_tp is not None:  # a DTensor weight: the local product (optim/tensor_parallel.py)
            return self.forge_tp.forward(self, x)
        if not self.forge_active():
            return F.linear(x, self.weight, self.bias)
        return self.forge_forward(x)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, {self.forge_extra_repr()}"
