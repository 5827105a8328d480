"""The kernels' per-step arguments (forge_hf/kernels/runtime/launch_args.py): the argument words (fp32
bit patterns of the rule's constants, then step, salt and first row as int32), the eager
arguments that advance a state by one step, and the table a captured step records and
refreshes before every replay."""

import gc
import struct
import weakref

import numpy as np
import pytest
import torch

from forge_hf.core.rules import NUM_SCALARS, get_rule, make_group
from forge_hf.core.state import ForgeState
from forge_hf.kernels.runtime.launch_args import (
    ARGS_LEN,
    ArgsTable,
    args_words,
    next_launch_args,
    pack_args,
    release_held_args,
)
from forge_hf.kernels.runtime.step_rows import StepRows, rows_for

SCALARS = [1e-3, -0.0, 0.1, 1 / 3, 3.0e38, -1.5, 2.0**-130, float("inf"), 0.9, 0.999, 1e-8, -7.0]


def test_args_words_are_fp32_bit_patterns_then_int32_integers():
    words = args_words(SCALARS, step=7, salt=0xDEADBEEF, row0=4096)
    assert len(words) == ARGS_LEN == NUM_SCALARS + 3
    # each constant rounded to fp32 (1e-3, 1/3, a subnormal), its bits read as int32
    assert words[:NUM_SCALARS] == np.array(SCALARS, dtype=np.float32).view(np.int32).tolist()
    assert words[NUM_SCALARS:] == [7, 0xDEADBEEF - 2**32, 4096]
    assert all(-(2**31) <= w < 2**31 for w in words)


@pytest.mark.parametrize("value,word", [(0, 0), (2**31 - 1, 2**31 - 1), (2**31, -(2**31)), (2**32 - 1, -1),
                                        (2**32 + 5, 5), (-1, -1)])
def test_integers_keep_their_low_32_bits(value, word):
    """The kernels read step and salt back as uint32 (so 2**31 and above survive) and
    row0 as int32."""
    assert args_words([0.0] * NUM_SCALARS, value, value, value)[NUM_SCALARS:] == [word] * 3


def test_a_rule_with_another_number_of_constants_is_refused():
    with pytest.raises(ValueError, match=f"a rule returned 11 constants; the kernels take {NUM_SCALARS}"):
        args_words([0.0] * 11, 1, 0)


def test_pack_args_is_one_int32_tensor_of_the_words():
    args = pack_args(SCALARS, 3, 2**31 + 1, "cpu", row0=64)
    assert args.dtype == torch.int32 and args.shape == (ARGS_LEN,) and args.device.type == "cpu"
    assert args.tolist() == args_words(SCALARS, 3, 2**31 + 1, 64)
    assert torch.equal(args[:NUM_SCALARS].view(torch.float32), torch.tensor(SCALARS, dtype=torch.float32))
    assert struct.pack("<i", int(args[NUM_SCALARS + 1])) == struct.pack("<I", 2**31 + 1)


@pytest.mark.parametrize("rule_name", ["adamw", "nadam"])
def test_next_launch_args_advance_the_state_by_one_step(rule_name):
    """Eagerly each call is one step: the state's counters move (NAdam's running product
    too) and the words carry that step's constants, with the lr current at the call."""
    rule = get_rule(rule_name)
    group = make_group(rule, dict(lr=1e-3))
    state, shadow = ForgeState(rule, "fp32"), rule.host_init()
    for step in range(1, 4):
        group["lr"] = 1e-3 * step
        args = next_launch_args(rule, group, state, salt=9, device="cpu", row0=2)
        expected = args_words(rule.prepare(group, shadow), step, 9, 2)
        assert state.step == step and state.host == shadow
        assert args.tolist() == expected and args.device.type == "cpu"


@pytest.mark.gpu
def test_eager_arguments_on_a_gpu_keep_one_device_row_per_state():
    rule = get_rule("adamw")
    group = make_group(rule, {})
    a, b = ForgeState(rule, "fp32"), ForgeState(rule, "fp32")
    first = next_launch_args(rule, group, a, 1, "cuda")
    assert next_launch_args(rule, group, b, 2, "cuda").data_ptr() != first.data_ptr()
    second = next_launch_args(rule, group, a, 1, "cuda")
    assert second.data_ptr() == first.data_ptr() and second.data_ptr() % 16 == 0
    torch.cuda.synchronize()
    shadow = rule.host_init()
    rule.prepare(group, shadow)
    assert second.tolist() == args_words(rule.prepare(group, shadow), 2, 1)


