"""Test set-up: without a GPU, Triton kernels run in the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any @triton.jit function is created, so before
forge_hf.kernels is imported. Fixtures and hooks only: what tests import is in helpers.py."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from tests.helpers import DEVICE  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    return request.param


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for tests of small tensors: on a busy 2-core machine a second
    thread mostly waits at each op's barrier (a 50-step tiny-model run: 57 s vs 2 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_wgrad_choices(monkeypatch):
    """No fused-or-two-pass decision and no scratch buffer yet (kernels/dispatch.py, two_pass.py)."""
    from forge_hf.kernels import dispatch, two_pass

    monkeypatch.setattr(dispatch, "_DECISIONS", {})
    monkeypatch.setattr(two_pass, "_SCRATCH", {})
