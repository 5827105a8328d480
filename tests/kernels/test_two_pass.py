"""The two-pass step (kernels/two_pass.py): the whole fp32 weight gradient by a
GEMM into a scratch buffer shared by every layer, then the fused kernel's rule over it.
Against torch.optim and float64 on shapes that are not multiples of the tile, bit for bit
against the fused path where the gradient does not depend on summation order and close to
it where it does; one scratch buffer reused across layers. On CPU the Triton kernels run in
the interpreter (conftest.py); the GPU tests run cuBLAS and CUDA graphs."""

import weakref

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from forge_hf import ForgeLinear
from forge_hf.core.codecs import QuantisedSlot
from forge_hf.kernels import dispatch, two_pass
from forge_hf.kernels.select import WGRAD_ENV, faster_path
from forge_hf.kernels.two_pass import GradientScratch, scratch_for
from forge_hf.nn.conv1d import ForgeConv1D
from tests.helpers import RTOL_FP32, assert_close_rel, bf16_ulps_apart, exact_gradient, exact_inputs, interpreter_only

LR = 1e-2
PRECISIONS = [  # (weight dtype, state precision, rounding), as tests/kernels/test_backends.py's, and 8-bit states
    (torch.float32, "fp32", "stochastic"),
    (torch.float32, "bf16", "stochastic"),
    (torch.bfloat16, "bf16", "stochastic"),
    (torch.bfloat16, "int8", "stochastic"),
    (torch.bfloat16, "fp32", "nearest"),
]
PRECISION_IDS = [f"{str(w)[6:]}-{s}-{r}" for w, s, r in PRECISIONS]


# interpreter_only tests: the *_on_gpu tests below cover the GPU path. Each test decides its
# paths and grows its scratch buffers from nothing.
pytestmark = pytest.mark.usefixtures("fresh_wgrad_choices")


@pytest.fixture
def gradients_formed(monkeypatch):
    """The gradients the two-pass path formed, as it handed them to the rule: proof the
    path ran, and their layout."""
    formed = []
    weight_gradient = dispatch.weight_gradient

    def noted(*args):
        grad = weight_gradient(*args)
        formed.append(grad)
        return grad

    monkeypatch.setattr(dispatch, "weight_gradient", noted)
    return formed


def _fused_layer(shape, wdtype, precision="fp32", rounding="stochastic", conv1d=False, device="cpu", **hp):
    out_features, in_features = shape
    torch.manual_seed(5)
    options = dict(optimizer="adamw", state_precision=precision, rounding=rounding, seed=11, backend="triton",
                   lr=LR, **hp)
    if conv1d:
        layer = ForgeConv1D.from_conv1d(Conv1D(out_features, in_features).to(device=device, dtype=wdtype), **options)
    else:
        linear = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=wdtype)
        layer = ForgeLinear.from_linear(linear, **options)
    return layer


def _trained(path, monkeypatch, shape=(70, 130), wdtype=torch.float32, precision="fp32", rounding="stochastic",
             conv1d=False, steps=3, tokens=45, gaussian=False, device="cpu"):
    """A layer stepped ``steps`` times by ``path`` on the same inputs as every other call."""
    monkeypatch.setenv(WGRAD_ENV, path)
    layer = _fused_layer(shape, wdtype, precision, rounding, conv1d, device)
    gen = torch.Generator().manual_seed(3)
    out_features, in_features = shape
    for _ in range(steps):
        if gaussian:
            x = torch.randn(tokens, in_features, generator=gen).to(device, wdtype)
            dy = torch.randn(tokens, out_features, generator=gen).to(device, wdtype) * 1e-2
        else:
            x, dy = exact_inputs((tokens, in_features), out_features, dtype=wdtype, device=device, generator=gen)
        layer(x).backward(dy)
    return layer


def _stored(layer) -> list[torch.Tensor]:
    """The weight and every state tensor (8-bit codes and their metadata)."""
    tensors = [layer.weight.detach()]
    for slot in layer.forge_state.slots:
        if isinstance(slot, QuantisedSlot):
            tensors += [slot.codes, slot.meta]
        elif slot is not None:
            tensors.append(slot)
    return tensors


# ------------------------------------------------------------ exactness


