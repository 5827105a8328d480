"""QuACK's engine in the dispatch (kernels/launch/quack_launch.py, kernels/dispatch.py): which
layers and tokens it takes, FORGE_HF_KERNEL=quack, and auto timing it beside the Gluon kernel.
The engine is stood in for on CPU; tests/kernels/test_cute_gpu.py checks its bits on a GPU."""

from dataclasses import replace

import pytest
import torch

from forge_hf.core.codecs import LEGACY_AL8_CODEC
from forge_hf.core.launch_args import pack_args
from forge_hf.kernels import cute, dispatch
from forge_hf.kernels.dispatch import PathTimes, bind_fused_update, fastest_path, launch_fused_update
from forge_hf.kernels.launch import quack_launch
from forge_hf.kernels.launch.quack_launch import quack_layout_unsupported, quack_tokens_unsupported
from tests.helpers import adamw_bf16_layer, exact_inputs, interpreter_only

GPU_BOUND = 0.01  # ms of host time, far below the GPU's


def _layer(precision="bf16", n=72, k=136):
    return adamw_bf16_layer(precision, n, k)


class _Engine:
    """Stands in for QuackLaunch: steps the layer with the Triton kernel (the engine's bits are
    the Triton kernel's) and notes that it ran; refuses tokens below ``takes_from``."""

    def __init__(self, log, takes_from=0):
        self.log, self.takes_from = log, takes_from

    def __call__(self, weight, slots, rule_name, stochastic):
        def launch(x, dy, args, stats):
            if x.shape[0] < self.takes_from:
                return False
            self.log.append(weight)
            launch_fused_update(x, dy, weight, slots, args, stats, rule_name, stochastic)
            return True
        return launch


@pytest.fixture
def engine(monkeypatch):
    """The engine applies to every layer (as on a Hopper GPU with forge-hf[hopper]): the
    weights it stepped, in order."""
    log = []
    monkeypatch.setattr(dispatch, "quack_layer_unsupported", lambda weight, slots: None)
    monkeypatch.setattr(dispatch, "check_quack_installed", lambda: None)
    monkeypatch.setattr(dispatch, "QuackLaunch", _Engine(log))
    monkeypatch.delenv("FORGE_HF_KERNEL", raising=False)
    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    return log


def _run(launch, rule, group, state, steps=2, tokens=33):
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        x, dy = exact_inputs((tokens, 136), 72, dtype=torch.bfloat16, generator=gen)
        launch(x, dy, pack_args(rule.prepare(group, state.host), state.step, 21, "cpu"), torch.zeros(2))


class _FakeTimer:
    """Stands in for the CUDA-event timing: runs each path once on its copies and reports the given times."""

    def __init__(self, times, weight):
        self.times, self.weight, self.paths = times, weight, []

    def __call__(self, paths):
        before = self.weight.clone()
        for run in paths.values():
            run()
        assert torch.equal(self.weight, before), "a timed path stepped the layer's own weight"
        self.paths.append(sorted(paths))
        return {name: self.times[name] for name in paths}


def test_the_choice_among_measured_paths():
    assert fastest_path(dict(fused=1.0, quack=0.9, two_pass=2.0)) == "quack"
    assert fastest_path(dict(fused=1.0, quack=0.98, two_pass=2.0)) == "fused"  # within the margin
    assert fastest_path(dict(fused=1.0, quack=0.9, two_pass=0.8)) == "two_pass"
    assert fastest_path(dict(fused=1.0, quack=0.9, two_pass=0.88)) == "quack"  # two-pass within its margin
    assert fastest_path(dict(fused=1.0, two_pass=0.9)) == "two_pass"


@interpreter_only
@pytest.mark.parametrize("quack_ms,path", [(0.5, "quack"), (0.99, "fused")], ids=["faster", "within_margin"])
def test_auto_times_the_engine_beside_the_gluon_kernel(quack_ms, path, engine, monkeypatch, fresh_wgrad_choices,
                                                       caplog):
    """Where the engine applies, auto's first launch at a shape times it with the other paths
    on copies of the layer; the layer then takes the faster, and the log line shows all three."""
    monkeypatch.setattr(dispatch, "_unmeasurable", lambda x, dy, device: None)
    w, state, rule, group = _layer()
    times = dict(fused=PathTimes(1.0, GPU_BOUND), quack=PathTimes(quack_ms, GPU_BOUND),
                 two_pass=PathTimes(2.0, GPU_BOUND))
    timer = _FakeTimer(times, w)
    monkeypatch.setattr(dispatch, "_time_paths_ms", timer)
    with caplog.at_level("INFO", logger="forge_hf"):
        _run(bind_fused_update("triton", w, state.kernel_slots(), torch.zeros(2), "adamw", True), rule, group, state)
    assert timer.paths == [["fused", "quack", "two_pass"]]
    stepped_own = sum(t is w for t in engine)
    assert stepped_own == (2 if path == "quack" else 0)
    [line] = [r.getMessage() for r in caplog.records if r.name == "forge_hf"]
    assert f"quack {quack_ms:.3f} / {GPU_BOUND:.3f} ms, two-pass 2.000" in line
    assert line.endswith(f"-> {path} (measured)")