@pytest.mark.gpu
def test_each_launch_reads_its_own_words_while_the_gpu_lags_and_streams_change():
    """The GPU is held up while the host runs many steps ahead, their rows rewritten by one
    copy a step, and for a while the launches go to another stream: each launch must still
    read its own words (a clone on its stream stands for the kernel)."""
    rule = get_rule("adamw")
    group = make_group(rule, {})
    states = [ForgeState(rule, "fp32") for _ in range(3)]
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    seen, expected = [], []
    torch.cuda._sleep(50_000_000)  # ~25 ms: the copies queue up behind it
    for i in range(3 * 60):
        state = states[i % 3]
        stream = side if 90 <= i < 120 else main
        with torch.cuda.stream(stream):
            if i % 3 == 0:
                group["lr"] = 1e-3 * (1 + i // 3)  # a scheduler between steps
            args = next_launch_args(rule, group, state, salt=i, device="cuda")
            seen.append(args.clone())
        expected.append((state.step, i, args_words(rule.prepare(group, dict(state.host, step=state.step - 1)),
                                                  state.step, i)))
    torch.cuda.synchronize()
    got = [(int(a[NUM_SCALARS]), int(a[NUM_SCALARS + 1]), a.tolist()) for a in torch.stack(seen).cpu()]
    assert got == expected


@pytest.mark.gpu
def test_a_capture_outside_forge_is_refused_before_the_step_moves():
    rule = get_rule("adamw")
    group, state = make_group(rule, {}), ForgeState(rule, "fp32")
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="captured into a CUDA graph outside forge_hf's own capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            next_launch_args(rule, group, state, 0, "cuda")
    assert state.step == 0


# ------------------------------------------------------------- the captured step's table


def _states(rule, n):
    return [ForgeState(rule, "fp32") for _ in range(n)]


@pytest.mark.parametrize("rule_name", ["adamw", "nadam"])
def test_the_table_holds_the_eager_arguments_step_after_step(rule_name):
    """Rows recorded in a capture, refreshed before each replay, equal the arguments the
    eager step packs: same counters (NAdam's running product too), the current lr."""
    rule = get_rule(rule_name)
    group = make_group(rule, dict(lr=1e-3, weight_decay=0.1))
    eager, captured = _states(rule, 3), _states(rule, 3)
    table = ArgsTable(capacity=5, device="cpu")
    with table.recording():
        rows = [next_launch_args(rule, group, s, salt=11 * i, device="cpu", row0=i) for i, s in enumerate(captured)]
    assert [s.step for s in captured] == [0, 0, 0]  # a capture runs no step
    assert all(r.data_ptr() == table.device_rows[i].data_ptr() for i, r in enumerate(rows))
    assert all(r.data_ptr() % 16 == 0 for r in rows)  # as fresh tensors: the same compiled kernels
    for step in range(1, 5):
        group["lr"] = 1e-3 / step  # a scheduler between steps
        table.refresh()
        for i, (s, row) in enumerate(zip(eager, rows)):
            expected = next_launch_args(rule, group, s, salt=11 * i, device="cpu", row0=i)
            assert torch.equal(row, expected), f"step {step}, row {i}"
        assert [s.step for s in captured] == [step] * 3
        assert [s.host for s in captured] == [s.host for s in eager]


def test_table_rows_of_other_groups_and_step_counts_keep_their_own_arguments():
    """A refresh prepares once per rule, group and host state: rows that differ in any of
    them (a no-decay group, a state loaded at another step) still get their own words."""
    rule = get_rule("nadam")
    groups = [make_group(rule, dict(lr=1e-3, weight_decay=0.1)), make_group(rule, dict(lr=1e-3, weight_decay=0.0))]
    eager, captured = _states(rule, 6), _states(rule, 6)
    for i, s in enumerate(eager + captured):
        s.host["step"] = (i % 6) // 2  # steps 0, 0, 1, 1, 2, 2
    table = ArgsTable(capacity=6, device="cpu")
    with table.recording():
        rows = [next_launch_args(rule, groups[i % 2], s, salt=i, device="cpu", row0=i) for i, s in enumerate(captured)]
    for _ in range(3):
        table.refresh()
        for i, (s, row) in enumerate(zip(eager, rows)):
            assert torch.equal(row, next_launch_args(rule, groups[i % 2], s, salt=i, device="cpu", row0=i)), i
        assert [s.host for s in captured] == [s.host for s in eager]
    assert len({tuple(r.tolist()) for r in rows}) == 6


def test_a_bad_hyperparameter_at_refresh_moves_no_counter():
    rule = get_rule("adamw")
    good, bad = make_group(rule, dict(lr=1e-3)), make_group(rule, dict(lr=1e-3))
    states = _states(rule, 2)
    table = ArgsTable(capacity=2, device="cpu")
    with table.recording():
        next_launch_args(rule, good, states[0], 1, "cpu")
        next_launch_args(rule, bad, states[1], 2, "cpu")
    table.refresh()
    bad["betas"] = (0.3, 0.999)
    with pytest.raises(ValueError, match="0.7"):
        table.refresh()
    assert [s.step for s in states] == [1, 1]  # neither moved: the step was not run
    bad["betas"] = (0.9, 0.999)
    table.refresh()
    assert [s.step for s in states] == [2, 2]


def test_the_table_refuses_more_rows_than_its_capacity_and_nested_captures():
    rule = get_rule("adamw")
    group, (state,) = make_group(rule, {}), _states(rule, 1)
    table = ArgsTable(capacity=1, device="cpu")
    with table.recording():
        next_launch_args(rule, group, state, 0, "cpu")
        with pytest.raises(RuntimeError, match="more than 1 rule steps"):
            next_launch_args(rule, group, state, 0, "cpu")
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with ArgsTable(1, "cpu").recording():
                pass
    assert table.device_rows.shape == (1, ARGS_LEN)
    # outside a capture the eager path is back
    expected = pack_args(rule.prepare(group, dict(state.host, step=0)), 1, 0, "cpu")
    assert torch.equal(next_launch_args(rule, group, state, 0, "cpu"), expected)


# ------------------------------------------------------------- the eager rows


def _count_copies(monkeypatch) -> list[int]:
    """How many table copies the eager rows make (one list entry each)."""
    copies = []
    write = StepRows._write

    def counted(self, i, key):
        copies.append(i)
        write(self, i, key)
    monkeypatch.setattr(StepRows, "_write", counted)
    return copies


@pytest.mark.parametrize("rule_name", ["adamw", "nadam"])
def test_eager_rows_hold_each_launchs_words_with_one_copy_a_step(rule_name, monkeypatch):
    """Tensors stepped in turn, step after step, with a scheduler between steps: every
    launch reads the words of its own step, and after the first step the whole step's rows
    go to the device in one copy."""
    rule = get_rule(rule_name)
    groups = [make_group(rule, dict(lr=1e-3, weight_decay=0.1)), make_group(rule, dict(lr=1e-3, weight_decay=0.0))]
    states, shadows = _states(rule, 5), [rule.host_init() for _ in range(5)]
    copies = _count_copies(monkeypatch)
    for step in range(1, 6):
        for g in groups:
            g["lr"] = 1e-3 / step
        before = len(copies)
        for i, (state, shadow) in enumerate(zip(states, shadows)):
            args = next_launch_args(rule, groups[i % 2], state, salt=100 + i, device="cpu", row0=i)
            expected = args_words(rule.prepare(groups[i % 2], shadow), shadow["step"], 100 + i, i)
            assert args.tolist() == expected, (step, i)
            assert state.host == shadow
        if step > 1:
            assert len(copies) - before == 1, f"step {step}: {len(copies) - before} copies"


def test_eager_rows_follow_changes_within_a_step():
    """What the prediction cannot know is caught at the launch: a learning rate changed in
    the middle of a step, counters loaded from a checkpoint, a new salt, a new tensor."""
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-3))
    states = _states(rule, 3)
    for state in states:
        next_launch_args(rule, group, state, salt=1, device="cpu")
    next_launch_args(rule, group, states[0], salt=1, device="cpu")  # step 2 begins: rows predicted
    group["lr"] = 5e-4
    args = next_launch_args(rule, group, states[1], salt=1, device="cpu")
    assert args.tolist() == args_words(rule.prepare(group, {"step": 1}), 2, 1)
    states[2].host = {"step": 40}  # loaded
    args = next_launch_args(rule, group, states[2], salt=9, device="cpu", row0=8)
    assert args.tolist() == args_words(rule.prepare(group, {"step": 40}), 41, 9, 8)
    fresh = ForgeState(rule, "fp32")
    assert next_launch_args(rule, group, fresh, salt=3, device="cpu").tolist() == \
        args_words(rule.prepare(group, {"step": 0}), 1, 3)


