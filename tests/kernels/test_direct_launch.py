"""Compiled kernels launched through Triton's C launcher directly (kernels/runtime/direct_launch.py)
step the weights with the same bits as Triton's own launch path, and give way to it while a
launch hook (a profiler) is registered. On the GPU: the persistent kernel, whose weight and
state descriptors are encoded once and whose tokens' are kept by address, over steps whose
tokens move, come back and change their count (and the wide kernel the same way); and the
Triton kernel of a bound launch."""

import pytest
import torch

from forge_hf.core.rules import get_rule, make_group
from forge_hf.core.state import ForgeState
from forge_hf.kernels.runtime.direct_launch import DirectLauncher, direct_launcher
from forge_hf.kernels.runtime.launch_args import pack_args
from tests.helpers import adamw_bf16_layer, exact_inputs

BF16 = torch.bfloat16


def test_no_direct_launcher_for_what_is_not_a_compiled_cuda_kernel():
    class Compiled:  # a compiled kernel whose launcher is not Triton's CUDA launcher
        run = object()
    assert direct_launcher(Compiled(), (), 0) is None
    assert direct_launcher(object(), (), 0) is None


def test_a_hook_added_or_a_chain_replaced_sends_launches_through_triton(monkeypatch):
    """A profiler adds its hook to Triton's chains, or code assigns its own hook in their
    place: either way the direct launch, which calls no hook, must give way."""
    from triton import knobs

    launcher = object.__new__(DirectLauncher)  # only the hook check: no GPU, no kernel
    launcher._runtime = knobs.runtime
    launcher._enter, launcher._exit = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    assert not launcher.hooked()

    def hook(metadata):
        pass

    knobs.runtime.launch_exit_hook.add(hook)
    try:
        assert launcher.hooked()
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    assert not launcher.hooked()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    assert launcher.hooked()


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


class _Hooked:
    """A launch hook registered with Triton while in use (as a profiler registers one)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, metadata):
        self.calls += 1

    def __enter__(self):
        from triton import knobs
        knobs.runtime.launch_enter_hook.add(self)
        return self

    def __exit__(self, *exc):
        from triton import knobs
        knobs.runtime.launch_enter_hook.remove(self)


class _NoHook:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        pass


def _stored(w, state, stats):
    slots = [t for s in state.slots if s is not None for t in ((s.codes, s.meta) if hasattr(s, "codes") else (s,))]
    return [w, *slots, stats]


def _same(a: list, b: list) -> None:
    for x, y in zip(a[:-1], b[:-1]):
        assert torch.equal(x, y)
    torch.testing.assert_close(a[-1], b[-1], rtol=1e-6, atol=0)  # atomic sums, any order


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon kernels are compiled for Hopper")
@pytest.mark.parametrize("kernel,precision", [("persistent", "bf16"), ("persistent", "int8"), ("wide", "bf16"),
                                              ("wide", "al8")])
def test_a_gluon_kernel_launched_directly_gives_tritons_bits(kernel, precision):
    from forge_hf.kernels.launch.persistent_launch import PersistentLaunch
    from forge_hf.kernels.launch.wide_launch import WideLaunch
    from forge_hf.kernels.triton.fused_update import RULE_UPDATES

    launch_class, k = (PersistentLaunch, 192) if kernel == "persistent" else (WideLaunch, 256)
    g = torch.Generator(device="cuda").manual_seed(3)
    # tokens at two places taken in turn, then a new count at a new place, then the first again
    places = [torch.empty(t, f, device="cuda", dtype=BF16) for t, f in ((100, k), (100, 128), (100, k),
                                                                          (100, 128), (515, k), (515, 128))]
    order = [(0, 1), (2, 3), (0, 1), (4, 5), (0, 1)]
    rule = get_rule("adamw")
    results = []
    for hooked in (False, True):
        w = (torch.randn(128, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
             * 0.02).to(BF16)
        group = make_group(rule, {})
        state = ForgeState(rule, precision, transposed=False)
        state.allocate(w, group)
        stats = torch.zeros(2, device="cuda")
        launch = launch_class(w, state.kernel_slots(), stats, RULE_UPDATES["adamw"], True)
        g.manual_seed(3)
        with _Hooked() if hooked else _NoHook() as hook:
            for xi, dyi in order:
                x, dy = places[xi], places[dyi]
                x.copy_(torch.randn(x.shape, device="cuda", generator=g))
                dy.copy_(torch.randn(dy.shape, device="cuda", generator=g) * 1e-2)
                state.host["step"] += 1
                args = pack_args(rule.prepare(group, state.host), state.host["step"], 9, "cuda")
                launch(x, dy, args, stats)
        torch.cuda.synchronize()
        if hooked:
            assert hook.calls == len(order)  # Triton's path, which calls the hook
        else:
            direct = [again for again in launch._again.values()]
            assert direct and all(isinstance(a, DirectLauncher) and fixed is not None for a, fixed in direct)
            assert len(launch._expanded) == 6  # x and dy at three places
        results.append([t.clone() for t in _stored(w, state, stats)])
        # tokens the kernel cannot take, at a place it took tokens before: nothing launched
        before = [t.clone() for t in _stored(w, state, stats)]
        x = places[0]
        wider = torch.zeros(100, k + 8, device="cuda", dtype=BF16)
        for bad_x in (x.float(), wider[:, 1:k + 1]):  # fp32; a row stride and base off 16 bytes
            assert launch(bad_x, places[1], args, stats) is False
        assert launch(x, places[1].float(), args, stats) is False
        torch.cuda.synchronize()
        _same([t.clone() for t in _stored(w, state, stats)], before)
    _same(*results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a compiled kernel needs a GPU")
def test_a_bound_launch_launched_directly_gives_tritons_bits():
    from forge_hf.kernels.launch.fused_update_launch import BoundLaunch

    results = []
    for hooked in (False, True):
        w, state, rule, group = adamw_bf16_layer("bf16", device="cuda")
        n, k = w.shape
        stats = torch.zeros(2, device="cuda")
        launch = BoundLaunch(w, state.kernel_slots(), "adamw", True)
        gen = torch.Generator().manual_seed(7)
        with _Hooked() if hooked else _NoHook() as hook:
            for tokens in (33, 1, 48):
                x, dy = exact_inputs((tokens, k), n, dtype=BF16, device="cuda", generator=gen)
                args = pack_args(rule.prepare(group, state.host), state.step, 5, "cuda")
                launch(x, dy, args, stats)
        torch.cuda.synchronize()
        if hooked:
            assert hook.calls == 3  # Triton's path, which calls the hook
        else:
            assert all(isinstance(v[-1], DirectLauncher) for v in launch._variants.values())
        results.append([t.clone() for t in _stored(w, state, stats)])
    _same(*results)