@interpreter_only
@pytest.mark.parametrize("shape", [(70, 45), (130, 200)], ids=["70x45", "130x200"])
def test_two_pass_matches_torch_optim_and_float64(shape, monkeypatch, gradients_formed):
    """fp32 weights and states, AdamW, a different lr each step, shapes that are not
    multiples of the 64-wide tile: as tests/core/test_rules_exactness.py asks of the fused path."""
    monkeypatch.setenv(WGRAD_ENV, "two_pass")
    out_features, in_features = shape
    hp = dict(weight_decay=0.1, betas=(0.9, 0.99))
    layer = _fused_layer(shape, torch.float32, **hp)
    start = layer.weight.detach().clone()
    p32, p64 = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.double())
    opt32 = torch.optim.AdamW([p32], lr=LR, foreach=False, **hp)
    opt64 = torch.optim.AdamW([p64], lr=LR, foreach=False, **hp)
    gen = torch.Generator().manual_seed(1)
    steps = 5
    for step in range(steps):
        lr = LR * (0.5 + 0.25 * step)
        layer.forge_group["lr"] = lr
        x, dy = exact_inputs((7, 11, in_features), out_features, generator=gen)
        layer(x).backward(dy)
        g = exact_gradient(x, dy)
        for opt, p in ((opt32, p32), (opt64, p64)):
            opt.param_groups[0]["lr"] = lr
            p.grad = g.to(p.dtype)
            opt.step()
    assert len(gradients_formed) == steps and layer.weight.grad is None
    assert_close_rel(layer.weight.detach(), p32.detach(), what="two-pass vs torch.optim fp32")
    assert_close_rel(layer.weight.detach(), p64.detach(), what="two-pass vs float64")
    for slot, name in zip(layer.forge_state.slots, ("exp_avg", "exp_avg_sq")):
        assert_close_rel(slot, opt32.state[p32][name], what=name)


@interpreter_only
def test_two_pass_bf16_nearest_is_the_fp32_update_rounded_once(monkeypatch, gradients_formed):
    """bf16 weights, round to nearest: each step is torch's fp32 AdamW step from the same
    bf16 weight, rounded once (as tests/core/test_precision.py asks of the fused path)."""
    monkeypatch.setenv(WGRAD_ENV, "two_pass")
    hp = dict(weight_decay=0.01)
    layer = _fused_layer((130, 200), torch.bfloat16, rounding="nearest", **hp)
    shadow = torch.nn.Parameter(layer.weight.detach().float())
    opt = torch.optim.AdamW([shadow], lr=LR, foreach=False, **hp)
    gen = torch.Generator().manual_seed(3)
    identical, total = 0, 0
    for _ in range(4):
        with torch.no_grad():
            shadow.copy_(layer.weight.float())
        x, dy = exact_inputs((7, 11, 200), 130, dtype=torch.bfloat16, generator=gen)
        layer(x).backward(dy)
        shadow.grad = exact_gradient(x, dy).float()
        opt.step()
        ulps = bf16_ulps_apart(layer.weight.detach(), shadow.detach().bfloat16())
        assert int(ulps.max()) <= 1
        identical, total = identical + int((ulps == 0).sum()), total + ulps.numel()
    assert len(gradients_formed) == 4
    assert identical / total >= 0.999, f"only {identical / total:.5f} bit-identical"


@interpreter_only
@pytest.mark.parametrize("precision", PRECISIONS, ids=PRECISION_IDS)
def test_two_pass_gives_the_fused_paths_bits(precision, monkeypatch, gradients_formed):
    """Exactly summable inputs: both paths form the same fp32 gradient, and the rule and
    rounding are the same code, so weights and states agree bit for bit."""
    wdtype, state, rounding = precision
    fused = _trained("fused", monkeypatch, wdtype=wdtype, precision=state, rounding=rounding)
    assert gradients_formed == []
    split = _trained("two_pass", monkeypatch, wdtype=wdtype, precision=state, rounding=rounding)
    assert len(gradients_formed) == 3
    for a, b in zip(_stored(split), _stored(fused)):
        assert torch.equal(a, b)
    torch.testing.assert_close(split.forge_stats, fused.forge_stats, rtol=1e-6, atol=0)
    assert not torch.equal(split.weight, _fused_layer((70, 130), wdtype).weight)  # it did step


@interpreter_only
def test_a_conv1d_weight_gets_a_column_major_gradient(monkeypatch, gradients_formed):
    """Conv1D stores its weight (in, out): the kernels read it transposed, and the gradient
    is formed in that layout too."""
    fused = _trained("fused", monkeypatch, shape=(70, 130), precision="int8", conv1d=True)
    split = _trained("two_pass", monkeypatch, shape=(70, 130), precision="int8", conv1d=True)
    assert all(g.shape == (70, 130) and g.stride() == (1, 70) for g in gradients_formed)
    for a, b in zip(_stored(split), _stored(fused)):
        assert torch.equal(a, b)


