"""benchmarks/trainer_bench.py's row names: an arm's options are part of its name, so the
report (one row per model, batch and arm) keeps configurations apart."""

import json

import pytest

from tests.helpers import benchmark_module


@pytest.fixture(scope="module")
def trainer_bench():
    with benchmark_module("trainer_bench") as module:
        yield module


def test_an_arm_is_named_by_its_options(trainer_bench, monkeypatch):
    monkeypatch.delenv("FORGE_HF_KERNEL", raising=False)
    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    label = trainer_bench.arm_label
    assert label("forge", "", False) == "trainer_forge"
    assert label("forge_compile_int8", "lean_loss=true, recompute_swiglu=true", False) == \
        "trainer_forge_compile_int8+lean_loss+recompute_swiglu"
    assert label("forge", "recompute_swiglu=true", True) == "trainer_forge+liger+recompute_swiglu"
    # forge options do not reach the fused-AdamW arms; Liger does
    assert label("adamw_fused", "recompute_swiglu=true", True) == "trainer_adamw_fused+liger"
    assert label("adamw_fused_compile", "lean_loss=true", False) == "trainer_adamw_fused_compile"
    assert label("forge", "recompute_swiglu=true,lean_loss=true", False) == "trainer_forge+lean_loss+recompute_swiglu"
    # the ablations name forge arms only; the way of timing names every arm
    assert label("forge", "lean_loss=true", True, "torch", False) == \
        "trainer_forge+liger+lean_loss+torch_loss_rows+no_overlap"
    assert label("adamw_fused", "", False, "torch", False) == "trainer_adamw_fused"
    assert label("adamw_fused_compile", "", False, step_sync=False) == "trainer_adamw_fused_compile+no_step_sync"
    assert label("forge", "", False, step_sync=False, non_blocking=True) == "trainer_forge+non_blocking+no_step_sync"
    # the kernel and weight-gradient switches of the environment name forge arms only
    monkeypatch.setenv("FORGE_HF_KERNEL", "persistent")
    monkeypatch.setenv("FORGE_HF_WGRAD", "two_pass")
    assert label("forge", "lean_loss=true", True, step_sync=False) == \
        "trainer_forge+liger+lean_loss+kernel_persistent+wgrad_two_pass+no_step_sync"
    assert label("adamw_fused", "", False) == "trainer_adamw_fused"


def test_each_steps_peak_names_the_step_that_allocated_what_is_alive(trainer_bench):
    from capture_memory import peaks_by_step

    frames = [{"filename": "/venv/site-packages/forge_hf/nn/linear.py", "line": 1, "name": "forward"}]
    trace = [
        dict(action="alloc", addr=1, size=100, frames=frames),  # step 0: kept into step 1
        dict(action="alloc", addr=2, size=50, frames=frames),
        dict(action="free_requested", addr=2),
        dict(action="alloc", addr=3, size=30, frames=frames),  # step 1
        dict(action="free_requested", addr=3),
        dict(action="free_requested", addr=1),
    ]
    (peak0, sites0), (peak1, sites1), (peak2, sites2) = peaks_by_step(trace, [3, 6, 6])
    assert peak0 == 150 and sites0 == {"step 0: forge_hf/nn/linear.py:1 forward": 150}
    assert peak1 == 130 and sites1 == {"step 0: forge_hf/nn/linear.py:1 forward": 100,
                                       "step 1: forge_hf/nn/linear.py:1 forward": 30}
    assert peak2 == 0 and sites2 == {}  # a step that allocates nothing peaks at what it started with


def test_rounds_interleave_the_arms_a_row_each(trainer_bench, monkeypatch, tmp_path):
    """--rounds 2: A, B, then B, A, each row noting its round, in the table as each arm ends."""
    ran = []

    def run_arm(arm, *args):
        ran.append(arm)
        return dict(step_ms=1.0, spread_ms=0.0, peak_gib=0.0, note="20 steps after 6")

    monkeypatch.setattr(trainer_bench, "run_arm", run_arm)
    out = tmp_path / "rows.json"
    monkeypatch.setattr("sys.argv", ["trainer_bench", "--arms", "adamw_fused,forge_eager", "--rounds", "2",
                                     "--table", str(tmp_path / "results.csv"), "--out", str(out)])
    trainer_bench.main()
    rows = json.loads(out.read_text())
    assert ran == ["adamw_fused", "forge_eager", "forge_eager", "adamw_fused"]
    assert [r["arm"] for r in rows] == ["trainer_adamw_fused", "trainer_forge_eager", "trainer_forge_eager",
                                        "trainer_adamw_fused"]
    assert [r["note"] for r in rows] == [f"20 steps after 6; round {r} of 2" for r in (1, 1, 2, 2)]
    assert (tmp_path / "results.csv").read_text().count("trainer_forge_eager") == 2
    monkeypatch.setattr("sys.argv", ["trainer_bench", "--rounds", "0"])
    with pytest.raises(SystemExit):
        trainer_bench.main()


