"""Triton: the fused weight-gradient + optimizer step of one linear layer (paper §2.2, Alg. 1).

One program owns one (BLOCK_N x BLOCK_K) tile of the weight. It accumulates the tile's
gradient G = dY[:, rows]^T X[:, cols] over the token axis in fp32 registers, applies the
rule's element-wise update to the tile, and stores only the weight and state tiles. No
gradient-sized tensor exists. A tile whose gradient is not finite is not written; the
kernel counts it and adds each good tile's squared gradient sum (for grad-norm logging)
into ``stats``.

Shapes: x (T, K), dy (T, N), weight/states (N, K) through arbitrary strides, so a
transposed (Conv1D) weight needs no copy. ``args`` is int32: NUM_SCALARS fp32 bit
patterns of the rule's constants, then the step and the rounding salt.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..rules import NUM_SCALARS, RULES, bind_update
from .storage import load_value, store_value

# The interpreter multiplies bf16 bit patterns as integers in tl.dot: upcast there.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

RULE_UPDATES = {name: triton.jit(bind_update(rule, tl)) for name, rule in RULES.items()}


@triton.jit
def _scalar(args_ptr, i: tl.constexpr):
    return tl.load(args_ptr + i).to(tl.float32, bitcast=True)


@triton.jit
def fused_update_kernel(
    x_ptr, dy_ptr, w_ptr, s0_ptr, s1_ptr, s2_ptr, args_ptr, stats_ptr,
    T, N, K,
    stride_xt, stride_xk, stride_dyt, stride_dyn, stride_wn, stride_wk,
    RULE_UPDATE: tl.constexpr,
    HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
    W_BF16: tl.constexpr, S_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rt = tl.arange(0, BLOCK_T)

    # Phase 1: the gradient tile, fp32 accumulation over tokens.
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

    # Non-finite tiles are counted and skipped; finite ones feed the grad norm.
    finite = (acc == acc) & (tl.abs(acc) < float("inf"))
    n_bad = tl.sum(tl.sum(tl.where(finite, 0, 1), axis=1), axis=0)
    ok = n_bad == 0
    tl.atomic_add(stats_ptr, tl.where(ok, tl.sum(tl.sum(acc * acc, axis=1), axis=0), 0.0))
    tl.atomic_add(stats_ptr + 1, tl.where(ok, 0.0, 1.0))

    # Phase 2: the rule, on the same registers.
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    offs = rn[:, None] * stride_wn + rk[None, :] * stride_wk
    w = load_value(w_ptr, offs, mask, W_BF16)
    s0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    s1 = s0
    s2 = s0
    if HAS_S0:
        s0 = load_value(s0_ptr, offs, mask, S_BF16)
    if HAS_S1:
        s1 = load_value(s1_ptr, offs, mask, S_BF16)
    if HAS_S2:
        s2 = load_value(s2_ptr, offs, mask, S_BF16)
    w, s0, s1, s2 = RULE_UPDATE(
        w, acc, s0, s1, s2,
        _scalar(args_ptr, 0), _scalar(args_ptr, 1), _scalar(args_ptr, 2), _scalar(args_ptr, 3),
        _scalar(args_ptr, 4), _scalar(args_ptr, 5), _scalar(args_ptr, 6), _scalar(args_ptr, 7),
        _scalar(args_ptr, 8), _scalar(args_ptr, 9), _scalar(args_ptr, 10), _scalar(args_ptr, 11),
    )

    # Phase 3: write back (the gradient tile is dropped here).
    step = tl.load(args_ptr + 12).to(tl.uint32, bitcast=True)
    salt = tl.load(args_ptr + 13).to(tl.uint32, bitcast=True)
    elem = (rn[:, None] * K + rk[None, :]).to(tl.uint32)
    keep = mask & ((tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32) + n_bad) == 0)
    store_value(w_ptr, offs, w, keep, elem, salt, step, 0, W_BF16, STOCHASTIC)
    if HAS_S0:
        store_value(s0_ptr, offs, s0, keep, elem, salt, step, 1, S_BF16, STOCHASTIC)
    if HAS_S1:
        store_value(s1_ptr, offs, s1, keep, elem, salt, step, 2, S_BF16, STOCHASTIC)
    if HAS_S2:
        store_value(s2_ptr, offs, s2, keep, elem, salt, step, 3, S_BF16, STOCHASTIC)


ARGS_LEN = NUM_SCALARS + 2


def default_blocks(N: int, K: int, T: int) -> tuple[int, int, int]:
    if INTERPRETER:
        return 64, 64, 64  # fewer, larger programs: the interpreter runs them one by one
    # best of 12 configs on every Llama-3.1-8B shape at 512 tokens (benchmarks/NOTES.md)
    return 64, 128, 64


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def launch_fused_update(
    x: torch.Tensor,  # (T, K)
    dy: torch.Tensor,  # (T, N)
    weight: torch.Tensor,  # (N, K) view of the parameter, any strides; fp32 or bf16
    slots: list,  # three (N, K) tensors or None, same strides as weight
    args: torch.Tensor,  # int32 (ARGS_LEN,), on the weight's device
    stats: torch.Tensor,  # fp32 (2,): [sum of squared gradients, non-finite tiles]
    rule_name: str,
    stochastic: bool,
    blocks: tuple[int, int, int] | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    T, K = x.shape
    N = weight.shape[0]
    BN, BK, BT = blocks or default_blocks(N, K, T)
    present = [s is not None for s in slots]
    state_dtypes = {s.dtype for s in slots if s is not None}
    s_bf16 = state_dtypes == {torch.bfloat16}
    w_bits = _as_bits(weight)
    ptrs = [_as_bits(s) if s is not None else w_bits for s in slots]
    dot_fp32 = INTERPRETER or x.dtype == torch.float32 or dy.dtype == torch.float32
    grid = (triton.cdiv(N, BN), triton.cdiv(K, BK))
    fused_update_kernel[grid](
        x, dy, w_bits, ptrs[0], ptrs[1], ptrs[2], args, stats,
        T, N, K,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), weight.stride(0), weight.stride(1),
        RULE_UPDATE=RULE_UPDATES[rule_name],
        HAS_S0=present[0], HAS_S1=present[1], HAS_S2=present[2],
        W_BF16=weight.dtype == torch.bfloat16, S_BF16=s_bf16, STOCHASTIC=stochastic,
        DOT_FP32=dot_fp32,
        BLOCK_N=BN, BLOCK_K=BK, BLOCK_T=BT,
        num_warps=num_warps, num_stages=num_stages,
    )
