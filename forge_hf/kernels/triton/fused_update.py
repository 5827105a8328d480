"""Triton: the fused weight-gradient + optimizer step of one linear layer (paper §2.2, Alg. 1),
one program a (BLOCK_N x BLOCK_K) weight tile, no gradient-sized tensor (docs/kernels.md);
and the host side of its launch (default_config, fused_launch_arguments).

Shapes: x (T, K), dy (T, N), weight/states (N, K) through arbitrary strides, so a
transposed (Conv1D) weight needs no copy. 8-bit states add fp32 metadata (N, KB, width),
KB = ceil(K / 64), stored block column by block column (codecs.meta_strides); 4-bit states
are row-major (N, ceil(K / 2)) bytes with bf16 scales (N, ceil(K / GROUP4), 1), laid out the
same way (passed as int16). A factored second moment is its fp32 vectors (3, N + K + 1)
(core/factored.py, triton/factored_tiles.py). ``args`` is
int32: NUM_SCALARS fp32 bit patterns of the rule's constants, then the step, the rounding
salt and the index of the weight's first row in the whole weight (the rounding bits follow
the whole weight). ``stats`` (fp32, 2): the applied tiles' squared gradient sum, and the
count of tiles skipped for a non-finite gradient.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...core import codecs
from ...core.codecs import QuantisedSlot, storage_kinds
from ...core.factored import SETS, FactoredSlot
from ...core.rules import RULES, bind_update
from ..runtime.compiled import launch_compiled
from .bf16_bits import decode_value, element_hash, load_tile, store_value
from .factored_tiles import FACTORED, add_factored, load_factored
from .state_tiles import (
    NONE,
    block_index,
    decode_state,
    group_index,
    load_meta,
    load_state_raw,
    packed_index,
    store_state,
)
from .tile_step import finite_sumsq, load_step_args

# The interpreter multiplies bf16 bit patterns as integers in tl.dot: upcast there.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

RULE_UPDATES = {name: triton.jit(bind_update(rule, tl)) for name, rule in RULES.items()}


@triton.jit
def record_tile(stats_ptr, acc):
    """Whether the gradient tile may be applied (finite_sumsq), counted into ``stats``."""
    sumsq, ok = finite_sumsq(acc)
    # Relaxed: the sums are read after the kernel, which orders them. The default
    # (acquire-release) fences every program's atomics: ~20% of the kernel's time.
    tl.atomic_add(stats_ptr, tl.where(ok, sumsq, 0.0), sem="relaxed")
    tl.atomic_add(stats_ptr + 1, 1.0, mask=ok == 0, sem="relaxed")
    return ok


@triton.jit
def fused_update_kernel(
    x_ptr, dy_ptr, w_ptr, s0_ptr, s1_ptr, s2_ptr, m0_ptr, m1_ptr, m2_ptr, args_ptr, stats_ptr,
    T, N, K, KB,
    stride_xt, stride_xk, stride_dyt, stride_dyn, stride_wn, stride_wk,
    RULE_UPDATE: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,  # storage kinds (core/codecs.py)
    QUANTISED: tl.constexpr,
    FOUR_BIT: tl.constexpr,  # every slot present is 4-bit (fused_launch_arguments checks)
    W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
    DOT_FP32: tl.constexpr, GRAD_GIVEN: tl.constexpr,
    EVEN: tl.constexpr,  # the tiles cover the weight exactly: no bounds masks on its tiles
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rt = tl.arange(0, BLOCK_T)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    if EVEN:
        io_mask = None
    else:
        io_mask = mask
    offs = rn[:, None] * stride_wn + rk[None, :] * stride_wk
    # where the state tiles lie (one name a statement: a Triton tuple cannot hold io_mask's None)
    s_offs = offs
    s_mask = mask
    s_keep = io_mask
    if FOUR_BIT:
        block, block_mask = group_index(rn, tl.program_id(1), N, K, BLOCK_K)
        s_offs, s_mask = packed_index(rn, tl.program_id(1), N, K, BLOCK_K)
        s_keep = s_mask
    elif QUANTISED:
        block, block_mask = block_index(rn, tl.program_id(1), N, KB, BLOCK_K)
    else:
        block, block_mask = 0, False
    # What the rule reads besides the weight and bf16/fp32 state tiles is loaded before the
    # token loop, whose time hides the loads' latency: the rule's constants, the rounding's
    # seed, 8-bit metadata (66.3 -> 58.6 ms with int8 state).
    c, step, salt, row0 = load_step_args(args_ptr)
    meta0 = load_meta(m0_ptr, block, block_mask, S0)
    meta1 = load_meta(m1_ptr, block, block_mask, S1)
    meta2 = load_meta(m2_ptr, block, block_mask, S2)
    # 8-bit state codes too: a quarter of bf16's registers to hold through the loop, and
    # the compiler then decodes and re-encodes them without fp32 layout conversions
    # (about 9% faster; bf16 or fp32 tiles loaded here were 1-5% slower: docs/performance.md).
    if QUANTISED:
        r0 = load_state_raw(s0_ptr, s_offs, s_mask, S0, EVEN)
        r1 = load_state_raw(s1_ptr, s_offs, s_mask, S1, EVEN)
        r2 = load_state_raw(s2_ptr, s_offs, s_mask, S2, EVEN)

    # Phase 1: the gradient tile, fp32 accumulation over tokens - or, for a tensor that
    # already has an ordinary gradient (ForgeOptimizer's non-fused ones), x_ptr is that
    # (N, K) gradient and the tile is read.
    if GRAD_GIVEN:
        acc = tl.load(x_ptr + rn[:, None] * stride_xt + rk[None, :] * stride_xk,
                      mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + rt
            dy_t = tl.load(dy_ptr + rn[:, None] * stride_dyn + t[None, :] * stride_dyt,
                           mask=(rn[:, None] < N) & (t[None, :] < T), other=0.0)
            x = tl.load(x_ptr + t[:, None] * stride_xt + rk[None, :] * stride_xk,
                        mask=(t[:, None] < T) & (rk[None, :] < K), other=0.0)
            if DOT_FP32:
                acc += tl.dot(dy_t.to(tl.float32), x.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(dy_t, x)

    ok = record_tile(stats_ptr, acc)

    # Phase 2: the rule, on the same registers.
    w = decode_value(load_tile(w_ptr, offs, mask, EVEN), W_BF16)
    if not QUANTISED:
        r0 = load_state_raw(s0_ptr, offs, mask, S0, EVEN)
        r1 = load_state_raw(s1_ptr, offs, mask, S1, EVEN)
        r2 = load_state_raw(s2_ptr, offs, mask, S2, EVEN)
    s0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    s1 = s0
    s2 = s0
    if S0 == FACTORED:
        s0 = load_factored(s0_ptr, rn, rk, N, K, step)
    elif S0 != NONE:
        s0 = decode_state(r0, meta0, S0, BLOCK_N, BLOCK_K)
    if S1 == FACTORED:
        s1 = load_factored(s1_ptr, rn, rk, N, K, step)
    elif S1 != NONE:
        s1 = decode_state(r1, meta1, S1, BLOCK_N, BLOCK_K)
    if S2 == FACTORED:
        s2 = load_factored(s2_ptr, rn, rk, N, K, step)
    elif S2 != NONE:
        s2 = decode_state(r2, meta2, S2, BLOCK_N, BLOCK_K)
    v0, v1, v2 = s0, s1, s2  # a factored moment's V_{t-1}: what a skipped tile sums in
    w, s0, s1, s2 = RULE_UPDATE(w, acc, s0, s1, s2, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9],
                                c[10], c[11])

    # Phase 3: write back (the gradient tile is dropped here).
    if STOCHASTIC:
        h = element_hash(((row0 + rn)[:, None] * K + rk[None, :]).to(tl.uint32, bitcast=True), salt, step)
    else:
        h = 0
    if ok:
        store_value(w_ptr, offs, w, io_mask, h, 0, W_BF16, STOCHASTIC)
        if S0 != NONE:
            if S0 != FACTORED:
                store_state(s0_ptr, m0_ptr, s_offs, s0, mask, s_keep, block, block_mask, h, 1,
                            S0, STOCHASTIC, BLOCK_N, BLOCK_K)
        if S1 != NONE:
            if S1 != FACTORED:
                store_state(s1_ptr, m1_ptr, s_offs, s1, mask, s_keep, block, block_mask, h, 2,
                            S1, STOCHASTIC, BLOCK_N, BLOCK_K)
        if S2 != NONE:
            if S2 != FACTORED:
                store_state(s2_ptr, m2_ptr, s_offs, s2, mask, s_keep, block, block_mask, h, 3,
                            S2, STOCHASTIC, BLOCK_N, BLOCK_K)
    # a factored moment's sums, skipped tile or not (it then carries V_{t-1} on)
    if S0 == FACTORED:
        add_factored(s0_ptr, tl.where(ok, s0, v0), mask, rn, rk, N, K, step, BLOCK_N, BLOCK_K)
    if S1 == FACTORED:
        add_factored(s1_ptr, tl.where(ok, s1, v1), mask, rn, rk, N, K, step, BLOCK_N, BLOCK_K)
    if S2 == FACTORED:
        add_factored(s2_ptr, tl.where(ok, s2, v2), mask, rn, rk, N, K, step, BLOCK_N, BLOCK_K)


def default_config(N: int, K: int, T: int) -> dict:
    """Tile shape and launch options for one layer shape."""
    if INTERPRETER:  # fewer, larger programs: the interpreter runs them one by one
        return dict(blocks=(64, 64, 64), num_warps=4, num_stages=1, maxnreg=None)
    # best single config over Llama-3.1-8B's shapes; 168 registers let three programs
    # share a multiprocessor instead of two (docs/performance.md)
    return dict(blocks=(64, 64, 64), num_warps=4, num_stages=4, maxnreg=168)


def default_blocks(N: int, K: int, T: int) -> tuple[int, int, int]:
    return default_config(N, K, T)["blocks"]


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _slot_pointers(slot, weight: torch.Tensor, dummy: torch.Tensor):
    """(values or codes, metadata) tensors of one slot; a missing slot points at dummies."""
    if slot is None:
        return _as_bits(weight), dummy
    if isinstance(slot, FactoredSlot):
        n, k = weight.shape
        if tuple(slot.vectors.shape) != (SETS, n + k + 1) or not slot.vectors.is_contiguous():
            raise ValueError(f"factored vectors of shape {tuple(slot.vectors.shape)} do not fit a {(n, k)} weight: "
                             f"they must be a contiguous {(SETS, n + k + 1)}, as FactoredSlot.empty allocates them")
        return slot.vectors, dummy
    codes = slot.codes if isinstance(slot, QuantisedSlot) else slot
    if isinstance(slot, QuantisedSlot) and slot.codec.bits == 4:
        packed = codecs.packed_shape(*weight.shape)
        if tuple(codes.shape) != packed or not codes.is_contiguous():
            raise ValueError(f"4-bit codes of shape {tuple(codes.shape)} do not fit a {tuple(weight.shape)} weight: "
                             f"they must be a contiguous {packed}, as QuantisedSlot.empty_like (ForgeState) "
                             "allocates them")
    elif codes.shape != weight.shape or codes.stride() != weight.stride():
        raise ValueError(f"a state of shape {tuple(codes.shape)} and strides {codes.stride()} does not "
                         f"match the weight's {tuple(weight.shape)}/{weight.stride()}: allocate states "
                         "with ForgeState so they share the weight's layout")
    if isinstance(slot, QuantisedSlot):
        meta_shape, strides = codecs.meta_layout(*weight.shape, slot.codec)
        if tuple(slot.meta.shape) != meta_shape or slot.meta.stride() != strides:
            raise ValueError(f"{slot.codec.name} metadata of shape {tuple(slot.meta.shape)} and strides "
                             f"{slot.meta.stride()} does not fit a {tuple(weight.shape)} weight: it must be "
                             f"{meta_shape} with strides {strides}, as QuantisedSlot.empty_like (ForgeState) "
                             "allocates it")
        return slot.codes, _as_bits(slot.meta)
    return _as_bits(slot), dummy


def fused_launch_arguments(
    x: torch.Tensor,  # (T, K)
    dy: torch.Tensor,  # (T, N)
    weight: torch.Tensor,  # (N, K) view of the parameter, any strides; fp32 or bf16
    slots: list,  # three (N, K) tensors, QuantisedSlots or None, same strides as weight
    args: torch.Tensor,  # int32 (launch_args.ARGS_LEN,), on the weight's device
    stats: torch.Tensor,  # fp32 (2,): [sum of squared gradients, non-finite tiles]
    rule_name: str,
    stochastic: bool,
    blocks: tuple[int, int, int] | None = None,
    dot_fp32: bool | None = None,
    grad_given: bool = False,
) -> tuple[tuple, list, dict]:
    """(grid, positional arguments, constexpr arguments) of the launch for these tensors;
    tests compile exactly this for the GPU without one (tests/kernels/test_kernel_compiles.py)."""
    N, K = weight.shape
    T = 0 if grad_given else x.shape[0]  # grad_given: x is the (N, K) gradient, dy unused
    BN, BK, BT = blocks or default_config(N, K, T)["blocks"]
    kinds = storage_kinds(slots)
    quantised = any(isinstance(s, QuantisedSlot) for s in slots)
    if quantised and BK % codecs.BLOCK:
        raise ValueError(f"BLOCK_K={BK} splits the {codecs.BLOCK}-element blocks of quantised states: "
                         f"use a BLOCK_K that is a multiple of {codecs.BLOCK}")
    four_bit = [isinstance(s, QuantisedSlot) and s.codec.bits == 4 for s in slots
                if s is not None and not isinstance(s, FactoredSlot)]  # factored vectors: no tile
    if any(four_bit) and not all(four_bit):
        raise ValueError("4-bit state slots share a layer's kernel only with other 4-bit slots (their tiles are "
                         "packed bytes): store every state of the layer as log4, as ForgeState does")
    w_bits = _as_bits(weight)
    (p0, m0), (p1, m1), (p2, m2) = (_slot_pointers(s, weight, stats) for s in slots)
    if dot_fp32 is None:
        dot_fp32 = INTERPRETER or x.dtype == torch.float32 or dy.dtype == torch.float32
    positional = [
        x, dy, w_bits, p0, p1, p2, m0, m1, m2, args, stats,
        T, N, K, codecs.blocks_per_row(K),
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), weight.stride(0), weight.stride(1),
    ]
    constexprs = dict(
        RULE_UPDATE=RULE_UPDATES[rule_name],
        S0=kinds[0], S1=kinds[1], S2=kinds[2], QUANTISED=quantised, FOUR_BIT=any(four_bit),
        W_BF16=weight.dtype == torch.bfloat16, STOCHASTIC=stochastic,
        DOT_FP32=dot_fp32, GRAD_GIVEN=grad_given, EVEN=N % BN == 0 and K % BK == 0,
        BLOCK_N=BN, BLOCK_K=BK, BLOCK_T=BT,
    )
    return (triton.cdiv(N, BN), triton.cdiv(K, BK)), positional, constexprs


# Launches keep a*b+c as two roundings (no FMA contraction): the rules' arithmetic then
# gives the PyTorch reference's bits, so moments near zero (where one contracted rounding
# can flip a sign and move a bf16 state by thousands of ulps) agree on every device.
def compile_options(config: dict) -> dict:
    """Triton's compile options for default_config's launch options (num_warps,
    num_stages, maxnreg: a register cap per thread, None for none)."""
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"], enable_fp_fusion=False)
    if config.get("maxnreg"):
        options["maxnreg"] = config["maxnreg"]
    return options


def launch_fused_kernel(grid, positional, constexprs, config: dict) -> None:
    options = compile_options(config)
    if INTERPRETER:
        fused_update_kernel[grid](*positional, **constexprs, **options)
    else:
        launch_compiled(fused_update_kernel, grid, positional, constexprs, options)
