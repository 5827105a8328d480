"""Host-to-device copies of small tables through pinned host buffers used in turn: a buffer
is written again only after its last copy has left it (an event), so the host never waits
for the GPU to catch up except on a buffer still in flight. And the order of the streams
whose kernels read such a table (StreamOrder)."""

from __future__ import annotations

import numpy as np
import torch


class PinnedRing:
    """``host = ring.take(rows)``: a writable (numpy) view of the next buffer's ``rows``;
    then ``ring.send(dest)`` copies those rows into the device tensor ``dest`` without
    blocking the host. On a CPU device the buffers are ordinary memory and copies are plain."""

    BUFFERS = 2

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device):
        self._cuda = device.type == "cuda"
        self._hosts = [torch.zeros(rows, cols, dtype=dtype, pin_memory=self._cuda) for _ in range(self.BUFFERS)]
        self._copied: list = [None] * self.BUFFERS
        self._next = 0
        self._taken: tuple[int, torch.Tensor] | None = None

    def take(self, rows: slice) -> np.ndarray:
        b = self._next
        self._next = (b + 1) % self.BUFFERS
        if self._copied[b] is not None:
            self._copied[b].synchronize()  # its last copy has left: it may be written again
        host = self._hosts[b][rows]
        self._taken = (b, host)
        return host.numpy()

    def send(self, dest: torch.Tensor) -> None:
        b, host = self._taken
        self._taken = None
        dest.copy_(host, non_blocking=self._cuda)
        if self._cuda:
            self._copied[b] = torch.cuda.Event()
            self._copied[b].record()


class StreamOrder:
    """``follow()`` before writing or reading a device table that is rewritten in place: on a
    switch of CUDA stream the new stream first waits for the old one, whose kernels may not
    have read the table yet nor its last copy have landed."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = None  # the stream of the last follow(), and its raw handle
        self._raw = None

    def follow(self) -> None:
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        if raw != self._raw:
            stream = torch.cuda.current_stream(self.device)
            if self._stream is not None:
                stream.wait_stream(self._stream)
            self._stream, self._raw = stream, raw
