"""Which code performs a fused step (forge_hf/kernels/dispatch.py): the backend names and
their errors, a bound launch giving what the backend gives when called directly, and the
choice between the Gluon kernels (persistent, wide) and the Triton kernel."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_hf.kernels import dispatch, select
from forge_hf.kernels.dispatch import (
    BACKENDS,
    PathTimes,
    bind_fused_update,
    check_backend,
    launch_fused_update,
    resolve_backend,
)
from forge_hf.kernels.reference import reference_fused_update
from forge_hf.kernels.runtime.launch_args import pack_args
from tests.helpers import adamw_bf16_layer, exact_inputs, interpreter_only

CPU = torch.device("cpu")


def test_backend_names_and_an_unknown_one():
    assert BACKENDS == ("auto", "triton", "reference")
    assert [check_backend(b) for b in BACKENDS] == list(BACKENDS)
    with pytest.raises(ValueError, match=r"unknown backend='gluon': choose one of \['auto', 'triton', 'reference'\]"):
        check_backend("gluon")
    with pytest.raises(ValueError, match="unknown backend='cuda'"):
        resolve_backend("cuda", CPU)
    with pytest.raises(ValueError, match="unknown backend='Reference'"):  # names are exact
        bind_fused_update("Reference", torch.zeros(2, 2), [None] * 3, torch.zeros(2), "adamw", True)


def test_cpu_weights_under_the_interpreter(monkeypatch):
    # the kernels imported first: imported with TRITON_INTERPRET set, a GPU process's would be
    # made for the interpreter, and every later test of theirs would fail
    from forge_hf.kernels.triton import fused_update  # noqa: F401
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("reference", CPU) is reference_fused_update
    assert resolve_backend("triton", CPU) is launch_fused_update
    assert resolve_backend("auto", CPU) is launch_fused_update


def test_auto_takes_the_reference_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", CPU) is reference_fused_update
    assert resolve_backend("reference", CPU) is reference_fused_update


@pytest.mark.slow
def test_triton_on_cpu_without_the_interpreter_is_refused_in_a_fresh_process():
    """In a process where TRITON_INTERPRET was never set (Triton's kernels, if imported,
    were made for a GPU) a CPU weight with backend='triton' gets the one-line fix."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch\n"
            "from forge_hf.kernels.dispatch import resolve_backend, reference_fused_update\n"
            "assert resolve_backend('auto', torch.device('cpu')) is reference_fused_update\n"
            "resolve_backend('triton', torch.device('cpu'))\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode != 0
    assert ("RuntimeError: backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
            "the weight is on cpu: use backend='auto' or 'reference'") in done.stderr, done.stderr


# interpreter_only tests: on a GPU test_a_bound_launch_on_hopper_gives_the_triton_kernels_bits and
# the *_on_gpu tests of test_two_pass.py cover the paths


# ------------------------------------------------------------------ a bound launch


def _layer(precision="bf16", n=70, k=130, device=CPU):
    return adamw_bf16_layer(precision, n, k, device)


def _steps(launch_for, precision, device=CPU, steps=2, n=70, k=130, tokens=33):
    """Weight, states and statistics after ``steps`` launches of ``launch_for(weight,
    slots, stats)`` on the same inputs."""
    w, state, rule, group = _layer(precision, n, k, device)
    stats = torch.zeros(2, device=device)
    launch = launch_for(w, state.kernel_slots(), stats)
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        x, dy = exact_inputs((tokens, k), n, dtype=torch.bfloat16, device=device, generator=gen)
        launch(x, dy, pack_args(rule.prepare(group, state.host), state.step, 21, device), stats)
    stored = [t for s in state.slots if s is not None for t in ((s.codes, s.meta) if hasattr(s, "codes") else (s,))]
    return [w, *stored, stats]


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("backend,direct", [("reference", reference_fused_update), ("triton", launch_fused_update)])
def test_a_bound_launch_gives_the_backends_result(backend, direct, precision, device):
    bound = _steps(lambda w, slots, stats: bind_fused_update(backend, w, slots, stats, "adamw", True), precision,
                   device)
    called = _steps(lambda w, slots, stats: lambda x, dy, args, st: direct(x, dy, w, slots, args, st, "adamw", True),
                    precision, device)
    untouched = _steps(lambda w, slots, stats: lambda *step: None, precision, device)
    for a, b, before in zip(bound[:-1], called[:-1], untouched[:-1]):
        assert torch.equal(a, b)
        assert not torch.equal(a, before)  # the launches did step
    # the statistics: on a GPU the blocks' squared sums are added atomically, in any order
    torch.testing.assert_close(bound[-1], called[-1], rtol=1e-6, atol=0)
    assert not torch.equal(bound[-1], untouched[-1])


