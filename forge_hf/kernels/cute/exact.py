"""Exact fp32 arithmetic for the CuTe epilogues: values whose +, -, * are single PTX ``.rn``
operations (never contracted to FMA, as the Triton launches' enable_fp_fusion=False), whose /
and sqrt are the instructions Triton emits, and whose comparisons and selects are Triton's
ordered compares and selects, so traced Python expressions give the Triton kernels' bits.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import cutlass
from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ...core import rounding, rules


def _asm(ptx: str, constraints: str, values, loc, ip, result=None):
    operands = [v.ir_value(loc=loc, ip=ip) for v in values]
    return llvm.inline_asm(result or T.f32(), operands, ptx, constraints,
                           has_side_effects=False, is_align_stack=False)


def _binary(op: str):
    """``op``.f32 of two fp32 values as one PTX instruction (a static method of Ptx)."""
    @dsl_user_op
    def apply(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
        return Float32(_asm(f"{op}.f32 $0, $1, $2;", "=f,f,f", (a, b), loc, ip))

    apply.__name__ = op.replace(".", "_")
    return staticmethod(apply)


class Ptx:
    """The epilogues' PTX instructions, reached only as attributes of ``PTX`` (an instance).

    QuACK keys each epilogue by walking its function's globals and closures. A
    ``dsl_user_op`` wrapper is a function whose code lives in cutlass (_mlir_helpers/op.py):
    QuACK fingerprints it by name when cutlass sits under a ``site-packages`` folder, but
    recurses into its globals, and stops with a TypeError at cutlass's ``_LOC_TRANSFORMS``
    ContextVar, when cutlass is imported from anywhere else (``pip install --target DIR``).
    So no function the walk visits names a wrapper as a global: it meets ``PTX``, keyed by
    ``__quack_semantic_key__`` (the sources the traced math comes from), and stops there.
    """

    __slots__ = ()

    def __quack_semantic_key__(self):
        return ("forge_hf.kernels.cute", SOURCE_DIGEST)

    mul_rn = _binary("mul.rn")
    add_rn = _binary("add.rn")
    sub_rn = _binary("sub.rn")

    # Division and square root as Triton 3.6 lowers them (div.full, sqrt.approx.ftz): the other
    # kernels' bits, and far fewer instructions than the IEEE forms
    div_full = _binary("div.full")
    # the correctly rounded division (tl.div_rn): the 8-bit codecs' one division a block
    div_rn = _binary("div.rn")

    @staticmethod
    @dsl_user_op
    def sqrt_approx(a: Float32, *, loc=None, ip=None) -> Float32:
        return Float32(_asm("sqrt.approx.ftz.f32 $0, $1;", "=f,f", (a,), loc, ip))

    @staticmethod
    @dsl_user_op
    def f32_bits(a: Float32, *, loc=None, ip=None) -> Uint32:
        return Uint32(_asm("mov.b32 $0, $1;", "=r,f", (a,), loc, ip, result=T.i32()))

    @staticmethod
    @dsl_user_op
    def bits_f32(a: Uint32, *, loc=None, ip=None) -> Float32:
        return Float32(_asm("mov.b32 $0, $1;", "=f,r", (a,), loc, ip))


PTX = Ptx()

# What the epilogues' traced math is made of beyond QuACK: this folder's epilogue sources (the
# PTX strings, the step, the 8-bit codes), the rules and the rounding hash. Any edit to them
# changes every epilogue's key.
_HERE = Path(__file__).parent
SOURCE_DIGEST = hashlib.sha256(b"".join(Path(f).read_bytes() for f in (
    __file__, _HERE / "wgrad_epilogue.py", _HERE / "block_codes.py", rounding.__file__, rules.__file__))).hexdigest()


def as_f32(x):
    return x.v if isinstance(x, Exact) else Float32(x)


class Exact:
    """An fp32 value whose operators are single PTX instructions, so the rule's Python
    expressions give the Triton kernel's bits. Python numbers mix in as fp32 constants.
    Comparisons are ordered (false against NaN), as Triton's on floats."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = Float32(v)

    def __add__(self, o):
        return Exact(PTX.add_rn(self.v, as_f32(o)))

    __radd__ = __add__

    def __mul__(self, o):
        return Exact(PTX.mul_rn(self.v, as_f32(o)))

    __rmul__ = __mul__

    def __sub__(self, o):
        return Exact(PTX.sub_rn(self.v, as_f32(o)))

    def __rsub__(self, o):
        return Exact(PTX.sub_rn(as_f32(o), self.v))

    def __truediv__(self, o):
        return Exact(PTX.div_full(self.v, as_f32(o)))

    def __rtruediv__(self, o):
        return Exact(PTX.div_full(as_f32(o), self.v))

    def __neg__(self):
        return Exact(-self.v)

    def __gt__(self, o):
        return self.v > as_f32(o)

    def __lt__(self, o):
        return self.v < as_f32(o)

    def __ge__(self, o):
        return self.v >= as_f32(o)

    def __le__(self, o):
        return self.v <= as_f32(o)


def where(cond, a, b):
    """tl.where on fp32 values: ``a`` where ``cond`` holds, else ``b`` (one select; both sides
    are computed, as in the Triton kernel)."""
    return Exact(cutlass.select_(cond, as_f32(a), as_f32(b)))