@interpreter_only
def test_gaussian_gradients_agree_with_the_fused_path_to_round_off(monkeypatch):
    """Ordinary inputs: the two paths sum the tokens in different orders, so the gradients
    differ by fp32 round-off, which Adam's normalisation can enlarge for an entry whose
    gradient is near zero (tolerances as tests/core/test_rules_exactness.py's autograd test)."""
    fused = _trained("fused", monkeypatch, shape=(130, 200), tokens=300, gaussian=True)
    split = _trained("two_pass", monkeypatch, shape=(130, 200), tokens=300, gaussian=True)
    diff = (split.weight - fused.weight).abs() / fused.weight.abs().max()
    assert (diff <= RTOL_FP32).float().mean() >= 0.999
    assert diff.max() <= 1e-3
    torch.testing.assert_close(split.forge_stats, fused.forge_stats, rtol=1e-5, atol=0)


# ------------------------------------------------------------ the scratch buffer


def test_the_scratch_buffer_grows_only_when_a_larger_layer_needs_it():
    scratch = GradientScratch("cpu")
    big = scratch.view(130, 200)
    assert big.shape == (130, 200) and big.dtype == torch.float32 and big.is_contiguous()
    small = scratch.view(70, 45)
    assert small.data_ptr() == big.data_ptr() and scratch.allocations == 1
    assert scratch.nbytes == 130 * 200 * 4
    larger = scratch.view(200, 300)
    assert scratch.allocations == 2 and scratch.nbytes == 200 * 300 * 4
    assert scratch.view(130, 200).data_ptr() == larger.data_ptr() and scratch.allocations == 2


def test_a_grown_buffer_is_freed_though_a_rule_pass_kept_a_view_of_it():
    """The two-pass rule pass keeps its last call's scratch view (to launch again without
    preparing it): when the buffer grows, it lets go, and the old buffer is freed."""

    from forge_hf.kernels.launch.fused_update_launch import BoundLaunch
    from tests.helpers import adamw_bf16_layer

    w, state, *_ = adamw_bf16_layer("bf16", device="cpu")
    scratch = GradientScratch("cpu")
    rule_pass = BoundLaunch(w, state.kernel_slots(), "adamw", True, grad_given=True, keep_last=True)
    scratch.keep_viewed_by(rule_pass)
    rule_pass._last = (scratch.view(*w.shape),)  # as a compiled launch leaves it
    old = weakref.ref(scratch.buffer)
    scratch.view(w.shape[0] * 2, w.shape[1])
    assert rule_pass._last is None and old() is None
    scratch.reserve(10**6)
    assert scratch.nbytes == w.numel() * 2 * 4  # reserving allocates nothing
    two_pass._SCRATCH[torch.device("meta")] = GradientScratch("meta")
    try:
        two_pass._SCRATCH[torch.device("meta")].reserve(123)
        two_pass.grow_reserved_scratch()  # before a capture
        assert two_pass._SCRATCH[torch.device("meta")].nbytes == 123 * 4
    finally:
        del two_pass._SCRATCH[torch.device("meta")]


@interpreter_only
def test_layers_of_different_sizes_share_one_scratch_buffer(monkeypatch, gradients_formed):
    """A two-layer model: backward steps the larger layer first, so one allocation of its
    size serves both layers, step after step; it is the device's only gradient memory."""
    monkeypatch.setenv(WGRAD_ENV, "two_pass")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(45, 130, bias=False), torch.nn.Linear(130, 200, bias=False))
    for i, linear in enumerate(model):
        model[i] = ForgeLinear.from_linear(linear, backend="triton", lr=LR)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x = torch.randn(33, 45, generator=gen)
        model(x).square().mean().backward()
    scratch = scratch_for("cpu")
    assert scratch_for(torch.device("cpu")) is scratch
    assert scratch.allocations == 1 and scratch.nbytes == 200 * 130 * 4
    assert [tuple(g.shape) for g in gradients_formed] == [(200, 130), (130, 45)] * 2
    assert {g.data_ptr() for g in gradients_formed} == {scratch.buffer.data_ptr()}
    assert all(p.grad is None for p in model.parameters())


def test_a_capture_cannot_grow_the_scratch_buffer(monkeypatch):
    """A CUDA graph records the buffer's address: allocated by an eager step first, it
    serves a capture; growing it inside one is refused, and an outgrown buffer a capture
    used stays alive for the graph's replays. (The capture is stood in for on CPU.)"""
    scratch = GradientScratch("cpu")
    capturing = [True]
    monkeypatch.setattr(two_pass, "is_capturing", lambda device: capturing[0])
    with pytest.raises(RuntimeError, match=r"a \(70, 45\) layer needs a 3150-element scratch buffer on cpu and "
                                           r"a CUDA graph is being captured with 0 elements allocated"):
        scratch.view(70, 45)
    capturing[0] = False
    eager = scratch.view(70, 45)
    capturing[0] = True
    assert scratch.view(45, 70).data_ptr() == eager.data_ptr()
    with pytest.raises(RuntimeError, match="a capture cannot grow it"):
        scratch.view(130, 200)
    capturing[0] = False
    scratch.view(130, 200)
    assert scratch.allocations == 2 and [t.data_ptr() for t in scratch._outgrown] == [eager.data_ptr()]


