"""The same fused step in plain PyTorch, tile by tile: the backend for devices without
Triton, and the oracle the Triton kernel is tested against.

It mirrors kernels/triton/fused_update.py: identical tiles, fp32 accumulation, the same rule code
object (``ops`` bound to torch), the same non-finite-tile skipping and statistics, and the
same integer-domain bf16 rounding with the same hash, so stochastic rounding gives the
same bits on both backends, and the same 8-bit codec arithmetic (core/codecs.py). A factored
second moment (core/factored.py) is read from its vectors and summed into them tile by tile,
as the kernel's atomics do (in another order: the sums agree to fp32 round-off).
"""

from __future__ import annotations

import torch

from ..core.codecs import BLOCK, QuantisedSlot
from ..core.factored import FactoredSlot
from ..core.rounding import M32, hash_word, random_bits
from ..core.rules import NUM_SCALARS, RULES, bind_update

RULE_UPDATES = {name: bind_update(rule, torch) for name, rule in RULES.items()}


def code_bits(slot: QuantisedSlot, elem: torch.Tensor, salt: int, step: int, slot_id: int, stochastic: bool):
    """The random bits a quantised slot's codes round with (None: to nearest): al8 the whole
    element hash, 4-bit codes the slot's 16 bits, as a bf16 state's (kernels/triton/state_tiles.py)."""
    if not (stochastic and slot.codec.stochastic):
        return None
    return random_bits(elem, salt, step, slot_id) if slot.codec.bits == 4 else hash_word(elem, salt, step)


def round_to_bf16(x: torch.Tensor, elem: torch.Tensor, salt: int, step: int, slot: int,
                  stochastic: bool) -> torch.Tensor:
    """fp32 -> bf16 in the integer domain, as kernels/triton/bf16_bits.py:fp32_to_bf16_bits."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & M32
    if stochastic:
        bits = bits + random_bits(elem, salt, step, slot)
    else:
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (((bits >> 16) & 0xFFFF).to(torch.int32).to(torch.int16)).view(torch.bfloat16)


def reference_fused_update(
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: torch.Tensor,
    slots: list,
    args: torch.Tensor,
    stats: torch.Tensor,
    rule_name: str,
    stochastic: bool,
    blocks: tuple[int, int, int] = (64, 64, 64),
) -> None:
    """Same contract as dispatch.launch_fused_update."""
    update = RULE_UPDATES[rule_name]
    args_cpu = args.cpu()
    scalars = args_cpu[:NUM_SCALARS].view(torch.float32).to(weight.device)
    consts = [scalars[i] for i in range(NUM_SCALARS)]
    step = int(args_cpu[NUM_SCALARS].item()) & M32
    salt = int(args_cpu[NUM_SCALARS + 1].item()) & M32
    row0 = int(args_cpu[NUM_SCALARS + 2].item())
    N, K = weight.shape
    BN, BK, _ = blocks
    if any(isinstance(s, QuantisedSlot) and BK % max(BLOCK, s.codec.group) for s in slots):
        raise ValueError(f"reference BLOCK_K={BK} splits {BLOCK}-element codec blocks: use a multiple of {BLOCK}")
    factored = [s for s in slots if isinstance(s, FactoredSlot)]
    for s in factored:
        s.clear(step)  # the whole set at once: the kernel's first tile row and column clear it piecewise
    xf = x.float()
    dyf = dy.float()
    for n0 in range(0, N, BN):
        rows = slice(n0, min(n0 + BN, N))
        for k0 in range(0, K, BK):
            cols = slice(k0, min(k0 + BK, K))
            g = dyf[:, rows].t() @ xf[:, cols]
            sumsq = (g * g).sum()
            zero = torch.zeros_like(g)
            s_in = [zero if s is None else s.read(step, rows, cols) if isinstance(s, FactoredSlot)
                    else s.read(rows, cols) if isinstance(s, QuantisedSlot) else s[rows, cols].float() for s in slots]
            if not bool(torch.isfinite(sumsq)):  # the kernel's test: NaN, inf, or a square overflowing
                stats[1] += 1
                for dst, value in zip(slots, s_in):  # a skipped tile's moment carries on unchanged
                    if isinstance(dst, FactoredSlot):
                        dst.add(step, value, rows, cols)
                continue
            stats[0] += sumsq
            w_tile = weight[rows, cols]
            outs = update(w_tile.float(), g, *s_in, *consts)
            r = torch.arange(row0 + rows.start, row0 + rows.stop, device=weight.device, dtype=torch.int64)
            c = torch.arange(cols.start, cols.stop, device=weight.device, dtype=torch.int64)
            elem = r[:, None] * K + c[None, :]
            for slot_id, (dst, value) in enumerate(zip([weight, *slots], outs)):
                if dst is None:
                    continue
                if isinstance(dst, FactoredSlot):
                    dst.add(step, value, rows, cols)
                    continue
                if isinstance(dst, QuantisedSlot):
                    dst.write(value, rows, cols, code_bits(dst, elem, salt, step, slot_id, stochastic))
                    continue
                if dst.dtype == torch.bfloat16:
                    value = round_to_bf16(value, elem, salt, step, slot_id, stochastic)
                dst[rows, cols] = value


def reference_rule_rows(rule_name: str, w2: torch.Tensor, g: torch.Tensor, slots: list, rows: slice,
                        consts: list, ok: torch.Tensor, salt: int, step: int, stochastic: bool,
                        row0: int = 0) -> torch.Tensor:
    """The rule and store for ``rows`` of a 2-D tensor whose gradient ``g`` (those rows, fp32)
    exists: ForgeOptimizer's non-fused parameters, a chunk of rows at a time; ``row0`` is the
    tensor's first row in the whole parameter (an FSDP2 shard), for the rounding bits. Nothing is
    written to fp32 or bf16 slots where ``ok`` (a 0-dim bool) is false; 8-bit slots cannot be
    masked, so the caller skips a non-finite gradient before (FactoredSlot.carry). Returns the rows'
    squared sum. A factored moment's rows are summed in; the first chunk (rows from 0) clears
    the set the next step sums into, so chunks must start at ``w2``'s row 0 (a row shard's
    column sums are its share: factored.FactoredSlot.reduce_columns adds the ranks')."""
    values = [g.new_zeros(()) if s is None else s.read(step, rows) if isinstance(s, FactoredSlot)
              else s.read(rows) if isinstance(s, QuantisedSlot) else s[rows].float() for s in slots]
    outs = RULE_UPDATES[rule_name](w2[rows].float(), g, *values, *consts)
    n_cols = w2.shape[1]
    r = torch.arange(row0 + rows.start, row0 + rows.stop, device=w2.device)  # rows of the whole tensor
    elem = r[:, None] * n_cols + torch.arange(n_cols, device=w2.device)[None, :]  # the kernels' element index
    for slot_id, (dst, value) in enumerate(zip([w2, *slots], outs)):
        if dst is None:
            continue
        if isinstance(dst, FactoredSlot):
            if rows.start == 0:
                dst.clear(step)
            dst.add(step, torch.where(ok, value, values[slot_id - 1]), rows)
            continue
        if isinstance(dst, QuantisedSlot):
            dst.write(value, rows, bits=code_bits(dst, elem, salt, step, slot_id, stochastic))
            continue
        if dst.dtype == torch.bfloat16:
            value = round_to_bf16(value, elem, salt, step, slot_id, stochastic)
        dst[rows] = torch.where(ok, value.to(dst.dtype), dst[rows])  # a non-finite gradient writes nothing
    return (g * g).sum()

