"""triton/fused_update.py's kernel bound to one tensor whose weight and state slots stay where
they are (BoundLaunch): its launch arguments prepared once per specialisation, each call then
filling in its tokens (or gradient), arguments and statistics (docs/kernels.md).
"""

from __future__ import annotations

from ..runtime.compiled import int_spec, launch_compiled, tensor_spec

# Positions in fused_launch_arguments' list: x, dy, the fixed weight/state/metadata
# pointers, args, stats, T, then (N, K, KB) fixed, the four token strides, the two weight strides.
_FIXED = slice(2, 9)
_SHAPE = slice(12, 15)
_WEIGHT_STRIDES = slice(19, 21)


class BoundLaunch:
    """``launch(x, dy, args, stats)`` for one (N, K) ``weight`` and its three state slots
    (QuantisedSlots, tensors or None), which must stay where they are: rebind when a state is
    allocated or loaded. ``grad_given``: x is the (N, K) gradient (dy is ignored), the
    rule's pass over an existing gradient (two-pass path, non-fused tensors)."""

    def __init__(self, weight, slots, rule_name: str, stochastic: bool, grad_given: bool = False,
                 keep_last: bool = False):
        self.weight, self.slots = weight, list(slots)
        self.rule_name, self.stochastic, self.grad_given = rule_name, stochastic, grad_given
        # keep_last: the caller passes the same tensor objects call after call (the two-pass
        # scratch view, an argument row, the layer's statistics), which live on anyway: the
        # last call's launch is kept and repeated for them without preparing it again
        self.keep_last = keep_last
        self._last = None
        from ..triton import fused_update  # here, not at import: Triton's import is slow (dispatch.py)

        self._kernels = fused_update
        # per specialisation of the changing arguments: (grid, fixed pointers, constexprs,
        # options, launch again or None under the interpreter)
        self._variants: dict = {}

    def forget_last(self) -> None:
        """Let go of the last call's tensors (their memory is about to be replaced)."""
        self._last = None

    def __call__(self, x, dy, args, stats) -> None:
        last = self._last
        if last is not None and x is last[0] and dy is last[1] and args is last[2] and stats is last[3]:
            last[4](last[5], last[6])
            return
        if self.grad_given:
            dy = x
        fused_update = self._kernels
        n, k = self.weight.shape
        t = 0 if self.grad_given else x.shape[0]
        config = fused_update.default_config(n, k, t)
        sx, sdy = x.stride(), dy.stride()
        key = (config["blocks"], tensor_spec(x), tensor_spec(dy), tensor_spec(args), tensor_spec(stats),
               int_spec(t), int_spec(sx[0]), int_spec(sx[1]), int_spec(sdy[0]), int_spec(sdy[1]))
        variant = self._variants.get(key)
        if variant is None:  # checked and compiled once per variant, through the ordinary path
            grid, positional, constexprs = fused_update.fused_launch_arguments(
                x, dy, self.weight, self.slots, args, stats, self.rule_name, self.stochastic, config["blocks"],
                grad_given=self.grad_given)
            options = fused_update.compile_options(config)
            again = None
            if not fused_update.INTERPRETER:
                again = launch_compiled(fused_update.fused_update_kernel, grid, positional, constexprs, options)
            # the fixed part only: the tokens, args and stats of this call must not be kept alive
            fixed = (positional[_FIXED], positional[_SHAPE], positional[_WEIGHT_STRIDES])
            self._variants[key] = (grid, fixed, constexprs, options, again)
            if again is not None:
                return
            variant = self._variants[key]
        grid, (pointers, shape, weight_strides), constexprs, options, again = variant
        positional = [x, dy, *pointers, args, stats, t, *shape, sx[0], sx[1], sdy[0], sdy[1], *weight_strides]
        if again is None:  # the interpreter: the same arguments through the JIT
            fused_update.fused_update_kernel[grid](*positional, **constexprs, **options)
        else:
            again(grid, positional)
            if self.keep_last:
                self._last = (x, dy, args, stats, again, grid, positional)