def test_a_held_row_keeps_its_words_until_released():
    """A multi-tensor launch is queued after other launches: the rows it was given keep
    their words while other launches copy the table (a new tensor, a changed lr), and are
    predicted again once released."""
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-3))
    held, other = _states(rule, 2)
    args = next_launch_args(rule, group, held, salt=5, device="cpu", hold=True)
    words = args_words(rule.prepare(group, {"step": 0}), 1, 5)
    next_launch_args(rule, group, other, salt=6, device="cpu")  # a new row: the table is copied
    group["lr"] = 2e-3
    next_launch_args(rule, group, other, salt=6, device="cpu")  # mispredicted: copied again
    assert args.tolist() == words
    release_held_args(torch.device("cpu"))
    next_launch_args(rule, group, other, salt=6, device="cpu")
    assert args.tolist() == args_words(rule.prepare(group, {"step": 1}), 2, 5)  # predicted again


def test_a_bad_hyperparameter_fails_only_its_own_launch_and_moves_nothing():
    rule = get_rule("adamw")
    good, bad = make_group(rule, dict(lr=1e-3)), make_group(rule, dict(lr=1e-3))
    a, b = _states(rule, 2)
    next_launch_args(rule, good, a, 1, "cpu")
    next_launch_args(rule, bad, b, 2, "cpu")
    bad["betas"] = (0.3, 0.999)
    args = next_launch_args(rule, good, a, 1, "cpu")  # predicts b's next step, which fails: not a's error
    assert args.tolist() == args_words(rule.prepare(good, {"step": 1}), 2, 1)
    with pytest.raises(ValueError, match="0.7"):
        next_launch_args(rule, bad, b, 2, "cpu")
    assert b.step == 1
    bad["betas"] = (0.9, 0.999)
    assert next_launch_args(rule, bad, b, 2, "cpu").tolist() == args_words(rule.prepare(bad, {"step": 1}), 2, 2)


