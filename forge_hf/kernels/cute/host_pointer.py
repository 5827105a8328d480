"""The host side of an epilogue op handed a CUDA fp32 tensor, which the kernel gets as a
device pointer, or a number, which it gets as an ignored immediate (the op's kernel is then
compiled without the pointer's uses): tile_stats.py's statistics, block_codes.py's metadata."""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Float32
from cutlass.cute.runtime import make_ptr
from quack.epilogue.ops import EpiOp


class HostPointerOp(EpiOp):
    """An EpiOp whose kernel parameter (under its name) is a device pointer or Float32 0."""

    def host_arg_key(self, value):
        if value is None:
            return None
        return ("pointer",) if isinstance(value, torch.Tensor) else ("off",)

    def host_fake_arg(self, key, fctx):
        if key[0] == "pointer":
            return make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=4)
        return Float32(0.0)

    def host_call_arg(self, value, key):
        return value.data_ptr() if key[0] == "pointer" else Float32(0.0)

    def arg_spec_type(self, const=False):
        return Float32 | cute.Tensor | None

    def param_fields(self):
        return [(self.name, object, None)]

    def to_params(self, gemm, args):
        return {self.name: getattr(args, self.name)}
