"""The fused layer as torch.library custom ops, so torch.compile traces a patched model
without a graph break and compiles its own ops (norms, rotary, SwiGLU, residuals) around
forge's step.

Under ``torch.compiler.is_compiling()`` a fused layer's forward is one call of

* ``forge_hf::fused_linear(x, anchor, bias, layer_id) -> (y, tag)``, whose autograd
  formula calls
* ``forge_hf::fused_linear_backward(x, dy, tag, layer_id, need_dx) -> dx``: dX from the
  weight before its update, then the layer's fused step (``forge_consume_gradient``).

Both run as opaque Python when the compiled graph runs, so the bookkeeping that cannot be
traced happens there: the layer is found by ``layer_id`` in a registry of weak
references; the forward notes the call (data-parallel row wait and token count); the
backward checks the layer's consumers and steps it. The eager path (FusedWeightFunction)
is unchanged.

Why the graph stays correct:

* The weight is never a tensor of the traced graph: the ops read it through the layer, as
  FusedWeightFunction does. No traced op reads or writes it, so nothing can be reordered
  around its in-place update, and the compiled graph hands it no (empty) gradient, which
  would run its post-accumulate-grad hook as if another consumer had produced one.
* ``anchor`` (the layer's empty leaf that requires grad) keeps the output in the autograd
  graph when neither x nor the bias needs a gradient, as in eager.
* The backward op is registered as an ordered side effect: an unused dx (first layer, no
  bias) would otherwise let the compiler drop the call, and the weight would silently not
  be stepped; the order of the fused steps is kept as well.
* ``tag`` is a fresh empty tensor per forward call, saved for backward and freed with the
  autograd graph: a backward that finds another live tag of its layer knows the module
  was called more than once in this step (the eager path asks the autograd nodes) and
  falls back before stepping.
* Both ops carry ``cudagraph_unsafe``: their host-side work (state allocation, launch
  arguments read at each step) must run at each step, not be replayed from a capture.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._library.effects import EffectType

_LAYERS: dict[int, weakref.ref] = {}  # layer id -> the fused layer
_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fused layer -> its id
_NEXT_ID = itertools.count()
# layer -> its forward calls whose autograd graph is alive: [weak ref to the tag's storage,
# whether its backward stepped the weight]. The storage, not the tensor: the graph keeps
# the tag's storage but may save the tag itself as another tensor object.
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_TAGS_OF_OPS = (torch.Tag.cudagraph_unsafe,)


def register_layer(layer: nn.Module) -> int:
    """The id under which the custom ops find ``layer`` (a copy of a layer gets its own)."""
    layer_id = _IDS.get(layer)
    if layer_id is None:
        layer_id = _IDS[layer] = next(_NEXT_ID)
        _LAYERS[layer_id] = weakref.ref(layer, lambda _, i=layer_id: _LAYERS.pop(i, None))
    return layer_id


def layer_of(layer_id: int) -> nn.Module:
    ref = _LAYERS.get(layer_id)
    layer = None if ref is None else ref()
    if layer is None:
        raise RuntimeError(
            f"forge_hf::fused_linear was called for layer id {layer_id}, which belongs to no live fused layer "
            "(a compiled graph outlived its model): compile the model again (torch._dynamo.reset())")
    return layer


@torch.compiler.assume_constant_result
def _traced_layer_id(layer: nn.Module) -> int:
    """Run on the real module while torch.compile traces (the graph is guarded on the
    module's identity): registers it and gives it an anchor on its weight's device."""
    anchor = layer.__dict__.get("_forge_anchor")
    if anchor is None or anchor.device != layer.weight.device:
        layer._forge_anchor = torch.empty(0, device=layer.weight.device, requires_grad=True)
    return register_layer(layer)


def compiled_forward(layer: nn.Module, x: Tensor) -> Tensor:
    """The fused layer's forward as torch.compile traces it (FusedWeightMixin.forge_apply)."""
    layer_id = _traced_layer_id(layer)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # autocast does not reach inside a custom op: cast as it would for linear
        x = x.to(torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):
            return fused_linear(x, layer._forge_anchor, layer.bias, layer_id)[0]
    return fused_linear(x, layer._forge_anchor, layer.bias, layer_id)[0]


# ------------------------------------------------------------------ forward op


@torch.library.custom_op("forge_hf::fused_linear", mutates_args=(), tags=_TAGS_OF_OPS)
def fused_linear(x: Tensor, anchor: Tensor, bias: Tensor | None, layer_id: int) -> tuple[Tensor, Tensor]:
    """y = x W^T + b with W read from the layer; ``tag`` marks this call until its
    autograd graph is freed."""
    layer = layer_of(layer_id)
    layer.forge_note_call()
    dp = layer.forge_dp
    if dp is not None:
        dp.announce_tokens(x.numel() // max(x.shape[-1], 1))
    tag = x.new_empty(0)
    calls = [call for call in _CALLS.get(layer, ()) if call[0]() is not None]
    calls.append([weakref.ref(tag.untyped_storage()), False])
    _CALLS[layer] = calls
    y = F.linear(x, layer.forge_weight_view().to(x.dtype), None if bias is None else bias.to(x.dtype))
    return y, tag


@fused_linear.register_fake
def _(x, anchor, bias, layer_id):
    n_out = layer_of(layer_id).forge_weight_view().shape[0]
    return x.new_empty(*x.shape[:-1], n_out), x.new_empty(0)


def _setup_context(ctx, inputs, output):
    x, _, bias, layer_id = inputs
    ctx.save_for_backward(x, output[1])  # not the weight: it is overwritten during backward
    ctx.layer_id = layer_id
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, dy, _):
    x, tag = ctx.saved_tensors
    need_dx, _, need_db = ctx.needs_input_grad[:3]
    dx = fused_linear_backward(x, dy, tag, ctx.layer_id, need_dx)
    # db is traced: the compiler may fuse it; the same float32 sum as fused_backward
    db = dy.reshape(-1, dy.shape[-1]).float().sum(0).to(ctx.bias_dtype) if need_db else None
    return (dx if need_dx else None), None, db, None


fused_linear.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------- backward op


@torch.library.custom_op("forge_hf::fused_linear_backward", mutates_args=(), tags=_TAGS_OF_OPS)
def fused_linear_backward(x: Tensor, dy: Tensor, tag: Tensor, layer_id: int, need_dx: bool) -> Tensor:
    """dX (empty unless ``need_dx``) from the weight before its update, then the fused step
    with dY^T X: FusedWeightFunction's backward, consumers checked by the call's tag."""
    layer = layer_of(layer_id)
    calls = _CALLS.get(layer, ())
    mine = tag.untyped_storage()
    call = next((c for c in calls if c[0]() is mine), None)
    if call is not None and call[1]:
        raise RuntimeError(
            f"backward ran twice through {layer.forge_name}, whose weight was already stepped "
            "in the first one (retain_graph=True?): exclude it from patch_model so its "
            "gradient accumulates for an ordinary optimizer"
        )
    w = layer.forge_weight_view()
    n_out, n_in = w.shape
    # dX must be formed from the weight before this step's update (paper Remark 1).
    dx = dy @ w.to(dy.dtype) if need_dx else dy.new_empty(0)
    # The anchor's AccumulateGrad stands for the weight: not executed under
    # autograd.grad(outputs, inputs) that leaves the weight out, so no step then.
    if layer.weight.requires_grad and _anchor_in_this_backward(layer):
        reason = _conflict(layer, [c for c in calls if c is not call])
        if reason:
            layer.forge_fall_back(reason)
        stepped = layer.forge_consume_gradient(x.reshape(-1, n_in), dy.reshape(-1, n_out), node=None)
        if call is not None:
            call[1] = stepped
    return dx


@fused_linear_backward.register_fake
def _(x, dy, tag, layer_id, need_dx):
    return dy.new_empty(x.shape) if need_dx else dy.new_empty(0)


# Never dropped as dead code, never reordered with another fused step.
torch.library._register_effectful_op("forge_hf::fused_linear_backward", EffectType.ORDERED)


_ANCHORS: tuple = (None, {})  # (the running compiled backward node, id(leaf) -> its AccumulateGrad)


def _anchor_in_this_backward(layer: nn.Module) -> bool:
    """Whether the running backward executes the AccumulateGrad of ``layer``'s anchor (an
    input of the compiled graph's backward node; its edges are indexed once per node)."""
    global _ANCHORS
    node = torch._C._current_autograd_node()
    if node is None:  # called outside a backward: nothing to leave out
        return True
    ref, accumulators = _ANCHORS
    if ref is None or ref() is not node:
        accumulators = {id(fn.variable): fn for fn, _ in node.next_functions if hasattr(fn, "variable")}
        _ANCHORS = (weakref.ref(node), accumulators)
    acc = accumulators.get(id(layer.__dict__.get("_forge_anchor")))
    return acc is None or torch._C._will_engine_execute_node(acc)


def _conflict(layer: nn.Module, other_calls: list) -> str | None:
    """Why the weight must not be stepped in this backward, or None: the checks of
    FusedWeightMixin.forge_conflict that hold without the graph's nodes. A gradient from
    another reader of the weight is caught by the weight's hook, as in eager."""
    if not layer.forge_enabled:
        return None
    if layer.weight.grad is not None:
        return "its weight already holds a gradient (.grad was set outside the module)"
    # Without nodes, any other call whose graph is alive counts, in this backward or not.
    if any(call[0]() is not None for call in other_calls):
        return ("the module is called more than once in this step (under torch.compile: another "
                "forward call of it still holds its autograd graph)")
    return None
