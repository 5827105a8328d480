"""How a layer's fused step runs: the backend (``reference``, ``triton``, ``auto``), on the GPU
the kernel select.py chooses, bound once per layer, and the path (fused, or two-pass:
cuBLAS's gradient then the rule), timed per layer shape where FORGE_HF_WGRAD=auto (select.py
says when). docs/kernels.md explains the choices. ``resolve_backend`` and
``bind_fused_update`` return functions with the contract of ``launch_fused_update``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..core.codecs import QuantisedSlot, storage_kinds
from ..core.config import BACKENDS
from ..core.factored import FactoredSlot
from ..core.state import slot_bytes
from .launch.fused_update_launch import BoundLaunch
from .launch.gluon_launch import tokens_unsupported
from .reference import reference_fused_update
from .runtime.launch_args import step_is_captured
from .select import (
    MANY_TOKENS,
    PERSISTENT,
    TRITON,
    WGRAD_ENV,
    WIDE,
    choose,
    faster_path,
    kernel_setting,
    memory_room,
    room_reason,
    untimed_reason,
    wgrad_setting,
)
from .two_pass import GradientScratch, is_capturing, scratch_for, weight_gradient

MEASURE_ROUNDS = 3
# ~1 ms of GPU sleep before each timed path: the host queues the path's launches meanwhile,
# so the gaps between them (absent from a CUDA-graph replay) are not timed
HOST_LEAD_CYCLES = 2_000_000

log = logging.getLogger("forge_hf")


def _kernels():
    """triton/fused_update.py, imported at the first GPU step: Triton's import is slow, and absent
    on some platforms."""
    from .triton import fused_update

    return fused_update


def _triton_available() -> bool:
    try:
        _kernels()
    except ImportError:
        return False
    return True


def check_backend(backend: str) -> str:
    """The dispatch's guard: a ForgeConfig has validated a user's backend already."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend={backend!r}: choose one of {list(BACKENDS)}")
    return backend


def resolve_backend(backend: str, device: torch.device):
    """The function that performs the fused step for a weight on ``device``."""
    if check_backend(backend) == "reference":
        return reference_fused_update
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and device.type == "cpu"
    if not ((device.type == "cuda" or interpreted) and _triton_available()):
        if backend == "triton":
            raise RuntimeError(
                f"backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                f"the weight is on {device}: use backend='auto' or 'reference'"
            )
        return reference_fused_update
    return launch_fused_update


def bind_fused_update(backend: str, weight, slots, stats, rule_name: str, stochastic: bool) -> Callable:
    """``launch(x, dy, args, stats)``: the step of one layer whose weight and state slots
    stay where they are, with what does not change between its steps prepared once (the
    backend's choice, on the persistent kernel its descriptors, the FORGE_HF_WGRAD mode).
    On ``triton`` each token count's first launch chooses the fused or the two-pass path.
    Rebind when a state is allocated or loaded."""
    kernel_setting()  # an unknown FORGE_HF_KERNEL is refused on any device
    kinds = storage_kinds(slots)  # what the layer's kernel and path are chosen for
    fused = _bind_fused(backend, weight, slots, kinds, stats, rule_name, stochastic)
    mode = wgrad_setting()
    if resolve_backend(backend, weight.device) is not launch_fused_update:
        return fused  # the reference: no Triton for the rule pass, and the same arithmetic anyway
    scratch = scratch_for(weight.device)
    two_pass = _bind_two_pass(weight, slots, rule_name, stochastic, scratch)

    # the timing's copies of the layer and its own fp32 scratch (the shared one then grows to it)
    timing_bytes = weight.nbytes + sum(slot_bytes(s) for s in slots) + 4 * weight.numel()

    def measure(x, dy, args) -> dict[str, PathTimes]:
        bind_copy = lambda w, s, st: _bind_fused(backend, w, s, kinds, st, rule_name, stochastic)
        return _measure_paths(bind_copy, x, dy, weight, slots, args, rule_name, stochastic)

    chosen: dict = {}  # (tokens, token dtype, captured) -> this layer's path for them

    def launch(x, dy, args, stats):
        captured = step_is_captured()
        run = chosen.get((x.shape[0], x.dtype, captured))
        if run is None:
            choice = _decide(wgrad_key(x, weight, kinds, rule_name), mode, x, dy, args, measure, timing_bytes)
            if choice is None:  # a capture before any measurement: fused, measured at an eager step
                run = fused
            else:
                path = choice.graph_path if captured else choice.path
                if choice.graph_path == "two_pass" and path != "two_pass":
                    scratch.reserve(weight.numel())  # a capture's steps will use it
                run = chosen[(x.shape[0], x.dtype, captured)] = two_pass if path == "two_pass" else fused
        run(x, dy, args, stats)
    return launch


