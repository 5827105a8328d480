"""The training step never makes the host wait for the GPU (GPU only).

A host-device synchronisation inside a step (a blocking copy, an ``item()``) stops the host
from queueing work ahead of the GPU; at a few hundred fused layers a step that is already
bound by the host's launch time gets slower by each stall. CUDA's sync debug mode turns
every such synchronisation into an error."""

import pytest
import torch
from torch import nn

import forge_hf
from tests.helpers import FakeTwoRanks, two_rank_gather

pytestmark = pytest.mark.gpu


@pytest.fixture
def no_host_sync():
    """Inside the test body, any host-device synchronisation raises."""

    class Guard:
        def __enter__(self):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc):
            torch.cuda.set_sync_debug_mode("default")

    return Guard()


@pytest.mark.parametrize("state_precision", ["bf16", "int8"])
def test_a_training_step_does_not_synchronise(state_precision, no_host_sync):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 200), nn.LayerNorm(200), nn.GELU(), nn.Linear(200, 70)).cuda()
    model.to(torch.bfloat16)
    report = forge_hf.patch_model(model, optimizer="adamw", state_precision=state_precision, lr=1e-3,
                                  min_params=0)
    assert len(report.fused) == 2
    opt = forge_hf.ForgeOptimizer(model, lr=1e-3)
    x = torch.randn(3, 17, 96, device="cuda", dtype=torch.bfloat16)

    def step():
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # states allocated, kernels compiled
    with no_host_sync:
        step()
        step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_data_parallel_forward_does_not_synchronise(monkeypatch, no_host_sync):
    """Data parallel: fused forwards queue their token counts without a collective or a
    copy; backward's first gather exchanges them. (A fake two-rank all-gather: one GPU
    cannot hold two NCCL ranks.)"""
    FakeTwoRanks(monkeypatch)
    layers = [two_rank_gather()]
    layers.append(two_rank_gather(layers[0].counts))
    with no_host_sync:
        for layer in layers:
            layer.announce(51)
    assert [layer._counts(51, torch.device("cuda")) for layer in layers] == [[51, 51]] * 2
