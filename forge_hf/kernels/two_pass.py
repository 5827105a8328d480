"""The two-pass path's weight gradient: cuBLAS forms a layer's whole fp32 gradient
dY^T X into a scratch buffer shared by every layer on the device (GradientScratch), for the
Triton kernel's rule pass to step from (dispatch.py binds the two). How the buffer grows
and survives CUDA-graph captures: docs/kernels.md.
"""

from __future__ import annotations

import weakref

import torch

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def is_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class GradientScratch:
    """One device's fp32 gradient buffer: grown to the largest (rows, cols) asked for, never
    shrunk; ``allocations`` counts its growths."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.buffer: torch.Tensor | None = None
        self.allocations = 0
        self._captured = False
        self._outgrown: list[torch.Tensor] = []  # buffers a captured graph still writes
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (rows, cols) -> view of the buffer
        self.reserved = 0  # elements a captured step will need (reserve)
        self._holders = weakref.WeakSet()  # launches that keep a view of the buffer (forget_last)

    def view(self, rows: int, cols: int) -> torch.Tensor:
        """A (rows, cols) fp32 view of the buffer's first rows * cols elements."""
        need = rows * cols
        capturing = is_capturing(self.device)
        if self.buffer is None or self.buffer.numel() < need:
            if capturing:
                have = 0 if self.buffer is None else self.buffer.numel()
                raise RuntimeError(
                    f"the two-pass weight gradient of a ({rows}, {cols}) layer needs a {need}-element scratch "
                    f"buffer on {self.device} and a CUDA graph is being captured with {have} elements allocated: "
                    "a capture cannot grow it. Run a step eagerly first (GraphedStep's warm-up steps do), or "
                    "set FORGE_HF_WGRAD=fused")
            self._grow(need)
        if capturing:
            self._captured = True
            return self.buffer[:need].view(rows, cols)
        view = self._views.get((rows, cols))  # made once a shape: a view costs host time at every layer
        if view is None:
            view = self._views[(rows, cols)] = self.buffer[:need].view(rows, cols)
        return view

    def keep_viewed_by(self, holder) -> None:
        """``holder`` keeps a view of the buffer between its calls: ``holder.forget_last()``
        lets go of it when the buffer is replaced, so that the old one is freed."""
        self._holders.add(holder)

    def reserve(self, numel: int) -> None:
        """A captured step will need ``numel`` elements: grow_reserved_scratch grows the buffer
        before the capture (eager steps that never use it allocate nothing)."""
        self.reserved = max(self.reserved, numel)

    def _grow(self, numel: int) -> None:
        old, self.buffer = self.buffer, None
        if old is not None:
            if self._captured:
                self._outgrown.append(old)
            elif self.device.type == "cuda":
                # The buffer may have served layers on another stream than the one it was
                # allocated on; once they finish, freeing it cannot race them (a rare wait:
                # only when a larger layer first takes this path).
                torch.cuda.synchronize(self.device)
        self._views.clear()
        for holder in list(self._holders):
            holder.forget_last()
        del old  # back to the allocator before the larger block is taken
        self.buffer = torch.empty(numel, dtype=torch.float32, device=self.device)
        self.allocations += 1

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * 4


_SCRATCH: dict[torch.device, GradientScratch] = {}


def scratch_for(device: torch.device | str) -> GradientScratch:
    """The gradient buffer every two-pass layer on ``device`` shares."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    scratch = _SCRATCH.get(device)
    if scratch is None:
        scratch = _SCRATCH[device] = GradientScratch(device)
    return scratch


def grow_reserved_scratch() -> None:
    """Before a capture: every device's buffer grown to what its layers reserved."""
    for scratch in _SCRATCH.values():
        have = 0 if scratch.buffer is None else scratch.buffer.numel()
        if scratch.reserved > have:
            scratch._grow(scratch.reserved)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32) = a @ b, products summed in fp32."""
    if a.dtype == b.dtype == torch.float32:
        # on CUDA this follows torch's fp32 matmul precision (TF32 where allowed)
        return torch.mm(a, b, out=out)
    if a.is_cuda and a.dtype == b.dtype and a.dtype in _HALF_DTYPES:
        return torch.mm(a, b, torch.float32, out=out)  # cuBLAS: 16-bit inputs, fp32 accumulation and output
    # CPU has no mixed-dtype mm; 16-bit values are exact in fp32, so the products are the same
    return torch.mm(a.float(), b.float(), out=out)


def addmm_fp32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32) += a @ b, products summed in fp32, in place."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in _HALF_DTYPES:
        return torch.addmm(out, a, b, torch.float32, out=out)  # cuBLAS adds into out (beta=1)
    return out.addmm_(a.float(), b.float())


def weight_gradient(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor,
                    scratch: GradientScratch) -> torch.Tensor:
    """dY^T X as an (N, K) fp32 view of the scratch buffer, laid out as ``weight`` is (a
    column-major weight, Conv1D's, gets a column-major gradient: the rule's loads of the two
    tiles then walk memory the same way)."""
    n, k = weight.shape
    if weight.stride(0) < weight.stride(1):
        return matmul_fp32(x.t(), dy, scratch.view(k, n)).t()
    return matmul_fp32(dy.t(), x, scratch.view(n, k))