def test_accumulation_and_clipping_reach_every_arm_and_its_name(trainer_bench, monkeypatch, tmp_path):
    """--accumulation 4 --max-grad-norm 1: every arm's TrainingArguments take both, and the row names them."""
    seen = []
    monkeypatch.setattr(trainer_bench, "TRAINING_ARGS", dict(trainer_bench.TRAINING_ARGS))
    monkeypatch.setattr(trainer_bench, "run_arm", lambda arm, *args: seen.append(dict(trainer_bench.TRAINING_ARGS))
                        or dict(step_ms=1.0, spread_ms=0.0, peak_gib=0.0, note=""))
    out = tmp_path / "rows.json"
    monkeypatch.setattr("sys.argv", ["trainer_bench", "--arms", "adamw_fused_compile,forge", "--accumulation", "4",
                                     "--max-grad-norm", "1", "--table", str(tmp_path / "results.csv"),
                                     "--out", str(out)])
    trainer_bench.main()
    assert [r["arm"] for r in json.loads(out.read_text())] == ["trainer_adamw_fused_compile+accumulation4+clip1",
                                                               "trainer_forge+accumulation4+clip1"]
    assert all(a["gradient_accumulation_steps"] == 4 and a["max_grad_norm"] == 1.0 for a in seen)
    monkeypatch.setattr("sys.argv", ["trainer_bench", "--accumulation", "0"])
    with pytest.raises(SystemExit):
        trainer_bench.main()


def test_the_steps_that_captured_no_graph_are_reported_apart(trainer_bench):
    """A cell of varying lengths captures a graph at each new shape's first batch, inside the
    timed steps: the note gives the pace of the others too (a long run's, once every shape is
    captured), with their real tokens a second (1000 tokens a batch: k tokens/ms = M/s)."""
    assert trainer_bench.steady_note([10.0, 20.0], 2, 1000.0) == ""  # no step captured: nothing more to say
    assert trainer_bench.steady_note([10.0, 30.0], 3, 1000.0) == \
        "the 2 of 3 timed steps that captured no graph: mean 20.0 ms, 50.0k real tokens/s; "
    assert trainer_bench.steady_note([], 4, 1000.0) == "every one of the 4 timed steps captured a graph; "


def test_cells_of_varying_lengths(trainer_bench):
    """4x8-20: rows of 8 to 20 tokens, padded to each batch's longest row under labels -100, or
    flattened into one row with position_ids; the note's padding shares follow the widths."""
    packed = trainer_bench.Cell("4x16")
    assert not packed.varies and packed.label == "4x16" and len(packed.dataset(3, 50)[0]["input_ids"]) == 16
    cell = trainer_bench.Cell("4x8-20")
    data = cell.dataset(8, 50)
    lengths = [len(data[i]["input_ids"]) for i in range(4)]
    assert all(8 <= n <= 20 for n in lengths)
    batch = cell.collate([data[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, max(lengths))
    assert batch["attention_mask"].sum().item() == sum(lengths) == cell.real_tokens[0]
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    share = 1 - sum(lengths) / (4 * max(lengths))
    bucketed = 1 - sum(lengths) / (4 * 32)
    assert cell.padding_note(32) == \
        f"; padding {share:.1%} of tokens to the longest row, {bucketed:.1%} to buckets of 32"
    flat = trainer_bench.Cell("4x8-20", "flat")
    batch = flat.collate([data[i] for i in range(4)])
    assert flat.label == "4x8-20/flat" and batch["input_ids"].shape == (1, sum(lengths))
    assert batch["position_ids"][0, :lengths[0]].tolist() == list(range(lengths[0]))


def test_the_report_orders_cells_of_varying_lengths():
    with benchmark_module("report") as report:
        assert report.cell_size("4x512") == (4, 512)
        assert report.cell_size("4x128-512") == (4, 512)
        assert report.cell_size("4x128-512/flat") == (4, 512)
        assert report.cell_size("params") == (0, 0)


def test_a_negative_memory_cap_is_refused_with_its_value(trainer_bench, monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys, "argv", ["trainer_bench.py", "--memory-cap-gib", "-1"])
    with pytest.raises(SystemExit):
        trainer_bench.main()
    assert "--memory-cap-gib -1.0: give a size in GiB" in capsys.readouterr().err
