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


# torch's fp32 precision settings: the one over all backends, each backend's, each op's ("none":
# the one above it applies)
FP32_PRECISION_OWNERS = [owner for owner in (
    torch.backends, torch.backends.cuda.matmul, torch.backends.cudnn, torch.backends.cudnn.conv,
    torch.backends.cudnn.rnn, torch.backends.mkldnn, torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv,
    torch.backends.mkldnn.rnn) if hasattr(owner, "fp32_precision")]
FP32_PRECISION_AT_START = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
                           [owner.fp32_precision for owner in FP32_PRECISION_OWNERS])


@pytest.fixture(autouse=True)
def fp32_precision_as_at_start():
    """Each test leaves torch's fp32 matmul precision as the process started with it.
    TrainingArguments(torch_compile=True) switches every fp32 matmul to TF32 for the rest of
    the process on an Ampere or newer GPU (transformers' enable_tf32), and one xdist worker
    runs many files: a later test comparing the fused kernels' IEEE fp32 gradients with
    torch's (test_rules_exactness) would then meet TF32's 1e-3 relative errors."""
    yield
    legacy_matmul, legacy_cudnn, precisions = FP32_PRECISION_AT_START
    if [owner.fp32_precision for owner in FP32_PRECISION_OWNERS] != precisions:
        # the legacy settings too, set first: torch refuses to read the two APIs when they disagree
        torch.set_float32_matmul_precision(legacy_matmul)
        torch.backends.cudnn.allow_tf32 = legacy_cudnn
        for owner, precision in zip(FP32_PRECISION_OWNERS, precisions):
            owner.fp32_precision = precision
