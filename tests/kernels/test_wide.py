"""The wide Gluon kernel (kernels/gluon/wide_update.py): where it applies, and on a Hopper GPU that
it gives triton/fused_update.py's kernel's bits.

Its 128 x 128 tiles form each gradient entry from the same 64-token wgmma chunks in the same
order as the 64 x 64 tiles of the other kernels, skip non-finite gradients by the same
64 x 64 blocks, and share the rules' arithmetic, the codecs and the rounding hash: weights,
states (bf16, int8, al8) and statistics are compared for equality over several steps, on
token counts that are not multiples of the chunk."""

import pytest
import torch

from forge_hf.core.codecs import storage_kinds
from forge_hf.kernels.launch.wide_launch import wide_unsupported
from forge_hf.kernels.select import choose
from tests.kernels.test_persistent import RULES, _hopper, _run, _tensors, assert_same_steps

BF16 = torch.bfloat16


def test_what_the_wide_kernel_takes_and_what_stands_in_the_way(monkeypatch):
    from forge_hf.kernels.launch import wide_launch
    monkeypatch.setattr(wide_launch, "device_unsupported", lambda device: None)  # the layouts alone
    x, dy, w, state, *_ = _tensors(256, 384, 100)
    slots = state.kernel_slots()
    assert wide_unsupported(x, dy, w, slots) is None
    assert wide_unsupported(x, dy, w, [None] * 3) is None
    assert "multiple of 128" in wide_unsupported(x[:, :320], dy, w[:, :320], [None] * 3)
    assert "multiple of 128" in wide_unsupported(x, dy[:, :192], w[:192], [None] * 3)
    assert "bf16" in wide_unsupported(x, dy, w.float(), [None] * 3)
    assert "x and dy must be bf16" in wide_unsupported(x.float(), dy, w, slots)
    assert "row-major" in wide_unsupported(x, dy, w.t().contiguous().t(), [None] * 3)
    assert "laid out as the weight" in wide_unsupported(x, dy, w, [slots[0].t().contiguous().t(), None, None])
    for precision in ("int8", "al8"):
        _, _, _, quantised, _, _ = _tensors(256, 384, 100, precision)
        assert wide_unsupported(x, dy, w, quantised.kernel_slots()) is None
    _, _, _, fp32, _, _ = _tensors(256, 384, 100, "fp32")
    assert "neither bf16, int8, al8 nor absent" in wide_unsupported(x, dy, w, fp32.kernel_slots())


def test_cpu_tensors_and_the_environment_switch_keep_the_other_kernels(monkeypatch):
    x, dy, w, state, *_ = _tensors(256, 384, 100)
    slots = state.kernel_slots()
    assert "Hopper" in wide_unsupported(x, dy, w, slots)
    monkeypatch.setenv("FORGE_HF_KERNEL", "triton")
    assert choose(w, slots, storage_kinds(slots), 2048) == ("triton", "FORGE_HF_KERNEL=triton")


# ------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the wide kernel is compiled for Hopper")
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("rule_name,hp", RULES)
@pytest.mark.parametrize("n,k,t", [(256, 384, 100), (384, 256, 515), (128, 128, 1), (256, 128, 2100)])
@pytest.mark.parametrize("precision", ["bf16", "int8", "al8"])
def test_same_bits_as_the_triton_kernel(rule_name, hp, n, k, t, stochastic, precision):
    results = {}
    for kernel in ("wide", "triton"):
        x, dy, w, state, rule, group = _tensors(n, k, t, precision, "cuda", rule_name, hp)
        assert wide_unsupported(x, dy, w, state.kernel_slots()) is None
        results[kernel] = _run(kernel, x, dy, w, state, rule, group, steps=3, stochastic=stochastic)
    assert_same_steps(results["wide"], results["triton"])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the wide kernel is compiled for Hopper")
@pytest.mark.parametrize("precision", ["bf16", "int8", "al8"])
def test_a_block_with_a_non_finite_gradient_is_skipped_and_counted(precision):
    x, dy, w, state, rule, group = _tensors(256, 256, 70, precision, "cuda")
    dy[5, 70] = float("nan")  # rows 64-127: the second band of 64 x 64 blocks, every column
    tensors = lambda: [w] + [getattr(s, "codes", s) for s in state.kernel_slots() if s is not None]  # noqa: E731
    before = [t.clone() for t in tensors()]
    _, stats = _run("wide", x, dy, w, state, rule, group, steps=1, stochastic=True)
    assert stats[1].item() == 4  # four 64 x 64 blocks
    for a, b in zip(tensors(), before):
        assert torch.equal(a[64:128], b[64:128]) and not torch.equal(a[:64], b[:64])
        assert not torch.equal(a[128:], b[128:])
    assert torch.isfinite(stats[0])
