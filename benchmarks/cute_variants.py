"""Epilogue variants of the QuACK fused step (forge_hf/kernels/cute/) that each leave out one
part of it, so their times locate the fused step's cost: loads, stores, the rule's arithmetic
or the rounding hash. Timing only: their outputs are not an optimizer step. Module-level
objects, as QuACK re-mints a kernel class by importing the epilogue it was built from.
"""

from __future__ import annotations

from quack.epilogue import gemm_epilogue

from forge_hf.kernels.cute import wgrad_epilogue as W

_OUTS = ("exp_avg_new", "exp_avg_sq_new")


@gemm_epilogue(outputs=_OUTS)
def copy_through(acc, c, exp_avg, exp_avg_sq):
    """The fused step's loads and stores (weight as C, two moment tiles) with no arithmetic."""
    return {"D": c, "exp_avg_new": exp_avg, "exp_avg_sq_new": exp_avg_sq}


@gemm_epilogue(outputs=_OUTS)
def stores_only(acc):
    """Its three tile stores alone."""
    return {"D": acc, "exp_avg_new": acc, "exp_avg_sq_new": acc}


@gemm_epilogue()
def weight_only(acc, c):
    """One load and one store, as a GEMM with a residual: the weight moved by the gradient."""
    return {"D": c - acc * 1e-3}


def _math_only(stochastic: bool):
    update = W.RULE_UPDATES["adamw"]

    @gemm_epilogue(outputs=_OUTS, ops={"elem": W.ElementIndex("elem"), **W.INT_OPS})
    def math_only(acc, elem, c0, c1, c2, c3, c4, c5, c6, step, salt, row0, k_cols):
        """The rule, its hash and roundings on values formed from the accumulator: no loads."""
        zero = W.Exact(0.0)
        consts = [W.Exact(v) for v in (c0, c1, c2, c3, c4, c5, c6)] + [zero] * (W.NUM_SCALARS - 7)
        g = W.Exact(acc)
        w, m, v, _ = update(g, g, g * 0.5, g * g, zero, *consts)
        h = W.Uint32(0)
        if stochastic:
            h = W.HASH.element_hash(W.Uint32(elem) + W.Uint32(row0) * W.Uint32(k_cols), W.Uint32(salt),
                                    W.Uint32(step))
        return {"D": W.round_to_bf16(w, h, 0, stochastic), "exp_avg_new": W.round_to_bf16(m, h, 1, stochastic),
                "exp_avg_sq_new": W.round_to_bf16(v, h, 2, stochastic)}

    return math_only


MATH_ONLY = {True: _math_only(True), False: _math_only(False)}
