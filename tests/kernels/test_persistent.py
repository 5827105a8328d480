"""The persistent Gluon kernel (kernels/gluon/persistent_update.py): where it applies, and on a
Hopper GPU that it gives triton/fused_update.py's kernel's bits.

Both kernels form the gradient block by the same 64-token wgmma chunks in the same order
and share the rules' arithmetic and the rounding hash, so weights, states and statistics
are compared for equality, over several steps, on token counts that are not multiples
of the chunk."""

import pytest
import torch

from forge_hf.core import codecs
from forge_hf.core.codecs import storage_kinds
from forge_hf.core.rules import get_rule, make_group
from forge_hf.core.state import ForgeState
from forge_hf.kernels.launch.persistent_launch import layout_unsupported, persistent_unsupported
from forge_hf.kernels.runtime.launch_args import pack_args
from forge_hf.kernels.select import choose

BF16 = torch.bfloat16


def _tensors(n=128, k=192, t=100, precision="bf16", device="cpu", rule_name="adamw", hp=None, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, k, device=device, generator=g).to(BF16)
    dy = (torch.randn(t, n, device=device, generator=g) * 1e-2).to(BF16)
    w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(BF16)
    rule = get_rule(rule_name)
    group = make_group(rule, hp or {})
    state = ForgeState(rule, precision, transposed=False)
    state.allocate(w, group)
    return x, dy, w, state, rule, group


def test_layout_checks_name_what_stands_in_the_way():
    x, dy, w, state, *_ = _tensors()
    slots = state.kernel_slots()
    assert layout_unsupported(x, dy, w, slots) is None
    assert "multiple of 64" in layout_unsupported(x[:, :160], dy, w[:, :160], [None] * 3)
    assert "bf16" in layout_unsupported(x, dy, w.float(), [None] * 3)
    assert "bf16" in layout_unsupported(x.float(), dy, w, slots)
    assert "row-major" in layout_unsupported(x, dy, w.t().contiguous().t(), [None] * 3)
    assert "laid out as the weight" in layout_unsupported(x, dy, w, [slots[0].t().contiguous().t(), None, None])
    wide = torch.zeros(100, 200, dtype=BF16)
    assert "x or dy" in layout_unsupported(wide[:, 1:193], dy, w, slots)  # 2 bytes off 16
    assert "x or dy" in layout_unsupported(x, dy.t().contiguous().t(), w, slots)
    _, _, _, int8_state, _, _ = _tensors(precision="int8")
    assert layout_unsupported(x, dy, w, int8_state.kernel_slots()) is None
    from dataclasses import replace
    int8_slots = int8_state.kernel_slots()
    row_major_meta = [replace(int8_slots[0], meta=int8_slots[0].meta.contiguous())] + int8_slots[1:]
    assert "8-bit metadata" in layout_unsupported(x, dy, w, row_major_meta)
    _, _, _, al8_state, _, _ = _tensors(precision="al8")
    assert layout_unsupported(x, dy, w, al8_state.kernel_slots()) is None
    _, _, _, fp32_state, _, _ = _tensors(precision="fp32")
    assert "neither bf16, int8, al8 nor absent" in layout_unsupported(x, dy, w, fp32_state.kernel_slots())


def test_cpu_tensors_and_the_environment_switch_keep_the_triton_kernel(monkeypatch):
    x, dy, w, state, *_ = _tensors()
    slots = state.kernel_slots()
    assert "Hopper" in persistent_unsupported(x, dy, w, slots)
    assert choose(w, slots, storage_kinds(slots), x.shape[0])[0] == "triton"
    monkeypatch.setenv("FORGE_HF_KERNEL", "triton")
    assert choose(w, slots, storage_kinds(slots), x.shape[0]) == ("triton", "FORGE_HF_KERNEL=triton")


def test_epilogue_buffers_skip_absent_slots():
    from forge_hf.kernels.gluon.persistent_update import present, s_index
    none, bf16 = codecs.NONE, codecs.BF16
    assert present(bf16, bf16, none) == 2 and present(none, none, none) == 0
    # AdamW: exp_avg, exp_avg_sq; lane 1's start after lane 0's two
    assert [s_index(1, slot, bf16, bf16, none) for slot in (0, 1)] == [2, 3]
    # a rule whose first slot is absent: its second slot takes the lane's first buffer
    assert s_index(0, 1, none, bf16, bf16) == 0 and s_index(1, 2, none, bf16, bf16) == 3
    assert s_index(1, 0, bf16, none, none) == 1


# ------------------------------------------------------------------------- on a GPU

RULES = [("adamw", dict(weight_decay=0.1)), ("nadam", dict(weight_decay=0.01)), ("radam", {}),
         ("lion", dict(weight_decay=0.1)), ("rmsprop", dict(momentum=0.9, centered=True)), ("adagrad", {}),
         ("sgd", dict(momentum=0.9, nesterov=True)), ("sgd", {})]


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _run(kernel, x, dy, w, state, rule, group, steps, stochastic, salt=77):
    from forge_hf.kernels.dispatch import launch_fused_update
    from forge_hf.kernels.launch.persistent_launch import launch_persistent
    from forge_hf.kernels.launch.wide_launch import launch_wide
    from forge_hf.kernels.triton.fused_update import RULE_UPDATES, default_config
    stats = torch.zeros(2, device=w.device)
    for _ in range(steps):
        args = pack_args(rule.prepare(group, state.host), state.host["step"], salt, w.device)
        if kernel == "persistent":
            launch_persistent(x, dy, w, state.kernel_slots(), args, stats, RULE_UPDATES[rule.name], stochastic)
        elif kernel == "wide":  # tests/kernels/test_wide.py
            launch_wide(x, dy, w, state.kernel_slots(), args, stats, RULE_UPDATES[rule.name], stochastic)
        else:
            blocks = default_config(*w.shape, x.shape[0])["blocks"]
            launch_fused_update(x, dy, w, state.kernel_slots(), args, stats, rule.name, stochastic, blocks=blocks)
    torch.cuda.synchronize()
    return [w] + [s for s in state.kernel_slots() if s is not None], stats


