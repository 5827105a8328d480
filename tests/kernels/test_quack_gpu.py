"""QuACK's engine through the dispatch on a Hopper GPU: a bound launch under FORGE_HF_KERNEL=quack
runs the engine and gives the Triton kernel's bits over several steps, and auto, timing it
beside the Gluon kernel, gives them whichever it keeps."""

import pytest
import torch

from forge_hf.kernels import dispatch
from forge_hf.kernels.dispatch import bind_fused_update, launch_fused_update
from forge_hf.kernels.launch import quack_launch
from tests.helpers import quack_on_hopper
from tests.kernels.test_dispatch import _steps

N, K, TOKENS = 1000, 1496, 1100  # no multiple of the engine's 128 x 128 tile; from MIN_TOKENS


pytestmark = quack_on_hopper()


def _triton_steps(precision):
    return _steps(lambda w, slots, stats: lambda x, dy, args, st: launch_fused_update(
        x, dy, w, slots, args, st, "adamw", True, blocks=(64, 64, 64)), precision, torch.device("cuda"),
        steps=3, n=N, k=K, tokens=TOKENS)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_forge_hf_kernel_quack_runs_the_engine_with_the_triton_kernels_bits(precision, monkeypatch,
                                                                             fresh_wgrad_choices):
    monkeypatch.setenv("FORGE_HF_KERNEL", "quack")
    monkeypatch.setenv("FORGE_HF_WGRAD", "fused")
    ran = []
    call = quack_launch.QuackLaunch.__call__
    monkeypatch.setattr(quack_launch.QuackLaunch, "__call__", lambda self, *a: ran.append(call(self, *a)) or ran[-1])
    bound = _steps(lambda w, slots, stats: bind_fused_update("triton", w, slots, stats, "adamw", True), precision,
                   torch.device("cuda"), steps=3, n=N, k=K, tokens=TOKENS)
    assert ran == [True] * 3
    pinned = _triton_steps(precision)
    for a, b in zip(bound[:-1], pinned[:-1]):
        assert torch.equal(a, b)
    # the statistics: tiles' squared sums added atomically, in whichever order the tiles finish
    torch.testing.assert_close(bound[-1], pinned[-1], rtol=1e-5, atol=0)


def test_auto_times_the_engine_and_keeps_the_bits(monkeypatch, fresh_wgrad_choices):
    monkeypatch.delenv("FORGE_HF_KERNEL", raising=False)
    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    monkeypatch.setattr(dispatch, "fastest_path", lambda ms: "fused" if "quack" not in ms else "quack")
    bound = _steps(lambda w, slots, stats: bind_fused_update("triton", w, slots, stats, "adamw", True), "bf16",
                   torch.device("cuda"), steps=3, n=N, k=K, tokens=TOKENS)
    [choice] = dispatch.wgrad_choices().values()
    assert choice.path == "quack" and choice.quack is not None
    pinned = _triton_steps("bf16")
    for a, b in zip(bound[:-1], pinned[:-1]):
        assert torch.equal(a, b)