def test_rows_of_states_that_are_gone_are_used_again():
    rule = get_rule("adamw")
    group = make_group(rule, {})
    rows = rows_for(torch.device("cpu"))
    kept = _states(rule, 2)
    for state in kept:
        next_launch_args(rule, group, state, 0, "cpu")
    gone = _states(rule, 4)
    for state in gone:
        next_launch_args(rule, group, state, 0, "cpu")
    used = len(rows._rows)
    del gone, state
    gc.collect()
    for _ in range(3):
        newer = _states(rule, 4)
        for s in newer:
            assert next_launch_args(rule, group, s, 5, "cpu").tolist() == args_words(
                rule.prepare(group, {"step": 0}), 1, 5)
        for s in kept:  # still their own rows and words
            expected = args_words(rule.prepare(group, dict(s.host)), s.step + 1, 0)
            assert next_launch_args(rule, group, s, 0, "cpu").tolist() == expected
        del newer, s
        gc.collect()
    assert len(rows._rows) == used


def test_the_rows_let_go_of_a_group_once_its_state_is_gone():
    """An optimizer's param group holds its parameters: a row must not keep them alive after
    the optimizer (and with it the state) is dropped."""
    rule = get_rule("adamw")
    param = torch.zeros(3)
    group = {**make_group(rule, {}), "params": [param]}
    state = ForgeState(rule, "fp32")
    next_launch_args(rule, group, state, 0, "cpu")
    alive = weakref.ref(param)
    del group, state, param
    gc.collect()
    assert alive() is None


def test_a_group_with_betas_as_a_list_still_shares_one_copy_a_step(monkeypatch):
    """torch.optim keeps hyperparameters as given: ``betas=[0.9, 0.999]`` must not make
    every launch copy."""
    rule = get_rule("adamw")
    group = {**make_group(rule, {}), "betas": [0.9, 0.999], "params": [torch.zeros(2)]}
    states = _states(rule, 4)
    copies = _count_copies(monkeypatch)
    for step in range(1, 4):
        before = len(copies)
        for i, state in enumerate(states):
            expected = args_words(rule.prepare(group, dict(state.host)), step, i)
            assert next_launch_args(rule, group, state, i, "cpu").tolist() == expected
        if step > 1:
            assert len(copies) - before == 1


def test_a_group_whose_key_cannot_be_formed_still_gets_its_words(monkeypatch):
    """An unhashable hyperparameter the rule still reads (betas as a numpy array): nothing
    is shared, each launch writes its own row alone."""
    rule = get_rule("adamw")
    plain, odd = make_group(rule, {}), {**make_group(rule, {}), "betas": np.array([0.9, 0.999])}
    other, state = _states(rule, 2)
    copies = _count_copies(monkeypatch)
    for step in range(1, 4):
        next_launch_args(rule, plain, other, 0, "cpu")
        expected = args_words(rule.prepare(plain, {"step": step - 1}), step, 3)
        assert next_launch_args(rule, odd, state, 3, "cpu").tolist() == expected
        assert state.step == step
    assert len(copies) == 3 + 3  # the plain tensor's step, and the odd one's at every launch
