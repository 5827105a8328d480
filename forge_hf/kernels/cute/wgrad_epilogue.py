"""The fused step as an epilogue of QuACK's sm90 GEMM: dW = dY^T X formed by QuACK's
persistent warp-specialised wgmma engine (ping-pong: one consumer warpgroup runs its tile's
epilogue while the other runs MMAs), the rule applied to each accumulator subtile, and only
the new weight and state tiles stored, in place. Imported only through ``cute.load()``.

The GEMM: M = out features, N = in features, K = tokens. A = dY^T (out axis contiguous:
M-major), B = X as (tokens, in) (N-major), D = the weight (out, in), row-major. QuACK's TMA
loads the weight as the GEMM's C operand and the two moments as full-tile epilogue loads;
the weight is stored as D and the moments as tile outputs over the same memory (each tile is
read before it is written, by the one CTA that owns it).

Same arithmetic as the other kernels: the rule's code object (core/rules.py) runs on values
whose +, -, * are single PTX ``.rn`` operations (never contracted to FMA, as the Triton
launches' enable_fp_fusion=False) and whose / and sqrt are the instructions Triton emits, and
bf16 stores round in the integer domain with core/rounding.py's hash. The value handed to QuACK's bf16 store has
its low 16 bits cleared already, so its own round-to-nearest conversion is exact.

The rolled epilogue also skips tiles with a non-finite gradient and sums the squared gradient
(tile_stats.py: per 128 x 128 CTA tile, where the Triton kernel tests 64 x 64 blocks).
Not yet: 8-bit states, rules other than AdamW.
"""

from __future__ import annotations

import hashlib
import types
from pathlib import Path

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from quack.epilogue import gemm_epilogue
from quack.epilogue.ops import Scalar
from quack.gemm_config import GemmConfig

from ...core import rounding, rules
from ...core.rules import NUM_SCALARS, RULES, bind_update
from . import tile_stats
from .rolled import rolled_epilogue

# ------------------------------------------------------------------ exact fp32 arithmetic


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

# What the epilogues' traced math is made of beyond their own source: this file (Exact, the
# PTX strings), the rules and the rounding hash. Any edit to them changes every epilogue's key.
SOURCE_DIGEST = hashlib.sha256(b"".join(
    Path(f).read_bytes() for f in (__file__, rounding.__file__, rules.__file__))).hexdigest()


def _f32(x):
    return x.v if isinstance(x, Exact) else Float32(x)


