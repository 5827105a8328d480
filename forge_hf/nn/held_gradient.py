"""A fused layer's weight gradient held until the optimizer step, for exact gradient
accumulation and exact global-norm clipping (ForgeOptimizer(accumulate=..., max_grad_norm=...)).

While the optimizer holds updates, a fused layer's backward does not step its weight: it
keeps what the step needs, one of three ways (ForgeConfig.accumulation), and
ForgeOptimizer.step runs the step from it.

- ``stash``, the token stash: each backward's layer input and output gradient, as they are (no
  copy: inputs several layers read, such as q/k/v's, are one tensor held by each). The step runs
  the fused kernel once over every held token: no weight gradient is ever formed.
- ``buffer``, the fp32 buffer (the FORGE paper's Appendix L): the weight gradient summed in fp32
  at each backward, the rule applied from it at the step. Exact.
- ``bf16_buffer`` (bf16 weights only): a bf16 weight gradient, each backward's sum formed in
  fp32 a band of rows at a time and added rounded stochastically (held_buffer.py): unbiased,
  2 bytes a parameter, the bytes of the bf16 gradient a plain Trainer keeps.

``auto`` (the default) never holds more than the plain Trainer's gradient of the layer would
take, weight.numel() * weight.element_size() bytes (``trainer_bytes``): it stashes while the
stash's rows take no more, and past that moves to the fp32 buffer where it fits the bound (fp32
weights: exact, 4 bytes a parameter) and to the bf16 buffer where it does not (bf16 weights).
Under forge's data parallelism a layer holds every rank's tokens in its stash (its step takes
a band of the weight from them): no buffer there. A norm of the held gradient (for clipping)
costs the stash one more weight-gradient GEMM, formed a band of rows at a time.
"""

from __future__ import annotations

import torch

from ..kernels import matmul_fp32, reference_fused_update, resolve_backend
from .held_buffer import AddCounts, RoundedSums, add_products, squared_sum

NORM_CHUNK = 1 << 24  # fp32 entries of the gradient formed at once for a stash's norm
BUFFER_MODES = ("buffer", "bf16_buffer")


def trainer_bytes(in_features: int, out_features: int, weight_dtype: torch.dtype) -> int:
    """The bound ``auto`` holds a layer to: its weight gradient in the weight's dtype, as a plain
    Trainer keeps it."""
    return in_features * out_features * weight_dtype.itemsize


