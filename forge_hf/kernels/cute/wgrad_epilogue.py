"""The fused step as an epilogue of QuACK's sm90 GEMM: dW = dY^T X formed by QuACK's
persistent warp-specialised wgmma engine (ping-pong: one consumer warpgroup runs its tile's
epilogue while the other runs MMAs), the rule applied to each accumulator subtile, and only
the new weight and state tiles stored, in place. Imported only through ``cute.load()``.

The GEMM: M = out features, N = in features, K = tokens. A = dY^T (out axis contiguous:
M-major), B = X as (tokens, in) (N-major), D = the weight (out, in), row-major. QuACK's TMA
loads the weight as the GEMM's C operand and the rule's states as full-tile epilogue loads;
the weight is stored as D and the states as tile outputs over the same memory (each tile is
read before it is written, by the one CTA that owns it). Every rule of core/rules.py, with a
bf16 or fp32 weight and fp32, bf16 or 8-bit states in any of the slots the rule keeps; each
combination's epilogue is built at its first use (``step_epilogue``).

Same arithmetic as the other kernels: the rule's code object (core/rules.py) runs on exact.py's
values, whose +, -, * are single PTX ``.rn`` operations (never contracted to FMA, as the Triton
launches' enable_fp_fusion=False), whose / and sqrt are the instructions Triton emits and
whose comparisons and ``ops.where`` are Triton's ordered compares and selects; bf16 stores
round in the integer domain with core/rounding.py's hash, the weight with the hash's slot 0
and state slot i with slot i + 1, as the Triton kernel does. The value handed to QuACK's bf16
store has its low 16 bits cleared already, so its own round-to-nearest conversion is exact;
fp32 values are stored as computed.

8-bit states (absmax8, absmax8_floored, al8: block_codes.py) are decoded in the step and
encoded a 64-column codec block at a time before the stores, on the rolled epilogue.

The rolled epilogue also skips tiles with a non-finite gradient and sums the squared gradient
(tile_stats.py: per 128 x 128 CTA tile, where the Triton kernel tests 64 x 64 blocks).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint32
from quack.epilogue import gemm_epilogue
from quack.epilogue.ops import Scalar, TileStore
from quack.gemm_config import GemmConfig

from ...core import codecs, rounding, rules
from ...core.codecs import QuantisedSlot, storage_kind
from ...core.rules import MAX_SLOTS, NUM_SCALARS, RULES, bind_update, get_rule
from . import block_codes, tile_stats
from .exact import PTX, Exact, as_f32, where
from .rolled import rolled_epilogue

# The rules' free name ``ops`` (a module: QuACK fingerprints what an epilogue references)
RULE_OPS = types.ModuleType("forge_hf.kernels.cute.rule_ops")
RULE_OPS.sqrt = lambda x: Exact(PTX.sqrt_approx(as_f32(x)))
RULE_OPS.where = where
RULE_UPDATES = {name: bind_update(rule, RULE_OPS) for name, rule in RULES.items()}


def constants_read(rule: rules.Rule) -> int:
    """How many of the constants c0..c11 the rule's update reads (its last one read, counted
    from c0): the epilogue takes those as scalars and the rest as 0."""
    code = rule.update.__code__
    constants = code.co_varnames[5:code.co_argcount]  # after w, g, s0, s1, s2
    tree = ast.parse(textwrap.dedent(inspect.getsource(rule.update)))
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return max((i + 1 for i, name in enumerate(constants) if name in read), default=0)


CONSTANTS_READ = {name: constants_read(rule) for name, rule in RULES.items()}

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


def stored_value(x: Exact, kind: int, h, slot: int, stochastic: bool) -> Float32:
    """What the tile store of storage ``kind`` (codecs.BF16 or FP32) is handed for x: its bf16
    rounding (round_to_bf16, hash slot ``slot``), or the fp32 value unrounded."""
    if kind == codecs.BF16:
        return round_to_bf16(x, h, slot, stochastic)
    return x.v


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
        coords = block_codes.tile_coordinates(ctx)
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
KIND_NAMES = {codecs.NONE: "no", codecs.FP32: "fp32", codecs.BF16: "bf16", codecs.ABSMAX8: "absmax8",
              codecs.ABSMAX8_FLOORED: "absmax8f", codecs.AL8: "al8"}
EIGHT_BIT = block_codes.KINDS


def state_operands(rule: str, states: tuple[int, ...]) -> tuple[str | None, ...]:
    """Each slot's epilogue operand (the rule's name for the slot; its tile output adds
    ``_new``), None for a slot without a state."""
    return tuple(None if kind == codecs.NONE else RULES[rule].slot_names[i] for i, kind in enumerate(states))


@functools.cache
def step_epilogue(rule: str, weight_bf16: bool, states: tuple[int, ...], stochastic: bool, rolled: bool):
    """The fused step of ``rule`` as a QuACK epilogue, built at its first use: a bf16 (else
    fp32) weight as C and D, ``states`` each slot's storage kind (codecs.NONE, FP32, BF16 or an
    8-bit kind), ``stochastic`` rounding of its bf16 and al8 stores (else to nearest),
    ``rolled``: its subtiles as a loop (rolled.py) with the tile statistics and skip
    (tile_stats.py), else unrolled as QuACK's driver does, with neither. Its operands: c (the
    weight), the present states (an 8-bit one's codes, and its metadata as ``<slot>_meta`` and
    ``<slot>_encode``; al8 under stochastic rounding also ``<slot>_word``: block_codes.py),
    elem, the constants the rule reads, step, salt, row0 and k_cols."""
    if len(states) != MAX_SLOTS:
        raise ValueError(f"states: one storage kind for each of the {MAX_SLOTS} slots, got {states}")
    if not rolled and any(kind in EIGHT_BIT for kind in states):
        raise ValueError("8-bit states are on the rolled epilogue only (rolled=True)")
    update = RULE_UPDATES[rule]
    weight = codecs.BF16 if weight_bf16 else codecs.FP32
    slots = state_operands(rule, states)
    constants = SCALAR_NAMES[:CONSTANTS_READ[rule]]

    def step(acc, c, **operands):
        zero = Exact(0.0)
        consts = [Exact(operands[name]) for name in constants] + [zero] * (NUM_SCALARS - len(constants))
        values = [zero if name is None
                  else block_codes.decode(kind, operands[name], operands[f"{name}_meta"]) if kind in EIGHT_BIT
                  else Exact(operands[name]) for name, kind in zip(slots, states)]
        w, *new = update(Exact(c), Exact(acc), *values, *consts)
        h = Uint32(0)
        if stochastic:
            index = Uint32(operands["elem"]) + Uint32(operands["row0"]) * Uint32(operands["k_cols"])
            h = HASH.element_hash(index, Uint32(operands["salt"]), Uint32(operands["step"]))
        stored = {"D": stored_value(w, weight, h, 0, stochastic)}
        for i, (name, kind, value) in enumerate(zip(slots, states, new)):
            if name is not None:  # an 8-bit slot's fp32 value: its BlockEncode makes the codes
                stored[f"{name}_new"] = (value.v if kind in EIGHT_BIT
                                         else stored_value(value, kind, h, i + 1, stochastic))
        stored.update({name: PTX.bits_f32(h) for name in words})  # al8's random bits: the whole hash
        return stored

    eight_bit = [(name, kind) for name, kind in zip(slots, states) if kind in EIGHT_BIT]
    words = tuple(f"{name}_word" for name, kind in eight_bit if kind == codecs.AL8 and stochastic)
    # QuACK reads the operands' names from the signature
    names = ("acc", "c", *(name for name in slots if name is not None), *(f"{name}_meta" for name, _ in eight_bit),
             "elem", *constants, "step", "salt", "row0", "k_cols")
    step.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names])
    kinds = (KIND_NAMES[kind] for kind in states[:len(RULES[rule].slot_names)])
    step.__name__ = "_".join((rule, KIND_NAMES[weight], *kinds, "sr" if stochastic else "rn"))
    epilogue = rolled_epilogue if rolled else gemm_epilogue
    outputs = tuple(
        TileStore(f"{name}_new", quant=block_codes.BlockEncode(
            f"{name}_encode", f"{name}_new", kind, f"{name}_word" if f"{name}_word" in words else None))
        if kind in EIGHT_BIT else f"{name}_new"
        for name, kind in zip(slots, states) if name is not None)
    metas = {f"{name}_meta": block_codes.MetaLoad(f"{name}_meta") for name, _ in eight_bit}
    extra_ops = (tile_stats.TileStats("stats"),) if rolled else ()
    return epilogue(outputs=outputs, ops={"elem": ElementIndex("elem"), **INT_OPS, **metas}, extra_ops=extra_ops,
                    outs={name: block_codes.WordSink(name) for name in words})(step)


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


def scalar_views(args: torch.Tensor, rule: str) -> dict:
    """The launch's argument row (core/arg_words.py) as the epilogue's device scalars: the
    fp32 constants ``rule`` reads, the step, the salt and the first row. Read by the kernel at
    each tile, so a CUDA graph replays with the row's current values."""
    consts = args[:NUM_SCALARS].view(torch.float32)
    views = {name: consts[i:i + 1] for i, name in enumerate(SCALAR_NAMES[:CONSTANTS_READ[rule]])}
    views.update(step=args[NUM_SCALARS:NUM_SCALARS + 1], salt=args[NUM_SCALARS + 1:NUM_SCALARS + 2],
                 row0=args[NUM_SCALARS + 2:NUM_SCALARS + 3])
    return views


