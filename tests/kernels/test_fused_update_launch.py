"""A bound launch (forge_hf/kernels/launch/fused_update_launch.py) steps a weight with the same bits as
the kernel launched through its whole argument path, call after call, whatever changes
between calls in how Triton specialises the tokens; and it keeps no call's tensors alive.
CPU tensors run under Triton's interpreter, GPU tensors on the compiled kernel."""

import gc
import weakref

import pytest
import torch

from forge_hf.kernels.dispatch import launch_rule_step
from forge_hf.kernels.launch.fused_update_launch import BoundLaunch
from forge_hf.kernels.runtime.launch_args import pack_args
from forge_hf.kernels.triton.fused_update import default_config, fused_launch_arguments, launch_fused_kernel
from tests.helpers import adamw_bf16_layer, exact_inputs


def _layer(precision, device):
    return adamw_bf16_layer(precision, device=device)


def _unbound(x, dy, w, slots, args, stats, grad_given=False):
    """The kernel through fused_launch_arguments at every call, as launch_rule_step does."""
    grid, positional, constexprs = fused_launch_arguments(x, dy, w, slots, args, stats, "adamw", True,
                                                          grad_given=grad_given)
    launch_fused_kernel(grid, positional, constexprs, default_config(*w.shape, 0 if grad_given else x.shape[0]))


def _stored(w, state, stats):
    slots = [t for s in state.slots if s is not None for t in ((s.codes, s.meta) if hasattr(s, "codes") else (s,))]
    return [w, *slots, stats]


def _tokens(step, k, n, device, gen):
    """Inputs whose specialisation changes from call to call: token counts of 33, 1 and 48,
    a strided x, fp32 tokens."""
    tokens = (33, 1, 48, 20)[step]
    x, dy = exact_inputs((tokens, k), n, dtype=torch.bfloat16, device=device, generator=gen)
    if step == 2:
        x = torch.cat([x, x], dim=1)[:, ::2]  # a column stride of 2
    if step == 3:
        x, dy = x.float(), dy.float()
    return x, dy


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_bound_launch_follows_the_unbound_one_call_after_call(precision, device):
    results = []
    for bound in (True, False):
        w, state, rule, group = _layer(precision, device)
        n, k = w.shape
        stats = torch.zeros(2, device=device)
        launch = BoundLaunch(w, state.kernel_slots(), "adamw", True)
        gen = torch.Generator().manual_seed(7)
        for step in range(4):
            x, dy = _tokens(step, k, n, device, gen)
            args = pack_args(rule.prepare(group, state.host), state.step, 5, device)
            if bound:
                launch(x, dy, args, stats)
            else:
                _unbound(x, dy, w, state.kernel_slots(), args, stats)
        results.append(_stored(w, state, stats))
    for a, b in zip(results[0][:-1], results[1][:-1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(results[0][-1], results[1][-1], rtol=1e-6, atol=0)  # atomic sums, any order


def test_each_new_specialisation_of_the_tokens_is_its_own_variant(device):
    w, state, rule, group = _layer("bf16", device)
    n, k = w.shape
    launch = BoundLaunch(w, state.kernel_slots(), "adamw", True)
    gen = torch.Generator().manual_seed(7)
    stats = torch.zeros(2, device=device)
    for step in (0, 0, 1, 2, 3, 3):
        x, dy = _tokens(step, k, n, device, gen)
        launch(x, dy, pack_args(rule.prepare(group, state.host), state.step, 5, device), stats)
    assert len(launch._variants) == 4


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("keep_last", [False, True])
def test_a_bound_rule_pass_follows_launch_rule_step(precision, keep_last, device):
    """``keep_last``: the two-pass path's call, the same gradient and argument tensors every
    time with new contents (on the GPU the last launch is repeated as it was prepared)."""
    results = []
    for bound in (True, False):
        w, state, rule, group = _layer(precision, device)
        stats = torch.zeros(2, device=device)
        launch = BoundLaunch(w, state.kernel_slots(), "adamw", True, grad_given=True, keep_last=keep_last)
        gen = torch.Generator(device="cpu").manual_seed(3)
        grad, args = torch.empty(w.shape, device=device), pack_args([0.0] * 12, 0, 0, device)
        for _ in range(3):
            grad.copy_(torch.randn(w.shape, generator=gen) * 1e-2)
            args.copy_(pack_args(rule.prepare(group, state.host), state.step, 9, device))
            if bound:
                launch(grad, grad, args, stats)
            else:
                launch_rule_step(grad, w, state.kernel_slots(), args, stats, "adamw", True)
        results.append(_stored(w, state, stats))
    for a, b in zip(results[0][:-1], results[1][:-1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(results[0][-1], results[1][-1], rtol=1e-6, atol=0)


def test_a_bound_launch_keeps_no_call_s_tensors_alive(device):
    w, state, rule, group = _layer("bf16", device)
    n, k = w.shape
    launch = BoundLaunch(w, state.kernel_slots(), "adamw", True)
    x, dy = exact_inputs((16, k), n, dtype=torch.bfloat16, device=device)
    args = pack_args(rule.prepare(group, state.host), state.step, 5, device)
    refs = [weakref.ref(t) for t in (x, dy, args)]
    launch(x, dy, args, torch.zeros(2, device=device))
    del x, dy, args
    gc.collect()
    assert all(r() is None for r in refs)
