"""A compiled kernel launched straight through the C function Triton generated for it
(generic: any kernel), its TMA descriptors expandable once by the caller; None where Triton's
launcher has not the layout this reads. What it skips and when it applies: docs/kernels.md.
"""

from __future__ import annotations

import types

_LAYOUT = "iiiKKppOOOOOO"  # Triton 3.6: grid, stream, function, cooperative, pdl, 2 scratch, 4 objects


def _driver_module():
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None
    return driver


def _hooks():
    """Triton's launch hook chains, or None where they are not 3.6's ``HookChain``s."""
    from triton import knobs

    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if not (hasattr(enter, "calls") and hasattr(exit_, "calls")):
        return None
    return enter, exit_


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))


def direct_launcher(compiled, constexpr_values: tuple, device_index: int) -> DirectLauncher | None:
    """A DirectLauncher of ``compiled`` (a kernel compiled for the CUDA device
    ``device_index``, its constexpr arguments' values in parameter order), or None where
    the launcher's layout is not the one this reads."""
    driver = _driver_module()
    run = getattr(compiled, "run", None)
    hooks = _hooks()
    if driver is None or getattr(driver, "_BASE_ARGS_FORMAT", None) != _LAYOUT or hooks is None:
        return None
    if type(run).__name__ != "CudaLauncher" or getattr(run, "num_ctas", 1) != 1 or \
            getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    launch = getattr(run, "launch", None)
    if isinstance(launch, types.BuiltinFunctionType):  # no descriptors: the C launcher itself
        return DirectLauncher(compiled, run, launch, {}, constexpr_values, device_index, hooks)
    if not isinstance(launch, types.FunctionType):
        return None
    free = _closure(launch)
    c_launch, positions, metas = free.get("launcher"), free.get("tensordesc_indices"), free.get("tensordesc_meta")
    if not isinstance(c_launch, types.BuiltinFunctionType) or not isinstance(positions, set) or not metas \
            or len(metas) != len(positions) or not hasattr(driver, "make_tensordesc_arg"):
        return None  # descriptors lowered without TMA metadata: Triton passes them another way
    return DirectLauncher(compiled, run, c_launch, dict(zip(sorted(positions), metas)), constexpr_values,
                          device_index, hooks)


class DirectLauncher:
    """``launcher(grid, positional)``: the compiled kernel launched on the current stream
    with ``positional`` (its non-constexpr arguments, descriptors as TensorDescriptor
    objects), as ``compiled[grid](*positional, *constexprs)`` would. ``launch_expanded(grid,
    flat)`` takes them already expanded: each descriptor as ``expand(position, descriptor)``
    gave it, in its place."""

    def __init__(self, compiled, run, c_launch, descriptor_metas: dict, constexpr_values: tuple,
                 device_index: int, hooks: tuple):
        import triton
        from triton import knobs

        compiled._init_handles()
        self.compiled = compiled
        self._c_launch = c_launch
        self._function = compiled.function
        self._metadata = compiled.packed_metadata
        self._flags = (run.launch_cooperative_grid, run.launch_pdl)
        self._metas = descriptor_metas
        self._constexprs = constexpr_values
        self._make_descriptor = _driver_module().make_tensordesc_arg
        self._stream = triton.runtime.driver.active.get_current_stream
        self._device_index = device_index
        self._runtime = knobs.runtime
        self._enter, self._exit = hooks  # Triton's hook chains when it was made (hooked)

    def expand(self, position: int, descriptor) -> list:
        """The C launcher's arguments for the TMA descriptor at kernel argument ``position``
        (its encoded map, shape and strides): encoded now, valid while its tensor stays put."""
        return self._make_descriptor(descriptor, self._metas[position])

    def hooked(self) -> bool:
        """Whether a launch hook is registered (the caller must launch through Triton then):
        added to Triton's hook chains, or the chains replaced by something else."""
        enter, exit_ = self._runtime.launch_enter_hook, self._runtime.launch_exit_hook
        return enter is not self._enter or exit_ is not self._exit or bool(enter.calls or exit_.calls)

    def launch_expanded(self, grid: tuple, flat: list) -> None:
        """(Check ``hooked()`` first: this launch calls no hook.)"""
        grid = (*grid, 1, 1)
        self._c_launch(grid[0], grid[1], grid[2], self._stream(self._device_index), self._function, *self._flags,
                       None, None, self._metadata, None, None, None, *flat, *self._constexprs)

    def __call__(self, grid: tuple, positional: list) -> None:
        if self.hooked():
            self.compiled[(*grid, 1, 1)[:3]](*positional, *self._constexprs)
            return
        if self._metas:
            flat = []
            for i, arg in enumerate(positional):
                if i in self._metas:
                    flat += self.expand(i, arg)
                else:
                    flat.append(arg)
            positional = flat
        self.launch_expanded(grid, positional)