# ------------------------------------------------------------ GPU


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("precision", [(torch.bfloat16, "bf16", "stochastic"), (torch.bfloat16, "int8", "stochastic"),
                                       (torch.float32, "fp32", "stochastic")], ids=["bf16", "int8", "fp32"])
def test_cublas_two_pass_gives_the_fused_paths_bits_on_gpu(precision, monkeypatch, gradients_formed):
    """cuBLAS with fp32 accumulation on exactly summable tokens (up to 4096): the gradient
    does not depend on its summation order, so the paths agree bit for bit on the GPU too
    (the persistent kernel takes the bf16 layers' fused path)."""
    wdtype, state, rounding = precision
    args = dict(shape=(384, 256), wdtype=wdtype, precision=state, rounding=rounding, tokens=2000, device="cuda")
    fused = _trained("fused", monkeypatch, **args)
    split = _trained("two_pass", monkeypatch, **args)
    assert len(gradients_formed) == 3
    for a, b in zip(_stored(split), _stored(fused)):
        assert torch.equal(a, b)
    torch.testing.assert_close(split.forge_stats, fused.forge_stats, rtol=1e-5, atol=0)


@pytest.mark.gpu
@CUDA
def test_auto_measures_once_per_shape_and_steps_the_weight_once_on_gpu(monkeypatch):
    """auto at 4096 tokens: the first step times both paths on copies of the layer, records
    and logs the choice; the weight itself is stepped once, by the chosen path (both paths
    give the same bits on these inputs, so one forced step is the expected result)."""
    monkeypatch.delenv(WGRAD_ENV, raising=False)
    shape, tokens = (1024, 2048), 4096
    once = _trained("fused", monkeypatch, shape=shape, wdtype=torch.bfloat16, precision="bf16", steps=1,
                    tokens=tokens, device="cuda")
    dispatch._DECISIONS.clear()
    monkeypatch.setenv(WGRAD_ENV, "auto")
    auto = _trained("auto", monkeypatch, shape=shape, wdtype=torch.bfloat16, precision="bf16", steps=1,
                    tokens=tokens, device="cuda")
    for a, b in zip(_stored(auto), _stored(once)):
        assert torch.equal(a, b)
    [(key, choice)] = dispatch.wgrad_choices().items()
    assert (key.out_features, key.in_features, key.tokens) == (1024, 2048, 4096)
    assert choice.reason == "measured" and min(*choice.fused, *choice.two_pass) > 0
    assert choice.path == faster_path(choice.fused.eager_ms(), choice.two_pass.eager_ms())
    assert choice.graph_path == faster_path(choice.fused.gpu_ms, choice.two_pass.gpu_ms)
    print(dispatch.describe_choice(key, choice))


@pytest.mark.gpu
@CUDA
def test_a_captured_two_pass_step_replays_the_eager_steps_bits(monkeypatch):
    """The scratch buffer grown by an eager step serves a CUDA graph's capture; replays
    give the bits eager steps give."""
    from forge_hf.core.rules import get_rule, make_group
    from forge_hf.core.state import ForgeState
    from forge_hf.kernels.runtime.launch_args import pack_args

    monkeypatch.setenv(WGRAD_ENV, "two_pass")
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=LR, weight_decay=0.1))
    gen = torch.Generator().manual_seed(6)
    x, dy = exact_inputs((1000, 256), 384, dtype=torch.bfloat16, device="cuda", generator=gen)

    def layer():
        w = torch.linspace(-0.5, 0.5, 384 * 256, device="cuda").view(384, 256).bfloat16()
        state = ForgeState(rule, "bf16", transposed=False)
        state.allocate(w, group)
        stats = torch.zeros(2, device="cuda")
        launch = dispatch.bind_fused_update("triton", w, state.kernel_slots(), stats, "adamw", True)
        return w, state, stats, launch

    args = pack_args(rule.prepare(group, layer()[1].host), 1, 21, "cuda")
    eager, graphed = layer(), layer()
    for _ in range(3):
        eager[3](x, dy, args, eager[2])
    graphed[3](x, dy, args, graphed[2])  # eager: compiles, grows the scratch buffer
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed[3](x, dy, args, graphed[2])
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed[0], eager[0])
    for a, b in zip(graphed[1].slots, eager[1].slots):
        assert a is None or torch.equal(a, b)