FLOATS = (torch.bfloat16, torch.float32)


def _slot_kinds(rule: str, slots, weight) -> tuple[int, ...]:
    """Each slot's storage kind (codecs.storage_kind), or a ValueError for a slot the engine
    does not take."""
    names = get_rule(rule).slot_names
    if len(slots) > MAX_SLOTS:
        raise ValueError(f"{len(slots)} state slots given: the rules keep at most {MAX_SLOTS}")
    for i, slot in enumerate(slots):
        if slot is None:
            continue
        if i >= len(names):
            raise ValueError(f"{rule} keeps {len(names)} state slot(s) {names}: slot {i} must be None")
        if isinstance(slot, QuantisedSlot):
            _check_8bit(i, names[i], slot, weight)
            continue
        if slot.dtype not in FLOATS or not slot.is_contiguous() or slot.shape != weight.shape:
            raise ValueError(f"state slot {i} ({names[i]}): the QuACK epilogue takes contiguous bf16 or fp32 "
                             f"states of the weight's shape {tuple(weight.shape)}, got {slot.dtype} "
                             f"{tuple(slot.shape)}{'' if slot.is_contiguous() else ' non-contiguous'}")
    return tuple(storage_kind(slot) for slot in (*slots, *[None] * (MAX_SLOTS - len(slots))))