def assert_same_steps(got, ref):
    """Two kernels' _run results: the same weight and state bits (8-bit: codes and metadata),
    and statistics within the order of their atomic sums."""
    (got, got_stats), (ref, ref_stats) = got, ref
    for a, b in zip(got, ref):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        else:
            assert torch.equal(a.codes, b.codes) and torch.equal(a.meta, b.meta)
    torch.testing.assert_close(got_stats, ref_stats, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the persistent kernel is compiled for Hopper")
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("rule_name,hp", RULES)
@pytest.mark.parametrize("n,k,t", [(128, 192, 100), (320, 256, 515), (64, 64, 1)])
@pytest.mark.parametrize("precision", ["bf16", "int8", "al8"])
def test_same_bits_as_the_triton_kernel(rule_name, hp, n, k, t, stochastic, precision):
    results = {}
    for kernel in ("persistent", "triton"):
        x, dy, w, state, rule, group = _tensors(n, k, t, precision, "cuda", rule_name, hp)
        assert layout_unsupported(x, dy, w, state.kernel_slots()) is None
        results[kernel] = _run(kernel, x, dy, w, state, rule, group, steps=3, stochastic=stochastic)
    assert_same_steps(results["persistent"], results["triton"])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the persistent kernel is compiled for Hopper")
@pytest.mark.parametrize("precision", ["bf16", "int8", "al8"])
def test_a_block_with_a_non_finite_gradient_is_skipped_and_counted(precision):
    x, dy, w, state, rule, group = _tensors(192, 128, 70, precision, "cuda")
    dy[5, 70] = float("nan")  # rows 64-127: the second band of blocks, both columns
    tensors = lambda: [w] + [getattr(s, "codes", s) for s in state.kernel_slots() if s is not None]  # noqa: E731
    before = [t.clone() for t in tensors()]
    _, stats = _run("persistent", x, dy, w, state, rule, group, steps=1, stochastic=True)
    assert stats[1].item() == 2  # two 64 x 64 blocks
    for a, b in zip(tensors(), before):
        assert torch.equal(a[64:128], b[64:128]) and not torch.equal(a[:64], b[:64])
    assert torch.isfinite(stats[0])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the persistent kernel is compiled for Hopper")
def test_a_fused_layer_takes_the_persistent_kernel(monkeypatch):
    import forge_hf.kernels.launch.persistent_launch as persistent
    from forge_hf import patch_model
    calls = []  # a fused layer binds its launch once (dispatch.bind_fused_update) and calls that
    call = persistent.PersistentLaunch.__call__
    monkeypatch.setattr(persistent.PersistentLaunch, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    model = torch.nn.Sequential(torch.nn.Linear(192, 128, bias=False)).cuda().to(BF16)
    patch_model(model, optimizer="adamw", state_precision="bf16", min_params=0, lr=1e-3)
    before = model[0].weight.detach().clone()
    model(torch.randn(4, 33, 192, device="cuda", dtype=BF16)).float().square().mean().backward()
    assert calls and not torch.equal(model[0].weight.detach(), before)


def test_descriptors_take_the_default_swizzle_of_their_dtype():
    from triton.experimental.gluon import language as gl

    from forge_hf.kernels.gluon.persistent_update import tensor_descriptor
    for dtype, gl_dtype in [(BF16, gl.bfloat16), (torch.int16, gl.int16), (torch.int8, gl.int8)]:
        d = tensor_descriptor(torch.zeros(128, 192, dtype=dtype))
        assert d.layout == gl.NVMMASharedLayout.get_default_for([64, 64], gl_dtype)
        assert list(d.block_shape) == [64, 64] and list(d.shape) == [128, 192]


def test_token_descriptors_from_a_template_equal_tritons_and_keep_no_tensor_alive():
    """PersistentLaunch builds its tokens' descriptors from a checked one without Triton's
    checks again: the same descriptor, and the first tokens are not kept alive by it."""
    import gc
    import weakref

    from forge_hf.kernels.gluon.persistent_update import tensor_descriptor
    from forge_hf.kernels.launch.persistent_launch import PersistentLaunch

    launch = object.__new__(PersistentLaunch)  # only the descriptor part: no GPU, no kernel
    launch._token_templates = {}
    first = torch.zeros(512, 128, dtype=torch.bfloat16)
    gone = weakref.ref(first)
    assert launch._token_descriptor(first) == tensor_descriptor(first)
    del first
    gc.collect()
    assert gone() is None
    later = torch.ones(192, 320, dtype=torch.bfloat16)[:, :256]  # a view: other shape and row stride
    made = launch._token_descriptor(later)
    assert made == tensor_descriptor(later) and made.base is later