class Exact:
    """An fp32 value whose operators are single PTX instructions, so the rule's Python
    expressions give the Triton kernel's bits. Python numbers mix in as fp32 constants."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = Float32(v)

    def __add__(self, o):
        return Exact(PTX.add_rn(self.v, _f32(o)))

    __radd__ = __add__

    def __mul__(self, o):
        return Exact(PTX.mul_rn(self.v, _f32(o)))

    __rmul__ = __mul__

    def __sub__(self, o):
        return Exact(PTX.sub_rn(self.v, _f32(o)))

    def __rsub__(self, o):
        return Exact(PTX.sub_rn(_f32(o), self.v))

    def __truediv__(self, o):
        return Exact(PTX.div_full(self.v, _f32(o)))

    def __rtruediv__(self, o):
        return Exact(PTX.div_full(_f32(o), self.v))

    def __neg__(self):
        return Exact(-self.v)


# The rules' free name ``ops`` (a module: QuACK fingerprints what an epilogue references)
RULE_OPS = types.ModuleType("forge_hf.kernels.cute.rule_ops")
RULE_OPS.sqrt = lambda x: Exact(PTX.sqrt_approx(_f32(x)))
RULE_UPDATES = {name: bind_update(rule, RULE_OPS) for name, rule in RULES.items()}

# core/rounding.py's hash on Uint32 values (multiplication wraps modulo 2**32)
HASH = types.ModuleType("forge_hf.kernels.cute.hash_ops")
HASH.mul32 = lambda h, c: h * Uint32(c)
rounding.bind_hash(HASH)


def round_to_bf16(x: Exact, h, slot: int, stochastic: bool) -> Float32:
    """The fp32 value of x's bf16 rounding (the low 16 bits cleared), as
    kernels/triton/bf16_bits.py:fp32_to_bf16_bits rounds it."""
    bits = PTX.f32_bits(x.v)
    if stochastic:
        bits = bits + HASH.slot_bits(h, slot)
    else:
        bits = bits + (Uint32(0x7FFF) + ((bits >> 16) & Uint32(1)))
    return PTX.bits_f32(bits & Uint32(0xFFFF0000))


# ------------------------------------------------------------------ the element's index


class ElementIndex(Scalar):
    """A value port: each accumulator element's row * K + column inside this launch's weight
    (K: the value passed, the in-features count), congruent with the accumulator fragment.
    The epilogue adds the first row's offset (a data-parallel band) for the rounding hash."""

    fn_port = "value"

    def __init__(self, name):
        super().__init__(name, dtype=Int32)

    @cute.jit
    def begin(self, gemm, param, smem_tensor, ctx):
        k_cols = Int32(param)
        coords = ctx.partition_for_epilogue_fn(cute.make_identity_tensor((ctx.tile_M, ctx.tile_N)))
        if const_expr(ctx.tiled_copy_t2r is not None):
            coords = ctx.tiled_copy_r2s.retile(coords)
        coords = cute.group_modes(coords, 3, cute.rank(coords))
        first = ctx.tile_coord_mnkl[0] * ctx.tile_M * k_cols + ctx.tile_coord_mnkl[1] * ctx.tile_N
        return coords, k_cols, first

    @cute.jit
    def begin_loop(self, gemm, state, epi_coord):
        coords, k_cols, first = state
        here = coords[None, None, None, epi_coord]
        index = cute.make_rmem_tensor(cute.size(here), Int32)
        for i in cutlass.range(cute.size(here), unroll_full=True):
            c = here[i]
            index[i] = first + c[0] * k_cols + c[1]
        return index


# ------------------------------------------------------------------ epilogues

SCALAR_NAMES = tuple(f"c{i}" for i in range(NUM_SCALARS))
INT_OPS = {name: Scalar(name, dtype=Int32) for name in ("step", "salt", "row0", "k_cols")}


def _adamw_epilogue(stochastic: bool, rolled: bool):
    """AdamW with bf16 weight and bf16 moments (c: the weight as QuACK's C operand); ``rolled``:
    its subtiles as a loop (rolled.py) with the tile statistics and skip (tile_stats.py), else
    unrolled as QuACK's driver does, with neither."""
    update = RULE_UPDATES["adamw"]
    epilogue = rolled_epilogue if rolled else gemm_epilogue
    extra_ops = (tile_stats.TileStats("stats"),) if rolled else ()

    @epilogue(outputs=("exp_avg_new", "exp_avg_sq_new"), ops={"elem": ElementIndex("elem"), **INT_OPS},
              extra_ops=extra_ops)
    def adamw_bf16(acc, c, exp_avg, exp_avg_sq, elem, c0, c1, c2, c3, c4, c5, c6,
                   step, salt, row0, k_cols):
        zero = Exact(0.0)
        consts = [Exact(v) for v in (c0, c1, c2, c3, c4, c5, c6)] + [zero] * (NUM_SCALARS - 7)
        w, m, v, _ = update(Exact(c), Exact(acc), Exact(exp_avg), Exact(exp_avg_sq), zero, *consts)
        h = Uint32(0)
        if stochastic:
            index = Uint32(elem) + Uint32(row0) * Uint32(k_cols)
            h = HASH.element_hash(index, Uint32(salt), Uint32(step))
        return {"D": round_to_bf16(w, h, 0, stochastic),
                "exp_avg_new": round_to_bf16(m, h, 1, stochastic),
                "exp_avg_sq_new": round_to_bf16(v, h, 2, stochastic)}

    return adamw_bf16


ADAMW_BF16 = {True: _adamw_epilogue(True, False), False: _adamw_epilogue(False, False)}
ADAMW_BF16_ROLLED = {True: _adamw_epilogue(True, True), False: _adamw_epilogue(False, True)}


@gemm_epilogue()
def plain_wgrad(acc):
    """The engine alone: D = dY^T X (fp32 or bf16, rounded to nearest by QuACK's store)."""
    return {"D": acc}


