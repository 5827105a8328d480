"""ForgeEmbedding: an input embedding whose weight gets no dense gradient. Its backward sums
the output gradient of the rows the batch looked up into a compact buffer
(nn/compact_rows.py: at most one row a token, never vocab x hidden), held on the module until
``ForgeOptimizer.step()`` steps every row from it (optim/embedding_step.py).

Why at ``step()`` and not inside backward, as the fused linears: the dense path it stands
for steps there, after clipping and after every micro-batch of an accumulated step, so
holding the compact rows until then keeps each case exact (the rows of several backwards
are summed as ``grad += new`` would; clipping scales them and counts them in the norm), and
the embedding's backward is the last of the step anyway, so stepping there saves nothing.

The lookup and its backward are torch.library custom ops, run eagerly and traced by
torch.compile alike (as nn/compiled_linear.py's): the weight is read inside, out of the
autograd graph, and the backward returns an empty gradient to the layer's anchor, which
keeps the op in the graph. Until a ForgeOptimizer takes the layer (``forge_owner``), and
whenever it cannot (``forge_off``), the module is a plain nn.Embedding.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .compact_rows import CompactRows, add_rows, compact_rows
from .compiled_linear import layer_of, new_anchor

_OP_TAGS = (torch.Tag.cudagraph_unsafe,)


class ForgeEmbedding(nn.Embedding):
    """nn.Embedding whose gradient is the compact rows ``forge_rows`` (None: no backward
    since the last step). Made by patch_model (``forge_adopt``) from a plain nn.Embedding."""

    forge_rows: CompactRows | None = None
    forge_owner = None  # a weak reference to the ForgeOptimizer that steps it: only then is its gradient compact
    forge_off_reason: str | None = None  # why it is a plain embedding for good (forge_off)

    @classmethod
    def forge_adopt(cls, module: nn.Embedding, name: str) -> ForgeEmbedding:
        """``module`` itself, now of this class: its Parameter, hooks and attributes kept."""
        module.__class__ = cls
        module.forge_name = name
        module._forge_anchor = new_anchor(module)  # made before any trace: torch.compile finds the layer by it
        return module

    def forge_release(self) -> nn.Embedding:
        """Back to a plain nn.Embedding, forge's attributes dropped."""
        for key in [k for k in self.__dict__ if k.lstrip("_").startswith("forge_")]:
            del self.__dict__[key]
        self.__class__ = nn.Embedding
        return self

    def forge_off(self, reason: str) -> None:
        """The ordinary path from now on: the weight gets a dense gradient."""
        self.forge_off_reason = reason
        self.forge_rows = None

    def forge_take(self, owner) -> None:
        """``owner`` (a ForgeOptimizer) steps it from now on, from its compact rows."""
        self.forge_owner = weakref.ref(owner)

    def forge_active(self) -> bool:
        owner = self.forge_owner
        return (owner is not None and owner() is not None and self.forge_off_reason is None
                and torch.is_grad_enabled() and self._parameters["weight"].requires_grad)

    def forge_add_rows(self, ids: Tensor, dy: Tensor) -> None:
        """The backward of a lookup: its compact rows added to those held."""
        w = self.weight
        new = compact_rows(ids, dy, w.shape[0], self.padding_idx, w.dtype)
        self.forge_rows = add_rows(self.forge_rows, new)

    def forward(self, ids: Tensor) -> Tensor:
        if not self.forge_active():
            return super().forward(ids)
        anchor = self.__dict__.get("_forge_anchor")
        if anchor is None or anchor.device != self.weight.device:
            return _forward_eagerly(self, ids)
        return sparse_embedding(ids, anchor, self.weight.shape[1], self.weight.dtype)

    def __getstate__(self):
        # a copy has its own anchor, and is plain until a ForgeOptimizer takes it
        state = dict(self.__dict__)
        for key in ("_forge_anchor", "forge_owner", "forge_rows"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        nn.Module.__setstate__(self, state)
        self._forge_anchor = new_anchor(self)

    def extra_repr(self) -> str:
        state = "compact gradient" if self.forge_off_reason is None else f"ordinary path: {self.forge_off_reason}"
        return f"{super().extra_repr()}, {state}"


@torch.compiler.disable
def _forward_eagerly(layer: ForgeEmbedding, ids: Tensor) -> Tensor:
    """A layer moved to another device: a new anchor there, made outside any trace."""
    layer._forge_anchor = new_anchor(layer)
    return sparse_embedding(ids, layer._forge_anchor, layer.weight.shape[1], layer.weight.dtype)


@torch.library.custom_op("forge_hf::sparse_embedding", mutates_args=(), tags=_OP_TAGS)
def sparse_embedding(ids: Tensor, anchor: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """The rows of the anchor's layer's weight at ``ids``."""
    return F.embedding(ids, layer_of(anchor).weight.detach())


@sparse_embedding.register_fake
def _(ids, anchor, dim, dtype):
    return ids.new_empty(*ids.shape, dim, dtype=dtype)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])


def _backward(ctx, dy):
    ids, anchor = ctx.saved_tensors
    return None, sparse_embedding_backward(ids, dy, anchor), None, None


sparse_embedding.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("forge_hf::sparse_embedding_backward", mutates_args=(), tags=_OP_TAGS)
def sparse_embedding_backward(ids: Tensor, dy: Tensor, anchor: Tensor) -> Tensor:
    """Hold the lookup's compact rows on the layer; the anchor's gradient is empty."""
    layer_of(anchor).forge_add_rows(ids, dy)
    return anchor.new_empty(0)


@sparse_embedding_backward.register_fake
def _(ids, dy, anchor):
    return anchor.new_empty(0)