def _bind_two_pass(weight, slots, rule_name: str, stochastic: bool, scratch: GradientScratch) -> Callable:
    """The two-pass path's ``launch(x, dy, args, stats)``: the gradient into ``scratch``, then
    a bound rule pass over it."""
    rule_pass = BoundLaunch(weight, slots, rule_name, stochastic, grad_given=True, keep_last=True)
    scratch.keep_viewed_by(rule_pass)

    def two_pass(x, dy, args, stats):
        grad = weight_gradient(x, dy, weight, scratch)
        rule_pass(grad, grad, args, stats)
    return two_pass


def _bind_fused(backend: str, weight, slots, kinds: tuple, stats, rule_name: str, stochastic: bool) -> Callable:
    """The fused path's ``launch(x, dy, args, stats)``: the kernel select.choose names for
    each token count (a Gluon kernel bound to the layer, else the Triton kernel), or the
    backend's function."""
    run = resolve_backend(backend, weight.device)
    if run is not launch_fused_update:
        def launch(x, dy, args, stats):
            run(x, dy, weight, slots, args, stats, rule_name, stochastic)
        return launch
    triton_launch = BoundLaunch(weight, slots, rule_name, stochastic)
    gluon = _bind_gluon(weight, slots, kinds, stats, rule_name, stochastic)
    if not gluon:
        return triton_launch
    kernel_at: dict[int, str] = {}  # token count -> the kernel chosen for it

    def launch(x, dy, args, stats):
        tokens = x.shape[0]
        kernel = kernel_at.get(tokens)
        if kernel is None:
            kernel = kernel_at[tokens] = choose(weight, slots, kinds, tokens)[0]
        bound = gluon.get(kernel)  # None: the Triton kernel, or one not bound (FORGE_HF_KERNEL changed since)
        if bound is None or not bound(x, dy, args, stats):  # or tokens the Gluon kernel cannot take
            triton_launch(x, dy, args, stats)
    return launch


def _bind_gluon(weight, slots, kinds: tuple, stats, rule_name: str, stochastic: bool) -> dict:
    """kernel name -> its launches bound to this layer, for each Gluon kernel select.choose
    takes for it below and from MANY_TOKENS tokens (empty: none)."""
    chosen = {choose(weight, slots, kinds, tokens)[0] for tokens in (MANY_TOKENS - 1, MANY_TOKENS)} - {TRITON}
    if not chosen:
        return {}
    from .launch.persistent_launch import PersistentLaunch
    from .launch.wide_launch import WideLaunch

    rule_update = _kernels().RULE_UPDATES[rule_name]
    bound = {PERSISTENT: PersistentLaunch, WIDE: WideLaunch}
    return {kernel: bound[kernel](weight, slots, stats, rule_update, stochastic) for kernel in chosen}


# ------------------------------------------------------------- fused or two-pass


class WgradKey(NamedTuple):
    """What the choice of path depends on. Token counts share a decision by power-of-two
    bucket (``tokens`` is its top: 1025 to 2048 tokens are 2048), so variable-length batches
    are not timed at every new length."""

    device: str
    out_features: int
    in_features: int
    tokens: int
    token_dtype: str
    weight_dtype: str
    states: tuple  # the slots' storage kinds (core/codecs.py)
    rule: str
    column_major: bool  # a Conv1D's transposed weight


class PathTimes(NamedTuple):
    """One path's step of one layer: its GPU time, and the host time of its launches."""

    gpu_ms: float
    host_ms: float

    def eager_ms(self) -> float:
        """What the path costs an eager step: the GPU waits for launches slower than it."""
        return max(self.gpu_ms, self.host_ms)