def _check_8bit(i: int, name: str, slot: QuantisedSlot, weight):
    """An 8-bit slot the engine takes: its codes laid out as the weight, rows of 16 bytes for
    TMA, its metadata as QuantisedSlot.empty_like allocates it (block column by block column)."""
    if slot.codec.kind not in EIGHT_BIT:
        raise ValueError(f"state slot {i} ({name}): {slot.codec.name} codes of forge_hf 0.1.0 are read by the "
                         "Triton kernels only; a step there stores them in today's format")
    N, K = weight.shape
    codes, meta = slot.codes, slot.meta
    if codes.shape != weight.shape or not codes.is_contiguous() or codes.dtype != slot.codec.code_dtype:
        raise ValueError(f"state slot {i} ({name}): contiguous {slot.codec.code_dtype} codes of the weight's shape "
                         f"{tuple(weight.shape)}, got {codes.dtype} {tuple(codes.shape)}"
                         f"{'' if codes.is_contiguous() else ' non-contiguous'}")
    if K % 16:
        raise ValueError(f"state slot {i} ({name}): TMA needs 16-byte rows of codes, in features ({K}) a multiple "
                         "of 16")
    if (tuple(meta.shape), meta.stride()) != codecs.meta_layout(N, K, slot.codec) or meta.dtype != torch.float32:
        raise ValueError(f"state slot {i} ({name}): metadata {meta.dtype} {tuple(meta.shape)} strides "
                         f"{meta.stride()}, not as QuantisedSlot.empty_like allocates it")


def _check_weight(weight):
    if weight.dtype not in FLOATS or not weight.is_contiguous():
        raise ValueError(f"the QuACK epilogue takes a contiguous bf16 or fp32 weight, got {weight.dtype}"
                         f"{'' if weight.is_contiguous() else ' non-contiguous (a transposed Conv1D weight?)'}")
    N, K = weight.shape
    if N % 8 or K % 8:  # dY^T's token stride is N, X's is K; any token count
        raise ValueError(f"TMA needs 16-byte strides: out ({N}) and in ({K}) features multiples of 8")


def _check_step(x, dy, weight, stats, rolled):
    T, K = x.shape
    N = dy.shape[1]
    if tuple(weight.shape) != (N, K) or dy.shape[0] != T:
        raise ValueError(f"shapes: x {tuple(x.shape)}, dy {tuple(dy.shape)}, weight {tuple(weight.shape)}")
    if x.dtype != torch.bfloat16 or dy.dtype != torch.bfloat16 or not (x.is_contiguous() and dy.is_contiguous()):
        raise ValueError(f"the QuACK epilogue multiplies contiguous bf16 x and dy (got {x.dtype}, {dy.dtype}): "
                         "fp32 tokens take the Triton fused kernel")
    if stats is not None and (stats.dtype != torch.float32 or stats.shape != (2,) or not stats.is_contiguous()
                              or stats.device != weight.device):
        raise ValueError("stats: a contiguous fp32 tensor of 2 on the weight's device")
    if stats is not None and not rolled:
        raise ValueError("stats: only the rolled epilogue records statistics")


