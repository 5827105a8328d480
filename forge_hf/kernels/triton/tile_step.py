"""Triton: what both fused kernels do the same way at each tile's step: read the step's
arguments (runtime/launch_args.py packs them) and test a gradient tile for finiteness.
Gluon kernels call these jit functions as they are."""

import triton
import triton.language as tl


@triton.jit
def _scalar(args_ptr, i: tl.constexpr):
    return tl.load(args_ptr + i).to(tl.float32, bitcast=True)


@triton.jit
def load_step_args(args_ptr):
    """The step's arguments (runtime/launch_args.py): the rule's 12 constants as a tuple, the step,
    the rounding salt and the index of the weight's first row in the whole weight."""
    c = (_scalar(args_ptr, 0), _scalar(args_ptr, 1), _scalar(args_ptr, 2), _scalar(args_ptr, 3),
         _scalar(args_ptr, 4), _scalar(args_ptr, 5), _scalar(args_ptr, 6), _scalar(args_ptr, 7),
         _scalar(args_ptr, 8), _scalar(args_ptr, 9), _scalar(args_ptr, 10), _scalar(args_ptr, 11))
    step = tl.load(args_ptr + 12).to(tl.uint32, bitcast=True)
    salt = tl.load(args_ptr + 13).to(tl.uint32, bitcast=True)
    row0 = tl.load(args_ptr + 14)
    return c, step, salt, row0


@triton.jit
def finite_sumsq(acc):
    """A gradient tile's squared sum, and whether the tile may be applied (applicable)."""
    sumsq = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
    return sumsq, applicable(sumsq)


@triton.jit
def applicable(sumsq):
    """Whether a gradient tile with this squared sum may be applied: one whose squared sum is
    not finite (a NaN or inf in it, or an entry beyond ~1e19 whose square overflows) is
    counted and skipped; others add their squared sum to the grad norm."""
    return (sumsq == sumsq) & (sumsq < float("inf"))