@dataclasses.dataclass(frozen=True)
class WgradChoice:
    path: str  # "fused" or "two_pass", for eager steps
    reason: str  # "measured", "FORGE_HF_WGRAD=...", or why auto did not measure
    tokens: int  # the token count it was decided at
    fused: PathTimes | None = None
    two_pass: PathTimes | None = None
    graph_path: str = ""  # the path for captured steps, where only GPU time counts (default: path)

    def __post_init__(self):
        if not self.graph_path:
            object.__setattr__(self, "graph_path", self.path)


MEASURED = "measured"
_DECISIONS: dict[WgradKey, WgradChoice] = {}


def token_bucket(tokens: int) -> int:
    return 1 << max(tokens - 1, 0).bit_length()


def wgrad_key(x, weight, kinds: tuple, rule_name: str) -> WgradKey:
    n, k = weight.shape
    return WgradKey(str(weight.device), n, k, token_bucket(x.shape[0]), str(x.dtype).removeprefix("torch."),
                    str(weight.dtype).removeprefix("torch."), kinds, rule_name, weight.stride(0) < weight.stride(1))


def wgrad_choices() -> dict[WgradKey, WgradChoice]:
    """The path decided for each key so far, this process."""
    return dict(_DECISIONS)


def reset_wgrad_choices() -> None:
    """Forget the decisions: launches bound from now on decide again (benchmarks, tests)."""
    _DECISIONS.clear()


def _decide(key: WgradKey, mode: str, x, dy, args, measure, timing_bytes: int) -> WgradChoice | None:
    """The path for ``key`` (None: fused for now, undecided)."""
    tokens = x.shape[0]
    if mode != "auto":
        return _record(key, WgradChoice(mode, f"{WGRAD_ENV}={mode}", tokens))
    known = _DECISIONS.get(key)
    if known is not None and not known.reason.startswith(WGRAD_ENV):
        return known
    device = torch.device(key.device)
    reason = untimed_reason(x, dy, device)
    if reason is not None:
        return _record(key, WgradChoice("fused", reason, tokens))
    if is_capturing(device):
        return None
    reason = room_reason(timing_bytes, memory_room(device))
    if reason is not None:
        return _record(key, WgradChoice("fused", reason, tokens))
    try:
        times = measure(x, dy, args)
    except torch.OutOfMemoryError:
        return _record(key, WgradChoice("fused", "auto: out of memory while timing the paths", tokens))
    fused, two = times["fused"], times["two_pass"]
    return _record(key, WgradChoice(faster_path(fused.eager_ms(), two.eager_ms()), MEASURED, tokens, fused, two,
                                    graph_path=faster_path(fused.gpu_ms, two.gpu_ms)))


def _record(key: WgradKey, choice: WgradChoice) -> WgradChoice:
    previous = _DECISIONS.get(key)
    _DECISIONS[key] = choice
    if previous is None or (previous.path, previous.graph_path, previous.reason) != \
            (choice.path, choice.graph_path, choice.reason):
        log.info("%s", describe_choice(key, choice))
    return choice


def describe_choice(key: WgradKey, choice: WgradChoice) -> str:
    """One line: the layer shape, its tokens, the times if measured, the path and why."""
    times = "" if choice.fused is None else (
        f": fused {choice.fused.gpu_ms:.3f} ms on the GPU, {choice.fused.host_ms:.3f} ms on the host, two-pass "
        f"{choice.two_pass.gpu_ms:.3f} / {choice.two_pass.host_ms:.3f} ms")
    path = choice.path if choice.graph_path == choice.path else \
        f"{choice.path} eagerly, {choice.graph_path} in a CUDA graph"
    return (f"weight gradient of {key.rule} {key.out_features}x{key.in_features} {key.weight_dtype} weights on "
            f"{key.device}, {choice.tokens} {key.token_dtype} tokens (bucket <= {key.tokens}){times} -> "
            f"{path} ({choice.reason})")