def buffer_dtype(mode: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The buffer a layer moves to: fp32 for ``buffer``, and under ``auto`` where it fits the
    Trainer's bound (fp32 weights); else the weight's bf16."""
    if mode == "buffer" or (mode == "auto" and weight_dtype.itemsize >= 4):
        return torch.float32
    return torch.bfloat16


class HeldGradient:
    """What one fused layer holds of its weight gradient until the optimizer step.
    ``weight_dtype`` sets auto's bound (trainer_bytes); ``rounded``: the bf16 buffer's
    rounding stream (held_for makes one from the layer)."""

    def __init__(self, mode: str = "auto", weight_dtype: torch.dtype = torch.float32,
                 rounded: RoundedSums | None = None):
        self.mode = mode  # ForgeConfig.accumulation, validated there
        self.weight_dtype = weight_dtype
        self.rounded = rounded if rounded is not None else RoundedSums(0, kernel=False)
        self.stash: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tokens x in, tokens x out) pairs
        self.buffer: torch.Tensor | None = None  # (out, in): fp32, or bf16 rounded stochastically
        self.tokens = 0  # tokens held since the last step
        self.stash_bytes = 0  # the stash's rows, this layer's (an input other layers hold counted too)
        self.gathered = False  # the stash holds every rank's tokens (data parallel)

    @property
    def empty(self) -> bool:
        return not self.stash and self.buffer is None

    def add(self, x2: torch.Tensor, dy2: torch.Tensor, gathered: bool = False) -> None:
        """Hold one backward's contribution ``dy2^T x2``. ``gathered``: every rank's tokens and
        this rank's rows of a data-parallel layer, which only a stash holds (its step takes a
        band of the weight and shares it)."""
        if gathered and self.mode in BUFFER_MODES:
            raise RuntimeError(f"accumulation={self.mode!r} is not supported with forge's data parallelism: a band "
                               "of rows is stepped from the gathered tokens; use accumulation='stash' or 'auto'")
        self.gathered = gathered
        self.tokens += x2.shape[0]
        if self.buffer is not None:
            add_products(self.buffer, [(x2, dy2)], self.rounded)
            return
        rows = x2.numel() * x2.element_size() + dy2.numel() * dy2.element_size()
        bound = trainer_bytes(x2.shape[1], dy2.shape[1], self.weight_dtype)
        if self.mode == "stash" or gathered or (self.mode == "auto" and self.stash_bytes + rows <= bound):
            self.stash.append((x2, dy2))
            self.stash_bytes += rows
            return
        self.buffer = torch.empty(dy2.shape[1], x2.shape[1], dtype=buffer_dtype(self.mode, self.weight_dtype),
                                  device=x2.device)
        pairs, self.stash, self.stash_bytes = [*self.stash, (x2, dy2)], [], 0
        add_products(self.buffer, pairs, self.rounded, fresh=True)  # a bf16 buffer rounds them once

    def tokens_and_gradients(self, joined: dict | None = None,
                             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stash as one (tokens, in) and one (tokens, out) tensor, concatenated once: the
        clip's norm and the step read the same pair. ``joined`` (one optimizer step's) keeps
        an input several layers hold (q/k/v's, gate/up's) concatenated once for all of them.
        ``scale`` (clipping's factor) multiplies the narrower of the two, rounded once more:
        the pair's product is then the scaled gradient."""
        x2, dy2 = self._joined(joined)
        if scale is None:
            return x2, dy2
        if x2.shape[1] < dy2.shape[1]:
            return (x2.float() * scale.to(x2.device)).to(x2.dtype), dy2
        return x2, (dy2.float() * scale.to(dy2.device)).to(dy2.dtype)

    def _joined(self, joined: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.stash) > 1:
            xs = [x for x, _ in self.stash]
            key = tuple(id(x) for x in xs)  # safe: every layer's stash keeps its tensors alive until its turn
            x2 = joined.get(key) if joined is not None else None
            if x2 is None:
                x2 = torch.cat(xs)
                if joined is not None:
                    joined[key] = x2
            self.stash = [(x2, torch.cat([dy for _, dy in self.stash]))]
        return self.stash[0]

    def squared_norm(self, joined: dict | None = None, grams: dict | None = None) -> torch.Tensor:
        """The held gradient's squared Frobenius norm, fp32 (0-dim). ``joined`` as for
        tokens_and_gradients; ``grams`` keeps the last input's tokens x tokens product for the
        next layer that reads the same input."""
        if self.buffer is not None:
            return squared_sum(self.buffer)
        x2, dy2 = self.tokens_and_gradients(joined)
        tokens, k, n = x2.shape[0], x2.shape[1], dy2.shape[1]
        if tokens * (k + n) < k * n:
            # |dY^T X|^2 = <X X^T, dY dY^T>: two tokens x tokens products take fewer operations
            # than the gradient (Llama-3.1-8B's MLP at 2048 tokens: 0.56 of them) and no bands
            gx, gy = gram(x2, grams), gram(dy2)
            return torch.dot(gx.view(-1), gy.view(-1))
        total = torch.zeros((), dtype=torch.float32, device=x2.device)
        rows = min(n, max(1, NORM_CHUNK // max(k, 1)))
        band = torch.empty(rows, k, dtype=torch.float32, device=x2.device)
        for r0 in range(0, n, rows):
            # 16-bit rows on the tensor cores, products summed in fp32: the same gradient the
            # fused kernel forms, at cuBLAS's speed (fp32 copies of them would leave the tensor cores)
            g = matmul_fp32(dy2[:, r0:r0 + rows].t(), x2, band[:min(rows, n - r0)]).view(-1)
            total += torch.dot(g, g)
        return total

    def clear(self) -> None:
        self.stash, self.buffer, self.tokens, self.stash_bytes = [], None, 0, 0

    def snapshot(self) -> tuple:
        """What it holds now, to go back to (``restore``) should a backward that adds to it not run."""
        return list(self.stash), self.buffer, self.tokens, self.stash_bytes, self.gathered

    def restore(self, snapshot: tuple) -> None:
        stash, self.buffer, self.tokens, self.stash_bytes, self.gathered = snapshot
        self.stash = list(stash)

    def nbytes(self) -> int:
        """Bytes held: the stash's rows (a tensor several layers hold counted here too), or the buffer."""
        if self.buffer is not None:
            return self.buffer.numel() * self.buffer.element_size()
        return self.stash_bytes


def held_for(layer, mode: str, counts: AddCounts | None = None) -> HeldGradient:
    """The HeldGradient of fused ``layer`` under ForgeConfig.accumulation ``mode``: its bound
    from the weight's dtype, a bf16 buffer's stream keyed by the layer's salt and counted by
    ``counts`` (one optimizer's layers share them), rounded by the layer's backend (the Triton
    kernel where it steps by Triton)."""
    weight = layer.forge_weight_view()
    if mode == "bf16_buffer" and weight.dtype != torch.bfloat16:
        raise ValueError(f"accumulation='bf16_buffer' rounds {layer.forge_name}'s held gradient to bf16, but its "
                         f"weight is {weight.dtype}, whose exact fp32 buffer takes no more than its own gradient: "
                         "use accumulation='buffer' or 'auto'")
    kernel = resolve_backend(layer.forge_config.backend, weight.device) is not reference_fused_update
    return HeldGradient(mode, weight.dtype, RoundedSums(layer.forge_salt(), kernel, counts))


def gram(rows: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
    """rows @ rows^T in fp32 (16-bit products summed in fp32); ``cache`` holds the last one,
    with the tensor it was formed from (so the tensor's id is not reused meanwhile)."""
    if cache is not None and cache.get("rows") is rows:
        return cache["gram"]
    out = matmul_fp32(rows, rows.t(), torch.empty(rows.shape[0], rows.shape[0], dtype=torch.float32,
                                                  device=rows.device))
    if cache is not None:
        cache.update(rows=rows, gram=out)
    return out