def test_launch_fused_update_refuses_an_unknown_launch_option():
    w, state, rule, group = _layer("bf16")
    before = w.clone()
    args = pack_args(rule.prepare(group, state.host), 1, 0, "cpu")
    with pytest.raises(TypeError, match=r"unknown launch option\(s\) \['num_warp', 'stages'\]: the fused kernel "
                                        r"takes \['maxnreg', 'num_stages', 'num_warps'\]"):
        launch_fused_update(torch.zeros(4, 130), torch.zeros(4, 70), w, state.kernel_slots(), args, torch.zeros(2),
                            "adamw", True, num_warp=8, stages=2)
    assert torch.equal(w, before)


# ------------------------------------------------------- the Gluon-or-Triton choice


class _Recorder:
    """Stands in for a launcher: notes which one ran."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, *args, **kwargs):
        self.log.append(self.name)


@interpreter_only
def test_each_gluon_kernel_takes_what_it_can_and_the_triton_kernel_the_rest(monkeypatch):
    """On a GPU the Gluon kernels can run (stood in for on CPU): a bf16 weight whose sides are
    multiples of 64 goes to the persistent kernel while its tokens suit it, to the Triton
    kernel when they do not; from select.MANY_TOKENS tokens, one whose sides are multiples
    of 128 goes to the wide kernel; another weight, or FORGE_HF_KERNEL, keeps them off."""
    from forge_hf.kernels import select
    from forge_hf.kernels.launch import persistent_launch, wide_launch
    from forge_hf.kernels.triton import fused_update

    log = []
    monkeypatch.setattr(fused_update, "INTERPRETER", False)
    monkeypatch.setattr(dispatch, "BoundLaunch", lambda *args, **kwargs: _Recorder("triton", log))

    class Gluon(_Recorder):  # launches (True) only tokens the kernels take, as LayerLaunch
        def __call__(self, x, dy, args, stats):
            taken = persistent_launch.tokens_unsupported(x, dy) is None
            if taken:
                super().__call__()
            return taken

    monkeypatch.setattr(persistent_launch, "PersistentLaunch", lambda *args: Gluon("persistent", log))
    monkeypatch.setattr(wide_launch, "WideLaunch", lambda *args: Gluon("wide", log))
    monkeypatch.setattr(select, "device_unsupported", lambda device: None)  # as on a Hopper GPU

    def launches(w, state, x_dtype, tokens=64):
        launch = bind_fused_update("triton", w, state.kernel_slots(), torch.zeros(2), "adamw", True)
        x, dy = torch.zeros(tokens, w.shape[1], dtype=x_dtype), torch.zeros(tokens, w.shape[0], dtype=x_dtype)
        launch(x, dy, torch.zeros(15, dtype=torch.int32), torch.zeros(2))
        return log.pop()

    many = select.MANY_TOKENS
    w, state, *_ = _layer("bf16", 128, 192)
    assert launches(w, state, torch.bfloat16) == "persistent"
    assert launches(w, state, torch.float32) == "triton"  # tokens it cannot read: the same bound launch falls back
    assert launches(w, state, torch.bfloat16, many) == "persistent"  # 192: not a multiple of 128
    w, state, *_ = _layer("bf16", 128, 256)
    assert launches(w, state, torch.bfloat16, many - 1) == "persistent"
    assert launches(w, state, torch.bfloat16, many) == "wide"
    assert launches(w, state, torch.float32, many) == "triton"
    w, state, *_ = _layer("al8", 128, 256)
    assert launches(w, state, torch.bfloat16, many) == "wide"
    w, state, *_ = _layer("bf16", 70, 130)
    assert launches(w, state, torch.bfloat16) == "triton"  # sides not multiples of 64
    w, state, *_ = _layer("fp32", 128, 192)
    assert launches(w, state, torch.bfloat16) == "triton"  # fp32 states
    monkeypatch.setenv("FORGE_HF_KERNEL", "persistent")
    w, state, *_ = _layer("bf16", 128, 256)
    assert launches(w, state, torch.bfloat16, many) == "persistent"
    monkeypatch.setenv("FORGE_HF_KERNEL", "triton")
    assert launches(w, state, torch.bfloat16) == "triton"
    assert launches(w, state, torch.bfloat16, many) == "triton"
    assert log == []


# quack: a choice of earlier versions (QuACK's engine, kept at git tag quack-engine-final)
@pytest.mark.parametrize("choice", ["gluon", "quack"])
def test_an_unknown_kernel_choice_is_refused_naming_the_choices(choice, monkeypatch):
    w, state, *_ = _layer("bf16", 128, 256)
    before = w.clone()
    monkeypatch.setenv("FORGE_HF_KERNEL", choice)
    choices = r"\['auto', 'persistent', 'triton'\]"
    with pytest.raises(ValueError, match=rf"FORGE_HF_KERNEL='{choice}': choose one of " + choices):
        bind_fused_update("triton", w, state.kernel_slots(), torch.zeros(2), "adamw", True)
    assert torch.equal(w, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("kernel,n,k,tokens", [("persistent", 128, 192, 100), ("wide", 256, 384, 1100)])
def test_a_bound_launch_on_hopper_gives_the_triton_kernels_bits(kernel, n, k, tokens, monkeypatch):
    from forge_hf.kernels.launch import gluon_launch
    ran = []
    call = gluon_launch.LayerLaunch.__call__
    monkeypatch.setattr(gluon_launch.LayerLaunch, "__call__",
                        lambda self, *a: ran.append(type(self).__name__) or call(self, *a))
    cuda = torch.device("cuda")
    bound = _steps(lambda w, slots, stats: bind_fused_update("triton", w, slots, stats, "adamw", True), "bf16",
                   cuda, steps=3, n=n, k=k, tokens=tokens)
    assert set(ran) == {"PersistentLaunch" if kernel == "persistent" else "WideLaunch"}
    pinned = _steps(lambda w, slots, stats: lambda x, dy, args, st: launch_fused_update(
        x, dy, w, slots, args, st, "adamw", True, blocks=(64, 64, 64)), "bf16", cuda, steps=3, n=n, k=k,
        tokens=tokens)
    for a, b in zip(bound[:-1], pinned[:-1]):
        assert torch.equal(a, b)
    # the statistics: blocks' squared sums added atomically, in whichever order the blocks finish
    torch.testing.assert_close(bound[-1], pinned[-1], rtol=1e-6, atol=0)


# ------------------------------------------------------- the fused-or-two-pass choice


@interpreter_only
def test_wgrad_paths_and_an_unknown_one(monkeypatch):
    assert select.WGRAD_PATHS == ("auto", "fused", "two_pass")
    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    assert select.wgrad_setting() == "auto"
    monkeypatch.setenv("FORGE_HF_WGRAD", "")
    assert select.wgrad_setting() == "auto"
    for mode in select.WGRAD_PATHS:
        monkeypatch.setenv("FORGE_HF_WGRAD", mode)
        assert select.wgrad_setting() == mode
    monkeypatch.setenv("FORGE_HF_WGRAD", "cublas")
    message = r"FORGE_HF_WGRAD='cublas': choose one of \['auto', 'fused', 'two_pass'\]"
    with pytest.raises(ValueError, match=message):
        select.wgrad_setting()
    w, state, *_ = _layer()
    with pytest.raises(ValueError, match=message):  # when a layer's launch is bound, before any step
        bind_fused_update("triton", w, state.kernel_slots(), torch.zeros(2), "adamw", True)


@interpreter_only
def test_auto_is_fused_on_cpu_without_timing(monkeypatch, fresh_wgrad_choices, caplog):
    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    monkeypatch.setattr(dispatch, "_time_paths_ms", None)  # a call would fail
    with caplog.at_level("INFO", logger="forge_hf"):
        fused = _steps(lambda w, slots, stats: bind_fused_update("triton", w, slots, stats, "adamw", True), "bf16")
    direct = _steps(lambda w, slots, stats: lambda x, dy, args, st: launch_fused_update(
        x, dy, w, slots, args, st, "adamw", True), "bf16")
    assert all(torch.equal(a, b) for a, b in zip(fused, direct))
    [(key, choice)] = dispatch.wgrad_choices().items()
    assert key == dispatch.WgradKey("cpu", 70, 130, 64, "bfloat16", "bfloat16", (2, 2, 0), "adamw", False)
    assert (choice.path, choice.reason, choice.tokens) == ("fused", "auto on cpu: no GPU to time on", 33)
    assert [r.getMessage() for r in caplog.records if r.name == "forge_hf"] == [
        "weight gradient of adamw 70x130 bfloat16 weights on cpu, 33 bfloat16 tokens (bucket <= 64) -> fused "
        "(auto on cpu: no GPU to time on)"]


def test_token_counts_share_a_decision_by_power_of_two_bucket():
    assert [dispatch.token_bucket(t) for t in (0, 1, 2, 3, 64, 65, 512, 1500, 2048, 2049, 4096)] == \
        [1, 1, 2, 4, 64, 128, 512, 2048, 2048, 4096, 4096]


class _FakeTimer:
    """Stands in for the CUDA-event timing: runs each path once, checking that it steps
    copies (the layer's own weight does not move), and reports the given times."""

    def __init__(self, times, weight):
        self.times, self.weight, self.calls = times, weight, 0

    def __call__(self, paths):
        self.calls += 1
        before = self.weight.clone()
        for run in paths.values():
            run()
        assert torch.equal(self.weight, before), "a timed path stepped the layer's own weight"
        return dict(self.times)


GPU_BOUND = 0.01  # ms of host time: far below the GPU's, as for a large layer


def time_on_the_cpu(monkeypatch, room_bytes=2**40):
    """auto as where it can time (a GPU), with this much memory left."""
    monkeypatch.setattr(dispatch, "untimed_reason", lambda x, dy, device: None)
    monkeypatch.setattr(dispatch, "memory_room", lambda device: room_bytes)


@interpreter_only
@pytest.mark.parametrize("times,path", [(dict(fused=PathTimes(2.0, GPU_BOUND), two_pass=PathTimes(1.0, GPU_BOUND)),
                                         "two_pass"),
                                        (dict(fused=PathTimes(1.0, GPU_BOUND), two_pass=PathTimes(0.99, GPU_BOUND)),
                                         "fused")],  # within the margin
                         ids=["two_pass_faster", "two_pass_barely_faster"])
def test_auto_times_both_paths_on_copies_once_per_shape(times, path, monkeypatch, fresh_wgrad_choices, caplog):
    """auto where it can time (a GPU; stood in for on CPU): the first launch at a shape
    times both paths on copies of the weight and states, then steps the layer once by the
    faster; later launches, and other layers of that shape, reuse the decision."""

    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    time_on_the_cpu(monkeypatch)
    formed_for, form = [], dispatch.weight_gradient

    def noted(x, dy, weight, scratch):
        formed_for.append(weight)
        return form(x, dy, weight, scratch)

    monkeypatch.setattr(dispatch, "weight_gradient", noted)
    timers = []

    def bound(w, slots, stats):
        timers.append(_FakeTimer(times, w))
        monkeypatch.setattr(dispatch, "_time_paths_ms", timers[-1])
        return bind_fused_update("triton", w, slots, stats, "adamw", True)

    with caplog.at_level("INFO", logger="forge_hf"):
        chosen = _steps(bound, "bf16", steps=2)
        again = _steps(bound, "bf16", steps=2)  # another layer of the same shape
    assert [t.calls for t in timers] == [1, 0]
    # the layer's own weight went through the two-pass path once a step if it won, never if not
    layer_weights = {id(t.weight) for t in timers}
    assert sum(id(w) in layer_weights for w in formed_for) == (4 if path == "two_pass" else 0)
    monkeypatch.setenv("FORGE_HF_WGRAD", path)
    forced = _steps(lambda w, slots, stats: bind_fused_update("triton", w, slots, stats, "adamw", True), "bf16")
    for a, b, c in zip(chosen, again, forced):
        assert torch.equal(a, c) and torch.equal(b, c)
    [measured] = [r.getMessage() for r in caplog.records if r.name == "forge_hf"]
    fused, two = times["fused"], times["two_pass"]
    assert measured.endswith(f": fused {fused.gpu_ms:.3f} ms on the GPU, {fused.host_ms:.3f} ms on the host, "
                             f"two-pass {two.gpu_ms:.3f} / {two.host_ms:.3f} ms -> {path} (measured)")


@interpreter_only
def test_eager_steps_count_the_host_time_of_the_launches_captured_steps_do_not(monkeypatch, fresh_wgrad_choices,
                                                                                caplog):
    """A small layer whose two-pass path is faster on the GPU but whose two launches take the
    host longer than the fused kernel's one: eager steps, where the GPU waits for the host,
    take the fused path; captured steps, which launch nothing, the two-pass path."""
    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    time_on_the_cpu(monkeypatch)
    w, state, rule, group = _layer()
    monkeypatch.setattr(dispatch, "_time_paths_ms", _FakeTimer(
        dict(fused=PathTimes(0.03, 0.05), two_pass=PathTimes(0.02, 0.10)), w))
    formed, form = [], dispatch.weight_gradient
    monkeypatch.setattr(dispatch, "weight_gradient", lambda x, dy, weight, scratch: formed.append(weight is w) or
                        form(x, dy, weight, scratch))
    captured = [False]
    monkeypatch.setattr(dispatch, "step_is_captured", lambda: captured[0])
    launch = bind_fused_update("triton", w, state.kernel_slots(), torch.zeros(2), "adamw", True)
    x, dy = exact_inputs((33, 130), 70, dtype=torch.bfloat16)
    with caplog.at_level("INFO", logger="forge_hf"):
        for step, capture in enumerate((False, False, True, True, False)):
            captured[0] = capture
            launch(x, dy, pack_args(rule.prepare(group, state.host), step + 1, 21, "cpu"), torch.zeros(2))
    assert formed == [False, True, True]  # the timing's copy of the layer, then its two captured steps
    # the captured steps' scratch size, reserved by the first eager step for a capture to grow to first
    assert dispatch.scratch_for(w.device).reserved >= w.numel()
    [choice] = dispatch.wgrad_choices().values()
    assert (choice.path, choice.graph_path) == ("fused", "two_pass")
    [line] = [r.getMessage() for r in caplog.records if r.name == "forge_hf"]
    assert line.endswith("-> fused eagerly, two_pass in a CUDA graph (measured)")


@interpreter_only
def test_a_capture_before_any_timing_runs_fused_and_decides_later(monkeypatch, fresh_wgrad_choices):
    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    time_on_the_cpu(monkeypatch)
    capturing = [True]
    monkeypatch.setattr(dispatch, "is_capturing", lambda device: capturing[0])
    w, state, rule, group = _layer()
    timer = _FakeTimer(dict(fused=PathTimes(2.0, GPU_BOUND), two_pass=PathTimes(1.0, GPU_BOUND)), w)
    monkeypatch.setattr(dispatch, "_time_paths_ms", timer)
    launch = bind_fused_update("triton", w, state.kernel_slots(), torch.zeros(2), "adamw", True)
    x, dy = exact_inputs((33, 130), 70, dtype=torch.bfloat16)
    args = pack_args(rule.prepare(group, state.host), 1, 21, "cpu")
    launch(x, dy, args, torch.zeros(2))
    assert timer.calls == 0 and dispatch.wgrad_choices() == {}
    capturing[0] = False
    launch(x, dy, args, torch.zeros(2))
    assert timer.calls == 1 and [c.path for c in dispatch.wgrad_choices().values()] == ["two_pass"]


def test_the_reference_backend_has_one_path(monkeypatch, fresh_wgrad_choices):
    monkeypatch.setenv("FORGE_HF_WGRAD", "two_pass")
    bound = _steps(lambda w, slots, stats: bind_fused_update("reference", w, slots, stats, "adamw", True), "bf16")
    direct = _steps(lambda w, slots, stats: lambda x, dy, args, st: reference_fused_update(
        x, dy, w, slots, args, st, "adamw", True), "bf16")
    assert all(torch.equal(a, b) for a, b in zip(bound, direct))
    assert dispatch.wgrad_choices() == {}


def test_auto_keeps_the_fused_path_below_its_token_threshold_without_timing():
    """Below MANY_TOKENS the fused kernel wins (kernel_microbench --paths): auto then
    neither times nor copies the layer; from it on, a GPU times both paths."""
    cuda = torch.device("cuda")
    small = torch.zeros(select.MANY_TOKENS - 1, 8, dtype=torch.bfloat16)
    large = torch.zeros(select.MANY_TOKENS, 8, dtype=torch.bfloat16)
    assert "below 1024 tokens" in select.untimed_reason(small, small, cuda)
    assert select.untimed_reason(large, large, cuda) is None


def test_room_for_the_timing_is_half_of_what_is_left():
    assert select.room_reason(2**30, 2**31) is None
    assert select.room_reason(2**30 + 1, 2**31) == ("auto with 2.00 GiB left: timing the two-pass path takes "
                                                    "1.00 GiB, more than 50% of it")


@interpreter_only
def test_a_layer_whose_timing_would_not_fit_keeps_the_fused_path_untimed(monkeypatch, fresh_wgrad_choices, caplog):
    """Near a memory cap auto neither times the paths (copies of the layer and a scratch of its
    fp32 gradient) nor takes the two-pass path, whose scratch would stay."""
    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    w, state, rule, group = _layer()
    needs = w.nbytes + state.nbytes() + 4 * w.numel()
    time_on_the_cpu(monkeypatch, room_bytes=2 * needs - 2)
    timer = _FakeTimer(dict(fused=PathTimes(2.0, GPU_BOUND), two_pass=PathTimes(1.0, GPU_BOUND)), w)
    monkeypatch.setattr(dispatch, "_time_paths_ms", timer)
    with caplog.at_level("INFO", logger="forge_hf"):
        _steps(lambda w, slots, stats: bind_fused_update("triton", w, slots, stats, "adamw", True), "bf16")
    assert timer.calls == 0
    [line] = [r.getMessage() for r in caplog.records if r.name == "forge_hf"]
    assert line.endswith("-> fused (auto with 0.00 GiB left: timing the two-pass path takes 0.00 GiB, more than "
                         "50% of it)")