def copy_layer(weight, slots) -> tuple:
    """Copies of a weight and its state slots with the same shapes and strides (the kernels
    need the slots laid out as the weight)."""
    def copy(t):
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)

    slot_copies = [None if s is None else
                   dataclasses.replace(s, codes=copy(s.codes), meta=copy(s.meta)) if isinstance(s, QuantisedSlot)
                   else dataclasses.replace(s, vectors=s.vectors.clone()) if isinstance(s, FactoredSlot)
                   else copy(s) for s in slots]
    return copy(weight), slot_copies


def _measure_paths(bind_fused, x, dy, weight, slots, args, rule_name, stochastic) -> dict[str, PathTimes]:
    """GPU and host milliseconds of this step by each path, both run on copies of the weight
    and its states: the layer itself is then stepped once, by the path chosen."""
    weight_copy, slot_copies = copy_layer(weight, slots)
    stats = torch.zeros(2, dtype=torch.float32, device=weight.device)
    fused = bind_fused(weight_copy, slot_copies, stats)
    # its own scratch: the shared one grows only for layers taking the path
    two_pass = _bind_two_pass(weight_copy, slot_copies, rule_name, stochastic, GradientScratch(weight.device))
    return _time_paths_ms({
        "fused": lambda: fused(x, dy, args, stats),
        "two_pass": lambda: two_pass(x, dy, args, stats),
    })


def _time_paths_ms(paths: dict[str, Callable[[], None]], rounds: int = MEASURE_ROUNDS) -> dict[str, PathTimes]:
    """GPU milliseconds of each path on the current stream, and the host milliseconds of its
    launches (made while the GPU is still busy, so they are not slowed by it): the best of
    ``rounds``, after one untimed run each (compilation, cuBLAS's set-up)."""
    for run in paths.values():
        run()
    gpu, host = dict.fromkeys(paths, math.inf), dict.fromkeys(paths, math.inf)
    for _ in range(rounds):
        for name, run in paths.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOST_LEAD_CYCLES)
            start.record()
            began = time.perf_counter()
            run()
            host[name] = min(host[name], (time.perf_counter() - began) * 1e3)
            end.record()
            end.synchronize()
            gpu[name] = min(gpu[name], start.elapsed_time(end))
    return {name: PathTimes(gpu[name], host[name]) for name in paths}


def launch_fused_update(x, dy, weight, slots, args, stats, rule_name, stochastic, blocks=None,
                        **options) -> None:
    """One fused step of one layer on the GPU kernels (arguments as in
    fused_update.fused_launch_arguments). ``blocks`` or launch ``options`` (num_warps,
    num_stages, maxnreg) pin the Triton kernel with them; without either, the kernel
    select.choose names runs, as in _bind_fused."""
    fused_update = _kernels()
    if blocks is None and not options:
        kernel, _ = choose(weight, slots, storage_kinds(slots), x.shape[0])
        if kernel != TRITON and tokens_unsupported(x, dy) is None:
            from .launch.persistent_launch import launch_persistent
            from .launch.wide_launch import launch_wide

            launch = launch_wide if kernel == WIDE else launch_persistent
            launch(x, dy, weight, slots, args, stats, fused_update.RULE_UPDATES[rule_name], stochastic)
            return
    config = fused_update.default_config(*weight.shape, x.shape[0])
    known = sorted(set(config) - {"blocks"})
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"unknown launch option(s) {unknown}: the fused kernel takes {known}")
    config = {**config, **options}
    grid, positional, constexprs = fused_update.fused_launch_arguments(
        x, dy, weight, slots, args, stats, rule_name, stochastic, blocks or config["blocks"])
    fused_update.launch_fused_kernel(grid, positional, constexprs, config)


def launch_rule_step(grad, weight, slots, args, stats, rule_name, stochastic) -> None:
    """The Triton kernel's rule and store for a tensor whose (N, K) gradient exists: one
    launch, no whole-tensor temporaries (ForgeOptimizer's non-fused parameters)."""
    fused_update = _kernels()
    config = fused_update.default_config(*weight.shape, 0)
    grid, positional, constexprs = fused_update.fused_launch_arguments(
        grad, grad, weight, slots, args, stats, rule_name, stochastic, config["blocks"], grad_given=True)
    fused_update.launch_fused_kernel(grid, positional, constexprs, config)