@interpreter_only
def test_forge_hf_kernel_quack_takes_the_engine_and_the_gluon_kernel_the_tokens_it_refuses(
        engine, monkeypatch, fresh_wgrad_choices):
    monkeypatch.setenv("FORGE_HF_KERNEL", "quack")
    monkeypatch.setenv("FORGE_HF_WGRAD", "fused")
    monkeypatch.setattr(dispatch, "QuackLaunch", _Engine(engine, takes_from=40))
    w, state, rule, group = _layer()
    launch = bind_fused_update("triton", w, state.kernel_slots(), torch.zeros(2), "adamw", True)
    _run(launch, rule, group, state, steps=1, tokens=33)
    assert engine == []  # refused: the Triton kernel stepped it
    _run(launch, rule, group, state, steps=2, tokens=48)
    assert [t is w for t in engine] == [True, True]
    # the same bits as the Triton kernel alone (the stand-in's), every step
    w2, state2, *_ = _layer()
    monkeypatch.setenv("FORGE_HF_KERNEL", "triton")
    launch2 = bind_fused_update("triton", w2, state2.kernel_slots(), torch.zeros(2), "adamw", True)
    _run(launch2, rule, group, state2, steps=1, tokens=33)
    _run(launch2, rule, group, state2, steps=2, tokens=48)
    assert torch.equal(w, w2)


def test_forge_hf_kernel_quack_without_the_packages_is_refused_naming_the_install(monkeypatch):
    monkeypatch.setattr(cute, "_REQUIRED", ("cutlass", "quack", "forge_hf_no_such_package"))
    monkeypatch.setenv("FORGE_HF_KERNEL", "quack")
    w, state, *_ = _layer()
    before = w.clone()
    with pytest.raises(ImportError, match=r"FORGE_HF_KERNEL=quack needs .*forge_hf_no_such_package.*"
                                          r"pip install forge-hf\[hopper\]"):
        bind_fused_update("triton", w, state.kernel_slots(), torch.zeros(2), "adamw", True)
    assert torch.equal(w, before)


def test_without_the_packages_auto_never_offers_the_engine(monkeypatch):
    monkeypatch.setattr(cute, "_REQUIRED", ("forge_hf_no_such_package",))
    monkeypatch.delenv("FORGE_HF_KERNEL", raising=False)
    w, state, *_ = _layer()
    assert "forge_hf_no_such_package not installed" in quack_launch.quack_layer_unsupported(w, state.kernel_slots())


@pytest.mark.parametrize("choice", ["persistent", "triton"])
def test_the_other_kernel_choices_keep_the_engine_off(choice, monkeypatch):
    monkeypatch.setenv("FORGE_HF_KERNEL", choice)
    w, state, *_ = _layer()
    assert quack_launch.quack_layer_unsupported(w, state.kernel_slots()) == f"FORGE_HF_KERNEL={choice}"


def test_the_layers_the_engine_takes():
    w, state, *_ = _layer("bf16")
    assert quack_layout_unsupported(w, state.kernel_slots()) is None
    w, state, *_ = _layer("fp32")
    assert quack_layout_unsupported(w, state.kernel_slots()) is None
    for precision in ("int8", "al8"):
        w, state, *_ = _layer(precision, k=144)
        assert quack_layout_unsupported(w, state.kernel_slots()) is None
    w, state, *_ = _layer("al8", k=136)
    assert "multiple of 16: rows of 8-bit codes" in quack_layout_unsupported(w, state.kernel_slots())
    w, state, *_ = _layer("al8", k=144)
    slots = state.kernel_slots()
    legacy = replace(slots[1], codec=LEGACY_AL8_CODEC)
    assert "0.1.0's al8 codes" in quack_layout_unsupported(w, [slots[0], legacy, None])
    w, state, *_ = adamw_bf16_layer("bf16", 70, 136)
    assert "multiples of 8" in quack_layout_unsupported(w, state.kernel_slots())
    w, state, *_ = _layer("bf16")
    assert "must be bf16" in quack_layout_unsupported(w.float(), state.kernel_slots())
    assert "row-major" in quack_layout_unsupported(w.t().contiguous().t(), state.kernel_slots())


def test_the_tokens_the_engine_takes():
    many = quack_launch.MIN_TOKENS
    x, dy = torch.zeros(many, 16, dtype=torch.bfloat16), torch.zeros(many, 8, dtype=torch.bfloat16)
    assert quack_tokens_unsupported(x, dy) is None
    assert f"from {many}" in quack_tokens_unsupported(x[:-1], dy[:-1])
    assert "bf16" in quack_tokens_unsupported(x.float(), dy)
    assert "contiguous" in quack_tokens_unsupported(torch.zeros(16, many, dtype=torch.bfloat16).t(), dy)


@interpreter_only
def test_under_forge_hf_kernel_quack_auto_times_the_engine_as_the_fused_path(engine, monkeypatch,
                                                                              fresh_wgrad_choices):
    monkeypatch.setenv("FORGE_HF_KERNEL", "quack")
    monkeypatch.setattr(dispatch, "_unmeasurable", lambda x, dy, device: None)
    w, state, rule, group = _layer()
    timer = _FakeTimer(dict(fused=PathTimes(1.0, GPU_BOUND), two_pass=PathTimes(2.0, GPU_BOUND)), w)
    monkeypatch.setattr(dispatch, "_time_paths_ms", timer)
    _run(bind_fused_update("triton", w, state.kernel_slots(), torch.zeros(2), "adamw", True), rule, group, state)
    assert timer.paths == [["fused", "two_pass"]]
    # the engine stepped the timing's copy, then the layer at both steps
    assert [t is w for t in engine] == [False, True, True]
