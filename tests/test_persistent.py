"""The persistent Gluon kernel (kernels/persistent_update.py): where it applies, and on a
Hopper GPU that it gives fused_update.py's kernel's bits.

Both kernels form the gradient block by the same 64-token wgmma chunks in the same order
and share the rules' arithmetic and the rounding hash, so weights, states and statistics
are compared for equality, over several steps, on token counts that are not multiples
of the chunk."""

import pytest
import torch

from forge_hf.core import codecs
from forge_hf.core.launch_args import pack_args
from forge_hf.core.rules import get_rule, make_group
from forge_hf.core.state import ForgeState
from forge_hf.kernels.persistent_launch import layout_unsupported, persistent_unsupported, weight_unsupported

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
    from dataclasses import replace
    for precision in ("int8", "al8"):  # al8: exp_avg absmax8, exp_avg_sq al8 (uint8 codes, (lo, width) a block)
        slots = _tensors(precision=precision)[3].kernel_slots()
        assert layout_unsupported(x, dy, w, slots) is None and weight_unsupported(w, slots) is None
        for i in (0, 1):
            row_major_meta = list(slots)
            row_major_meta[i] = replace(slots[i], meta=slots[i].meta.contiguous())
            assert "8-bit metadata" in layout_unsupported(x, dy, w, row_major_meta)
    _, _, _, fp32_state, _, _ = _tensors(precision="fp32")
    assert "neither bf16, int8, al8 nor absent" in layout_unsupported(x, dy, w, fp32_state.kernel_slots())


def test_cpu_tensors_and_the_environment_switch_keep_the_triton_kernel(monkeypatch):
    x, dy, w, state, *_ = _tensors()
    assert "Hopper" in persistent_unsupported(x, dy, w, state.kernel_slots())
    monkeypatch.setenv("FORGE_HF_KERNEL", "triton")
    assert persistent_unsupported(x, dy, w, state.kernel_slots()) == "FORGE_HF_KERNEL=triton"


def test_8bit_codes_travel_as_int8_and_metadata_as_allocated():
    """The state slots share one shared-memory ring of one dtype: al8's uint8 codes go in as
    their int8 view (the same bytes), next to absmax8's int8 codes."""
    from forge_hf.kernels.fused_update import RULE_UPDATES
    from forge_hf.kernels.persistent_launch import persistent_launch_arguments
    x, dy, w, state, rule, group = _tensors(precision="al8")
    slots = state.kernel_slots()
    assert [s.codes.dtype for s in slots[:2]] == [torch.int8, torch.uint8] and slots[2] is None
    args = pack_args(rule.prepare(group, state.host), state.host["step"], 0, "cpu")
    positional, constexprs, _ = persistent_launch_arguments(x, dy, w, slots, args, torch.zeros(2),
                                                            RULE_UPDATES["adamw"], True)
    s0, s1 = positional[3], positional[4]
    for desc, slot in ((s0, slots[0]), (s1, slots[1])):
        assert desc.base.dtype == torch.int8 and desc.base.data_ptr() == slot.codes.data_ptr()
    assert positional[6] is slots[0].meta and positional[7] is slots[1].meta
    assert slots[1].meta.shape == (128, 3, 2) and slots[1].meta.stride() == (2, 256, 1)
    assert (constexprs["S0"], constexprs["S1"], constexprs["S2"]) == (codecs.ABSMAX8, codecs.AL8, codecs.NONE)