def layer_call(weight, slots, rule="adamw", stochastic=True, cfg=None, rolled=True) -> tuple:
    """What every step of one layer shares: (epilogue, keywords), the weight and its states
    checked once (a ValueError says what the engine does not take); step_call adds a step's
    tokens and scalars. Arguments as fused_step's."""
    _check_weight(weight)
    states = _slot_kinds(rule, list(slots), weight)
    weight_bf16 = weight.dtype == torch.bfloat16
    # no bf16 or al8 store: stochastic and nearest rounding are one kernel
    stochastic = bool(stochastic) and (weight_bf16 or codecs.BF16 in states or codecs.AL8 in states)
    epilogue = step_epilogue(rule, weight_bf16, states, stochastic, rolled)
    present = {name: slot for name, slot in zip(state_operands(rule, states), slots) if name is not None}
    # 8-bit codes as bytes (QuACK moves int8 as uint8; block_codes.py reads the sign)
    stored = {name: slot.codes.view(torch.uint8) if isinstance(slot, QuantisedSlot) else slot
              for name, slot in present.items()}
    K = weight.shape[1]
    keywords = dict(out={"D": weight, **{f"{name}_new": tensor for name, tensor in stored.items()}},
                    config=cfg or DEFAULT_CONFIG, **stored, elem=K, k_cols=K)
    for name, slot in present.items():
        if isinstance(slot, QuantisedSlot):  # block_codes.py's ops: the metadata, read and written
            keywords.update({f"{name}_meta": slot.meta, f"{name}_encode": slot.meta})
            if slot.codec.kind == codecs.AL8 and stochastic:
                keywords[f"{name}_word"] = 0.0
    return epilogue, keywords


def step_call(x, dy, weight, slots, args, rule="adamw", stochastic=True, cfg=None, rolled=True, stats=None,
              layer=None):
    """(epilogue, operands, keywords) of one fused step: ``epilogue(*operands, tuned=False,
    **keywords)`` runs it, ``epilogue.plan(*operands, **keywords)`` compiles it without a launch.
    Arguments as fused_step's."""
    _check_step(x, dy, weight, stats, rolled)
    epilogue, keywords = layer or layer_call(weight, slots, rule, stochastic, cfg, rolled)
    keywords = {**keywords, **scalar_views(args, rule)}
    if rolled:
        keywords["stats"] = tile_stats.OFF if stats is None else stats
    return epilogue, (dy.t(), x, weight), keywords


def fused_step(x, dy, weight, slots, args, rule="adamw", stochastic=True, cfg=None, rolled=True, stats=None,
               layer=None):
    """One step of ``rule`` on a weight and its states, all updated in place: x (T, K) and dy
    (T, N) bf16, weight (N, K) bf16 or fp32, ``slots`` the rule's state tensors in slot order
    (bf16 or fp32, the weight's shape; None where a slot keeps none, as dispatch passes them),
    ``args`` the launch's int32 row (core/launch_args.py); ``stochastic``: bf16 stores round
    stochastically, else to nearest; ``cfg`` a GemmConfig (DEFAULT_CONFIG); ``rolled`` runs the
    epilogue's subtiles as a loop (rolled.py). A CTA tile (the config's tile_m x tile_n) whose
    gradient is not finite is left unchanged (tile_stats.py), as the Triton kernel does with
    its 64 x 64 blocks; ``stats`` (fp32, 2), where given, gets the applied tiles' squared
    gradient sum and the count of skipped tiles added. The unrolled epilogue (``rolled=False``)
    neither skips nor counts. ``layer``: layer_call's result for these weight, slots and
    options, so repeated steps of a layer skip its checks. A ValueError says what the engine
    does not take."""
    epilogue, operands, keywords = step_call(x, dy, weight, slots, args, rule, stochastic, cfg, rolled, stats,
                                             layer)
    epilogue(*operands, tuned=False, **keywords)


def wgrad(x, dy, out, cfg=None):
    """out = dY^T X on the engine alone (out: (N, K), fp32 or bf16)."""
    plain_wgrad(dy.t(), x, out={"D": out}, config=cfg or DEFAULT_CONFIG, tuned=False)
    return out
