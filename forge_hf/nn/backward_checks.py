"""What a fused layer's backward does the same way eagerly (nn/linear.py) and under
torch.compile (nn/compiled_linear.py): refuse a second backward through a step already
taken, and form dX from the weight before this step's update (the FORGE paper, Remark 1)."""

from __future__ import annotations

import torch


def refuse_second_backward(layer, stepped: bool) -> None:
    if stepped:
        raise RuntimeError(
            f"backward ran twice through {layer.forge_name}, whose weight was already stepped "
            "in the first one (retain_graph=True?): exclude it from patch_model so its "
            "gradient accumulates for an ordinary optimizer"
        )


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # .to() costs host time even when it returns t


def input_gradient(layer, dy: torch.Tensor) -> torch.Tensor:
    """dY @ W, with W as it is before this step's fused update."""
    return dy @ as_dtype(layer.forge_weight_view(), dy.dtype)