def test_epilogue_buffers_skip_absent_slots():
    from forge_hf.kernels.persistent_update import present, s_index
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
    from forge_hf.kernels.fused_update import RULE_UPDATES, default_config
    from forge_hf.kernels.persistent_launch import launch_persistent
    stats = torch.zeros(2, device=w.device)
    for _ in range(steps):
        args = pack_args(rule.prepare(group, state.host), state.host["step"], salt, w.device)
        if kernel == "persistent":
            launch_persistent(x, dy, w, state.kernel_slots(), args, stats, RULE_UPDATES[rule.name], stochastic)
        else:
            blocks = default_config(*w.shape, x.shape[0])["blocks"]
            launch_fused_update(x, dy, w, state.kernel_slots(), args, stats, rule.name, stochastic, blocks=blocks)
    torch.cuda.synchronize()
    return [w] + [s for s in state.kernel_slots() if s is not None], stats


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
    (got, got_stats), (ref, ref_stats) = results["persistent"], results["triton"]
    for a, b in zip(got, ref):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        else:  # 8-bit: codes and metadata (scales; al8's (lo, width)), bit for bit
            assert torch.equal(a.codes, b.codes) and torch.equal(a.meta.view(torch.int32), b.meta.view(torch.int32))
    torch.testing.assert_close(got_stats, ref_stats, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the persistent kernel is compiled for Hopper")
@pytest.mark.parametrize("precision", ["bf16", "int8", "al8"])
def test_a_block_with_a_non_finite_gradient_is_skipped_and_counted(precision):
    x, dy, w, state, rule, group = _tensors(192, 128, 70, precision, "cuda")
    dy[5, 70] = float("nan")  # rows 64-127: the second band of blocks, both columns
    slots = [s for s in state.kernel_slots() if s is not None]
    # weight, states (8-bit: codes), and 8-bit metadata: (out_features, blocks, width), rows first
    tensors = lambda: [w] + [getattr(s, "codes", s) for s in slots] + [s.meta for s in slots if hasattr(s, "meta")]  # noqa: E731
    before = [t.clone() for t in tensors()]
    _, stats = _run("persistent", x, dy, w, state, rule, group, steps=1, stochastic=True)
    assert stats[1].item() == 2  # two 64 x 64 blocks
    for a, b in zip(tensors(), before):
        assert torch.equal(a[64:128], b[64:128]) and not torch.equal(a[:64], b[:64])
    assert torch.isfinite(stats[0])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the persistent kernel is compiled for Hopper")
@pytest.mark.parametrize("precision", ["bf16", "al8"])
def test_a_fused_layer_takes_the_persistent_kernel(monkeypatch, precision):
    import forge_hf.kernels.persistent_launch as persistent
    from forge_hf import patch_model
    calls = []
    launch, bound = persistent.launch_persistent, persistent.PersistentLaunch.__call__
    monkeypatch.setattr(persistent, "launch_persistent", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    # a layer's bound launch (dispatch.bind_fused_update) calls the kernel through PersistentLaunch
    monkeypatch.setattr(persistent.PersistentLaunch, "__call__", lambda *a: calls.append(1) or bound(*a))
    model = torch.nn.Sequential(torch.nn.Linear(192, 128, bias=False)).cuda().to(BF16)
    patch_model(model, optimizer="adamw", state_precision=precision, min_params=0, lr=1e-3)
    before = model[0].weight.detach().clone()
    model(torch.randn(4, 33, 192, device="cuda", dtype=BF16)).float().square().mean().backward()
    assert calls and not torch.equal(model[0].weight.detach(), before)


def test_descriptors_take_the_default_swizzle_of_their_dtype():
    from triton.experimental.gluon import language as gl

    from forge_hf.kernels.persistent_update import tensor_descriptor
    for dtype, gl_dtype in [(BF16, gl.bfloat16), (torch.int16, gl.int16), (torch.int8, gl.int8)]:
        d = tensor_descriptor(torch.zeros(128, 192, dtype=dtype))
        assert d.layout == gl.NVMMASharedLayout.get_default_for([64, 64], gl_dtype)
        assert list(d.block_shape) == [64, 64] and list(d.shape) == [128, 192]


def test_token_descriptors_from_a_template_equal_tritons_and_keep_no_tensor_alive():
    """PersistentLaunch builds its tokens' descriptors from a checked one without Triton's
    checks again: the same descriptor, and the first tokens are not kept alive by it."""
    import gc
    import weakref

    from forge_hf.kernels.persistent_launch import PersistentLaunch
    from forge_hf.kernels.persistent_update import tensor_descriptor

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