# ------------------------------------------------------------------ host side


def config(tile_m=128, tile_n=128, cluster_m=2, cluster_n=1, pingpong=True) -> GemmConfig:
    return GemmConfig(tile_m=tile_m, tile_n=tile_n, cluster_m=cluster_m, cluster_n=cluster_n,
                      pingpong=pingpong, is_dynamic_persistent=False)


# 128 x 128 tiles, 2 x 1 clusters, ping-pong: QuACK's sm90 default tile (128 x 192) leaves the
# fused epilogue fewer registers beside the accumulator and measured slower; the probe times others
DEFAULT_CONFIG = config()


def scalar_views(args: torch.Tensor) -> dict:
    """The launch's argument row (core/arg_words.py) as the epilogue's device scalars: the
    rule's fp32 constants, the step, the salt and the first row. Read by the kernel at each
    tile, so a CUDA graph replays with the row's current values."""
    consts = args[:NUM_SCALARS].view(torch.float32)
    views = {name: consts[i:i + 1] for i, name in enumerate(SCALAR_NAMES[:7])}
    views.update(step=args[NUM_SCALARS:NUM_SCALARS + 1], salt=args[NUM_SCALARS + 1:NUM_SCALARS + 2],
                 row0=args[NUM_SCALARS + 2:NUM_SCALARS + 3])
    return views


def _check(x, dy, weight, slots, stats):
    T, K = x.shape
    N = dy.shape[1]
    if tuple(weight.shape) != (N, K) or dy.shape[0] != T:
        raise ValueError(f"shapes: x {tuple(x.shape)}, dy {tuple(dy.shape)}, weight {tuple(weight.shape)}")
    for t in (x, dy, weight, *slots):
        if t.dtype != torch.bfloat16 or not t.is_contiguous():
            raise ValueError("the QuACK epilogue takes contiguous bf16 x, dy, weight and states")
    if N % 8 or K % 8:  # dY^T's token stride is N, X's is K; any token count
        raise ValueError(f"TMA needs 16-byte strides: out ({N}) and in ({K}) features multiples of 8")
    if stats is not None and (stats.dtype != torch.float32 or stats.shape != (2,) or not stats.is_contiguous()
                              or stats.device != weight.device):
        raise ValueError("stats: a contiguous fp32 tensor of 2 on the weight's device")


def fused_adamw_bf16(x, dy, weight, exp_avg, exp_avg_sq, args, stochastic=True, cfg=None, rolled=True,
                     stats=None):
    """One AdamW step of a bf16 weight with bf16 moments, all updated in place: x (T, K),
    dy (T, N), weight and moments (N, K) row-major, args the launch's int32 row; ``rolled``
    runs the epilogue's subtiles as a loop (rolled.py). A CTA tile (the config's tile_m x tile_n)
    whose gradient is not finite is left unchanged (tile_stats.py), as the Triton kernel always
    does with its 64 x 64 blocks; ``stats`` (fp32, 2), where given, gets the applied tiles'
    squared gradient sum and the count of skipped tiles added. The unrolled epilogue
    (``rolled=False``) neither skips nor counts."""
    _check(x, dy, weight, (exp_avg, exp_avg_sq), stats)
    epi_args = dict(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, elem=weight.shape[1], k_cols=weight.shape[1],
                    **scalar_views(args))
    if rolled:
        epi_args["stats"] = tile_stats.OFF if stats is None else stats
    elif stats is not None:
        raise ValueError("stats: only the rolled epilogue records statistics")
    (ADAMW_BF16_ROLLED if rolled else ADAMW_BF16)[bool(stochastic)](
        dy.t(), x, weight, out={"D": weight, "exp_avg_new": exp_avg, "exp_avg_sq_new": exp_avg_sq},
        config=cfg or DEFAULT_CONFIG, tuned=False, **epi_args)


def wgrad(x, dy, out, cfg=None):
    """out = dY^T X on the engine alone (out: (N, K), fp32 or bf16)."""
    plain_wgrad(dy.t(), x, out={"D": out}, config=cfg or DEFAULT_CONFIG, tuned=False)
    return out
